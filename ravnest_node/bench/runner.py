"""`ravnest-node bench`: real node processes over emulated links, against the alternatives.

For each scenario (a link: rate and one-way delay) the harness runs every system on the same
model, data, seed and number of samples, and writes one JSON object per run to the JSONL file:

- `compute-bound`: all stages in one node process, no network: the ceiling;
- `naive`: our stages, fp32 frames, one microbatch at a time through the pipeline, a flush every
  step (the "each layer waits for all others" pipeline);
- `ours`: the current defaults (GPipe-style overlap of a step's microbatches, synchronous steps);
- `torch-pipelining`: PyTorch's own `torch.distributed.pipelining` (1F1B, gloo), same stage cut;
- `hivemind`: data-parallel averaging; reported as skipped until ravnest-node has replica
  averaging to compare with (and unless it is installed).

On links under 5 Mbit/s (mobile, and dilated ones) naive runs 3 steps and its full run is
estimated from them (the record's `estimated` says how), and torch-pipelining is skipped
(`link_bound`). `--gpu-like F` dilates every link by F (rate / F, delay x F) with compute as it
is: the link-bound regime of a node F times faster than this machine, on the nominal link.

Links, as root: each node in its own network namespace on a bridge, its link capped in both
directions by `tc tbf`, and a relay in front of each node's gRPC server adding the one-way delay
(the kernel here has no netem). Without root, relays on loopback do both rate and delay, per
connection rather than per host, and the output says so. Namespaces are removed afterwards, also
when a run fails or is interrupted.

This module runs the scenarios one after the other and writes the records; the settings are in
`config` (BenchConfig), a scenario's links in `scenario_links`, running one system in `systems`,
the fields that need a whole scenario in `efficiency`, the table and plot in `report`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from ravnest_node.bench.config import BenchConfig
from ravnest_node.bench.efficiency import finish_scenario
from ravnest_node.bench.links import SCENARIOS, dilate, netns_available, remove_leftovers
from ravnest_node.bench.report import Record, gpu_like_note, markdown_table, plot, rounds_table
from ravnest_node.bench.scenario_links import ScenarioLinks
from ravnest_node.bench.systems import Interrupted, SystemRunner
from ravnest_node.devices import describe
from ravnest_node.errors import RunFailed
from ravnest_node.launch.signals import install_stop_handlers
from ravnest_node.models import get_model


class Bench:
    """Runs the configured scenarios and systems; `stop()` interrupts cleanly."""

    def __init__(self, cfg: BenchConfig, out: TextIO) -> None:
        self.cfg = cfg
        self.out = out
        self.train = cfg.run_train
        self.model = get_model(self.train.model)
        self.records: list[Record] = []
        self.systems = SystemRunner(cfg, out)
        self.work_dir = cfg.work_dir or Path(tempfile.mkdtemp(prefix="ravnest-bench-"))

    def stop(self) -> None:
        self.systems.stop()

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _mode(self) -> str:
        if self.cfg.emulation == "relay":
            return "relay"
        ok, why = netns_available()
        if ok:
            return "netns"
        if self.cfg.emulation == "netns":
            raise RunFailed(f"--emulation netns is not possible here: {why}")
        self.say(f"note: {why}; emulating links with loopback relays only (rate is per connection)")
        return "relay"

    async def run(self) -> list[Record]:
        mode = self._mode()
        if mode == "netns":
            for leftover in remove_leftovers():
                self.say(f"removed {leftover}, left behind by an earlier run that was killed")
        self.cfg.jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.cfg.jsonl.write_text("")
        self.say(
            f"ravnest-node bench: {self.train.model}, {self.train.steps} steps of "
            f"{self.train.batch_size} samples per system on {describe(self.systems.device)}; "
            f"work dir {self.work_dir}"
        )
        rounds = self.cfg.rounds
        for round_, name in ((r, n) for r in range(rounds) for n in self.cfg.scenario_names):
            if self.systems.stopped.is_set():
                break
            link = dilate(SCENARIOS[name], self.cfg.gpu_like)
            work = self.work_dir / name / (f"round-{round_}" if rounds > 1 else "")
            links = ScenarioLinks(link, mode, work)
            async with links.up():
                self.say(f"scenario {name}: {link.rate_mbit:g} Mbit/s, {link.delay_ms:g} ms "
                         f"one way ({links.description})"
                         + (f", round {round_ + 1} of {rounds}" if rounds > 1 else ""))  # fmt: skip
                if self.cfg.gpu_like > 1:
                    self.say(f"  {gpu_like_note(self.cfg.gpu_like)}")
                scenario_records: list[Record] = []
                for system in self.cfg.system_list:
                    if self.systems.stopped.is_set():
                        break
                    try:
                        record = await self.systems.run(system, name, links)
                    except Interrupted:
                        break
                    if rounds > 1:
                        record["round"] = round_
                    scenario_records.append(record)
                    self._emit(record)
                finish_scenario(scenario_records, self.model, self.train)
        self._rewrite_jsonl()
        return self.records

    def _emit(self, record: Record) -> None:
        self.records.append(record)
        with open(self.cfg.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        if "skipped" in record:
            self.say(f"  {record['system']:<17} skipped: {record['skipped']}")
        else:
            est = " (est.)" if "estimated" in record else ""
            self.say(
                f"  {record['system']:<17} {record['samples_per_s']:7.2f} samples/s{est}  "
                f"{record['bytes_per_sample']:>10,.0f} B/sample  "
                f"loss {record['initial_loss']:.3f} -> {record['final_loss']:.3f}"
                + (f", held-out {h:.3f}" if (h := record.get("held_out_loss")) else "")
            )

    def _rewrite_jsonl(self) -> None:
        """Rewrite with the fields known only after a scenario (efficiency, equal samples)."""
        self.cfg.jsonl.write_text("".join(json.dumps(r) + "\n" for r in self.records))


def run_bench(cfg: BenchConfig, out: TextIO = sys.stdout) -> int:
    """The `bench` command: run, then write the table and plot beside the JSONL."""

    async def main() -> list[Record]:
        bench = Bench(cfg, out)
        install_stop_handlers(asyncio.get_running_loop(), bench.stop)
        return await bench.run()

    started = time.monotonic()
    records = asyncio.run(main())
    if len(records) < cfg.rounds * len(cfg.scenario_names) * len(cfg.system_list):
        print(f"interrupted: {len(records)} run(s) finished", file=out)
    table = markdown_table(records)
    if cfg.rounds > 1:
        table += "\n" + rounds_table(records)
    table_path = cfg.jsonl.with_suffix(".md")
    table_path.write_text(table)
    print(file=out)
    print(table, file=out)
    why_not = plot(records, cfg.jsonl.with_suffix(".png"))
    print(f"wrote {cfg.jsonl}, {table_path}"
          + (f"; no plot: {why_not}" if why_not else f", {cfg.jsonl.with_suffix('.png')}")
          + f" in {time.monotonic() - started:.0f} s", file=out, flush=True)  # fmt: skip
    return 0
