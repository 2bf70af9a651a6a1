"""Running one system of a bench scenario over its emulated links, into one record.

The systems (`config.SYSTEMS`): `compute-bound` (all stages in one process, every core: the
ceiling), `naive` (fp32 frames, one microbatch at a time), `ours` (the defaults), `ours-tls`
(ours in a protected swarm), `torch-pipelining` (PyTorch's own pipelining over gloo, in network
namespaces only) and `hivemind` (reported as skipped).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ravnest_node.bench import link_bound, torch_pipe
from ravnest_node.bench.config import NODES, BenchConfig, cores
from ravnest_node.bench.held_out import held_out_loss
from ravnest_node.bench.links import SCENARIOS, NetnsSwarm
from ravnest_node.bench.report import Record
from ravnest_node.bench.scenario_links import ScenarioLinks
from ravnest_node.devices import resolve_device, resolve_precision
from ravnest_node.errors import RunFailed
from ravnest_node.launch.demo import Demo, DemoConfig, NodeSlot
from ravnest_node.launch.progress import ProgressBar
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.credentials import create_swarm
from ravnest_node.transport.options import TransportConfig

TORCH_PORT = 29500


class Interrupted(Exception):
    """A stop was requested (Ctrl-C, SIGTERM) while a system ran."""


def _bench_swarm(work_dir: Path) -> Path:
    """Credentials of a protected swarm for `ours-tls`, made once per bench work dir."""
    out = work_dir / "swarm-credentials"
    if not (out / "member.pem").exists():
        create_swarm("bench", out)
    return out


def on_device(cfg: DemoConfig, device: str) -> DemoConfig:
    """`cfg` with its node processes on `device` (their --device)."""
    return dataclasses.replace(cfg, device=device)


def _steady_step_s(times: Sequence[float]) -> float:
    """Seconds per step after the first (which includes connecting and warm-up)."""
    if len(times) < 2:
        return times[-1] if times else math.nan
    return (times[-1] - times[0]) / (len(times) - 1)


class SystemRunner:
    """Runs one system at a time and returns its record; `stop()` interrupts the one running
    (its `run` then raises Interrupted) and every later one."""

    def __init__(self, cfg: BenchConfig, out: TextIO) -> None:
        self.cfg = cfg
        self.out = out
        self.train = cfg.run_train
        self.stopped = asyncio.Event()
        self._demo: Demo | None = None
        self.device = resolve_device(cfg.device)

    def stop(self) -> None:
        self.stopped.set()
        if self._demo is not None:
            self._demo.stop()

    def _base(self, system: str, scenario: str, links: ScenarioLinks | None) -> Record:
        t = self.train
        link = links.link if links else None
        return {
            "system": system,
            "scenario": scenario,
            "nodes": 1 if system == "compute-bound" else NODES,
            "link": (
                {
                    "rate_mbit": link.rate_mbit,
                    "delay_ms": link.delay_ms,
                    "emulation": links.mode if links else "none",
                }
                if link and system != "compute-bound"
                else None
            ),
            "gpu_like": self.cfg.gpu_like,
            **(
                {"nominal_link": {"rate_mbit": nominal.rate_mbit, "delay_ms": nominal.delay_ms}}
                if self.cfg.gpu_like > 1 and (nominal := SCENARIOS.get(scenario))
                else {}
            ),
            "model": t.model,
            "steps": t.steps,
            "batch_size": t.batch_size,
            "microbatches": t.microbatches,
            "samples": t.steps * t.batch_size,
            "codec": t.activation,
            "gradient_codec": t.gradient,
            "max_staleness": t.max_staleness,
            "staleness_warmup_steps": t.staleness_warmup_steps,
            "stale_microbatches": t.stale_microbatches,
            "stale_after_backwards": t.stale_after_backwards,
            "ahead_wait_share": t.ahead_wait_share,
            "weight_prediction": t.weight_prediction,
            "replicas": 1,
            "seed": t.seed,
            "threads_per_node": cores() if system == "compute-bound" else self.cfg.compute_threads,
            "device": str(self.device),
            "precision": resolve_precision(getattr(t, "precision", "fp32"), self.device),
        }

    async def run(self, system: str, scenario: str, links: ScenarioLinks) -> Record:
        """Run `system` over `links`: its record, or one that says why it was skipped.
        RunFailed if it failed, Interrupted on a stop."""
        base = self._base(system, scenario, links)
        if system == "hivemind":
            return base | {"skipped": "hivemind needs its p2pd daemon binary and its own torch "
                                      "pins; `bench replicas` compares our averaging traffic "
                                      "with its scheme"}  # fmt: skip
        if system == "torch-pipelining":
            if self.device.type != "cpu":
                return base | {"skipped": f"the gloo baseline runs on the CPU, not {self.device}"}
            if links.netns is None:
                why = "needs network namespaces (root): gloo links peer to peer, past any relay"
                return base | {"skipped": why}
            if link_bound.slow(links.link):
                return base | {"skipped": f"too slow to run on a link under "
                                          f"{link_bound.SLOW_LINK_MBIT:g} Mbit/s (minutes per "
                                          f"step of fp32 frames)"}  # fmt: skip
            return base | await self._run_torch(system, links)
        # Pipelines of the workload's shape, one stage per node, whatever the planner would
        # make of the links (it may leave slow-linked nodes spare): what is compared is the
        # pipeline.
        per_pipeline = len(links.slots) // self.train.pipelines
        shaped = dataclasses.replace(self.train, stages=self.train.stages or per_pipeline)
        if system == "ours-tls":  # what protecting the swarm costs
            protected = dataclasses.replace(
                self.cfg.transport, swarm_dir=_bench_swarm(links.work_dir), token=None
            )
            threads = self.cfg.compute_threads
            return base | await self._run_ours(
                system, shaped, links.slots, links, threads, transport=protected
            )
        if system == "compute-bound":  # the ceiling: one process with every core
            alone = dataclasses.replace(self.train, stages=0)
            ceiling = await self._run_ours(system, alone, [NodeSlot()], links, cores())
            return base | ceiling
        if system == "naive":  # fp32 frames, one microbatch at a time, whatever ours uses
            train = dataclasses.replace(
                shaped,
                schedule="sequential",
                max_staleness=0,
                codec="none",
                activation_codec="",
                gradient_codec="",
                lz4=False,
            )
            base |= {"codec": "none", "gradient_codec": "none", "max_staleness": 0}
            if link_bound.slow(links.link):  # a few steps, extrapolated
                few = dataclasses.replace(train, steps=link_bound.ESTIMATE_STEPS)
                base |= {"steps": few.steps, "samples": few.steps * few.batch_size}
                measured = base | await self._run_ours(
                    system, few, links.slots, links, self.cfg.compute_threads, evaluate=False
                )
                return link_bound.estimated(measured, self.train.steps)
        else:
            train = dataclasses.replace(shaped, schedule="gpipe")
        return base | await self._run_ours(
            system, train, links.slots, links, self.cfg.compute_threads
        )

    async def _run_ours(
        self,
        system: str,
        train: TrainConfig,
        slots: list[NodeSlot],
        links: ScenarioLinks,
        threads: int,
        transport: TransportConfig | None = None,
        *,
        evaluate: bool = True,
    ) -> Record:
        """A run of our nodes (or of the one compute-bound process); with `evaluate`, its final
        model's `held_out_loss` too (bench/held_out.py)."""
        run_dir = links.work_dir / system
        cfg = on_device(
            DemoConfig(
                nodes=len(slots),
                work_dir=run_dir,
                compute_threads=threads,
                train=train,
                transport=transport or self.cfg.transport,
            ),
            self.cfg.device,
        )
        log_path = run_dir / "progress.log"
        run_dir.mkdir(parents=True, exist_ok=True)
        log = await asyncio.to_thread(open, log_path, "w")
        with log:
            bar = ProgressBar(self.out, f"  {system:<17}", train.steps)
            demo = Demo(cfg, log, slots=slots, every=1, on_progress=lambda e: bar.update(e.step))
            self._demo = demo
            tx_before = links.tx_bytes() if len(slots) > 1 else None
            try:
                summary = await demo.run()
            finally:
                self._demo = None
                bar.clear()
            tx_after = links.tx_bytes() if len(slots) > 1 else None
        if summary is None:
            raise Interrupted
        steps = [e for e in demo.events if not e.done]
        record = _ours_record(summary, steps, train.batch_size, run_dir)
        warm, later = link_bound.phase_step_s(
            {e.step: e.wall_s for e in steps}, train.staleness_warmup_steps, train.max_staleness
        )
        record["warmup_step_s"], record["async_step_s"] = warm, later
        if tx_before is not None and tx_after is not None:
            record["link_bytes"] = sum(tx_after) - sum(tx_before)
            record["node_link_bytes"] = [a - b for a, b in zip(tx_after, tx_before, strict=True)]
        if evaluate and self.cfg.held_out:
            record["held_out_samples"] = self.cfg.held_out
            record["held_out_loss"] = await asyncio.to_thread(
                held_out_loss, train, run_dir, self.cfg.held_out, self.device
            )
        return record

    async def _run_torch(self, system: str, links: ScenarioLinks) -> Record:
        assert links.netns is not None
        run_dir = links.work_dir / system
        run_dir.mkdir(parents=True, exist_ok=True)
        outs = [run_dir / f"rank{r}.jsonl" for r in range(NODES)]
        tx_before = links.tx_bytes()
        procs: list[asyncio.subprocess.Process] = []
        try:
            await self._start_torch_ranks(links.netns, run_dir, outs, procs)
            await self._wait_torch_ranks(procs, run_dir)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        tx_after = links.tx_bytes()
        assert tx_before is not None and tx_after is not None
        result = torch_pipe.read_results(outs)
        return _torch_record(self.train, result, tx_before, tx_after, run_dir)

    async def _start_torch_ranks(
        self,
        netns: NetnsSwarm,
        run_dir: Path,
        outs: list[Path],
        procs: list[asyncio.subprocess.Process],
    ) -> None:
        """One `torch_pipe` process per rank in its host's namespace, each appended to `procs`
        as soon as it started (the caller ends them)."""
        t = self.train
        master = f"{netns.hosts[0].address}:{TORCH_PORT}"
        for r in range(NODES):
            host = netns.hosts[r]
            argv = torch_pipe.command(
                r, NODES, master, model=t.model, steps=t.steps, batch_size=t.batch_size,
                microbatches=t.microbatches, lr=t.lr, seed=t.seed,
                threads=self.cfg.compute_threads, out=outs[r], ifname=host.ifname,
            )  # fmt: skip
            env = os.environ | {"GLOO_SOCKET_IFNAME": host.ifname}
            log = await asyncio.to_thread(open, run_dir / f"rank{r}.log", "wb")
            with log:
                procs.append(
                    await asyncio.create_subprocess_exec(
                        *netns.exec_prefix(r),
                        *argv,
                        env=env,
                        stdout=log,
                        stderr=log,
                        stdin=asyncio.subprocess.DEVNULL,
                    )
                )

    async def _wait_torch_ranks(
        self, procs: list[asyncio.subprocess.Process], run_dir: Path
    ) -> None:
        """Until every rank has exited (RunFailed unless all with status 0) or a stop
        (Interrupted)."""
        everyone: asyncio.Future[Any] = asyncio.ensure_future(
            asyncio.gather(*(p.wait() for p in procs))
        )
        stop: asyncio.Future[Any] = asyncio.ensure_future(self.stopped.wait())
        try:
            await asyncio.wait([everyone, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            everyone.cancel()
        if self.stopped.is_set():
            raise Interrupted
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RunFailed(f"torch-pipelining ranks exited with {codes}; logs in {run_dir}")


def _ours_record(
    summary: dict[str, Any], steps: Sequence[pb.Progress], batch_size: int, run_dir: Path
) -> Record:
    """The record of a run of our nodes from its summary (`Demo.run`) and its steps' progress
    events."""
    step_s = _steady_step_s([e.wall_s for e in steps])
    return {
        "wall_s": summary["wall_s"],
        "step_s": step_s,
        "samples_per_s": batch_size / step_s,
        "bytes_on_wire": summary["bytes_on_wire"],
        "bytes_per_sample": summary["bytes_per_sample"],
        # What the compression issue counts: the boundary tensors' frames, without the
        # link probes and control traffic that bytes_per_sample also holds.
        "activation_bytes_per_sample": summary["activation_bytes_per_sample"],
        "gradient_bytes_per_sample": summary["gradient_bytes_per_sample"],
        "bytes_source": "transport",
        "initial_loss": summary["initial_loss"],
        "final_loss": summary["final_loss"],
        "loss_history": summary["loss_history"],
        "final_params_l2": summary["final_params_l2"],
        "node_bytes_sent": [s["bytes_sent"] for s in summary["stages"]],
        # Audits of neighbours' microbatches (pipeline/auditor.py): their records' bytes travel
        # beside the boundary streams and are not in bytes_on_wire.
        "audits": sum(s.get("audits", 0) for s in summary["stages"]),
        "audit_bytes": sum(s.get("audit_bytes", 0) for s in summary["stages"]),
        "audit_s": sum(s.get("audit_s", 0.0) for s in summary["stages"]),
        "audits_skipped": sum(s.get("audits_skipped", 0) for s in summary["stages"]),
        "stage_compute_s": [s["compute_s"] for s in summary["stages"]],
        # Each stage's wait for the update's gradients, and whether it tried and kept the
        # whole step ahead instead (pipeline/ahead.py; the step from which it did, 0 if not).
        "stage_ahead_wait_s": [s.get("ahead_wait_s", 0.0) for s in summary["stages"]],
        "ahead_trial_from": [s.get("ahead_trial_from", 0) for s in summary["stages"]],
        "whole_step_ahead_from": [s.get("whole_step_ahead_from", 0) for s in summary["stages"]],
        # Which codec each stage's frames went in (what `auto` chose, per link and role).
        "codec_frames": link_bound.codec_choice(summary["stages"]),
        "curve": _curve(steps, batch_size),
        "log": str(run_dir),
    }


def _torch_record(
    t: TrainConfig, result: dict[str, Any], tx_before: list[int], tx_after: list[int], run_dir: Path
) -> Record:
    """The record of a torch-pipelining run from its ranks' merged results (`read_results`) and
    the interface counters before and after it."""
    step_s = _steady_step_s(result["t_history"])
    link_bytes = sum(tx_after) - sum(tx_before)
    # Each rank counts its interface's bytes from the barrier before step 1.
    tx_hist = result["tx_bytes_history"] or [0] * t.steps
    curve = [
        [(i + 1) * t.batch_size, tt, tx, loss]
        for i, (tt, tx, loss) in enumerate(
            zip(result["t_history"], tx_hist, result["loss_history"], strict=True)
        )
    ]
    return {
        "wall_s": result["wall_s"],
        "step_s": step_s,
        "samples_per_s": t.batch_size / step_s,
        "bytes_on_wire": link_bytes,
        "bytes_per_sample": link_bytes / (t.steps * t.batch_size),
        "bytes_source": "interface counters (gloo is not ours to instrument; includes TCP/IP)",
        "link_bytes": link_bytes,
        "node_link_bytes": [a - b for a, b in zip(tx_after, tx_before, strict=True)],
        "initial_loss": result["loss_history"][0],
        "final_loss": result["loss_history"][-1],
        "loss_history": result["loss_history"],
        "curve": curve,
        "log": str(run_dir),
        "note": "rate caps apply; the delay relay cannot be placed on gloo's direct links",
    }


def _curve(events: Sequence[pb.Progress], batch_size: int) -> list[list[float]]:
    return [[e.step * batch_size, e.wall_s, e.bytes_on_wire, e.loss] for e in events]
