"""A node's HTTP endpoint (`--metrics-port`): Prometheus metrics and a live page for people.

- `GET /metrics`: the node's series in Prometheus' text format (version 0.0.4), all named
  `ravnest_*` (docs/operations.md lists them).
- `GET /`: a page that shows the swarm (who owns which blocks of which pipeline), its
  throughput and the loss curve, refreshed every second from `/swarm.json`.
- `GET /swarm.json`: what the page draws, from the node's coordinator (its `Swarm` call).

It is plain HTTP on `metrics_host` (loopback unless told otherwise) and answers GET only: no
request body is read, a request head over MAX_HEAD_BYTES or slower than HEAD_TIMEOUT_S is
dropped, and at most MAX_CONNECTIONS are served at once. It shows what `status` shows and
changes nothing. `/swarm.json` asks the coordinator at most once a second, whoever asks it
(status.py), so that pages and scrapers cannot spend the node's calls at its coordinator.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ravnest_node.errors import PeerError
from ravnest_node.pipeline.metrics import StageMetrics, from_report, samples_of
from ravnest_node.pipeline.metrics import summary as metrics_summary
from ravnest_node.pipeline.stage import StageSpec
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.version import __version__

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 32
CONTENT_TYPES = {
    "metrics": "text/plain; version=0.0.4; charset=utf-8",
    "json": "application/json",
    "html": "text/html; charset=utf-8",
}


@dataclass(frozen=True, slots=True)
class Family:
    """One metric: its samples, each with its labels."""

    name: str
    help: str
    kind: str = "gauge"
    """gauge or counter."""
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append((labels, value))
        return self


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def render_metrics(families: Iterable[Family]) -> str:
    """The Prometheus text format of `families` (those without samples are left out)."""
    lines: list[str] = []
    for f in families:
        if not f.samples:
            continue
        lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {f.kind}"]
        for labels, value in f.samples:
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{f.name}{{{inner}}} {_number(value)}" if inner else
                         f"{f.name} {_number(value)}")  # fmt: skip
    return "\n".join(lines) + "\n"


def node_families(
    *,
    node_id: str,
    swarm: str,
    role: str,
    plan: pb.Plan | None,
    link_bytes: Mapping[str, int],
    calls_limited: int,
    banned: int,
    requests_malformed: int = 0,
) -> list[Family]:
    """The series every node has, stage or not. Pure."""
    info = Family("ravnest_info", "This node: its id, swarm, role and version (always 1).")
    links = Family("ravnest_link_bytes_sent_total", "Data-plane bytes sent, per peer.", "counter")
    for peer, nbytes in sorted(link_bytes.items()):
        links.add(nbytes, peer=peer)
    return [
        info.add(1, node_id=node_id, swarm=swarm, role=role, version=__version__),
        Family("ravnest_plan_epoch", "Epoch of the plan this node trains (0: none yet).").add(
            plan.epoch if plan else 0
        ),
        Family("ravnest_peers", "Other nodes in this node's plan.").add(
            max(0, len(plan.stages) - 1) if plan else 0
        ),
        links,
        Family("ravnest_calls_limited_total", "Calls refused by per-peer limits.", "counter").add(
            calls_limited
        ),
        Family(
            "ravnest_requests_malformed_total",
            "Requests that did not parse as their method's message (refused).",
            "counter",
        ).add(requests_malformed),
        Family("ravnest_banned_replicas", "Replicas banned from averaging for the run.").add(
            banned
        ),
    ]


def device_families(
    device: str,
    precision: str,
    *,
    memory_in_use_bytes: int | None,
    memory_peak_bytes: int | None,
    utilisation: float | None,
) -> list[Family]:
    """The series of the device a node computes on (`device` as torch names it, e.g. "cuda:0"
    or "cpu"; `precision` resolved: fp32, bf16 or fp16); the memory and utilisation series
    only where the driver tells them (None: not on the CPU). Pure."""
    labels = {"device": device}
    families = [
        Family(
            "ravnest_device_info", "The device this node computes on and its precision (always 1)."
        ).add(1, precision=precision, **labels),
        Family("ravnest_device_memory_bytes", "Bytes torch holds in tensors on the device."),
        Family(
            "ravnest_device_memory_peak_bytes",
            "The most bytes torch held in tensors on the device since the node started.",
        ),
        Family(
            "ravnest_device_utilisation",
            "Share of the driver's last sample period the device was busy (0 to 1).",
        ),
    ]
    for family, value in zip(
        families[1:], (memory_in_use_bytes, memory_peak_bytes, utilisation), strict=True
    ):
        if value is not None:
            family.add(value, **labels)
    return families


def stage_families(
    spec: StageSpec, m: StageMetrics, *, step: int, samples: int, loss: float
) -> list[Family]:
    """The series of a node's stage (`samples` trained by its pipeline since the stage
    started, `loss` of the last step on the last stage): those the metrics record declares
    (pipeline/metrics.py), and a few derived from it. Pure."""
    stage = {"stage": str(spec.index)}
    ratio = Family("ravnest_codec_ratio", "Bytes as float32 per byte sent, per role (1: fp32).")
    for role, raw, wire in (
        ("activation", m.activation_fp32_bytes, m.activation_bytes_sent),
        ("gradient", m.gradient_fp32_bytes, m.gradient_bytes_sent),
    ):
        if wire:
            ratio.add(raw / wire, role=role, **stage)
    rate = samples / m.wall_s if m.wall_s > 0 else 0.0
    busy = m.busy_fraction if m.wall_s > 0 else 0.0
    families = [
        Family("ravnest_step", "Optimizer steps this stage has applied.").add(step, **stage),
        Family("ravnest_samples_per_second", "Samples/s of this stage since it started.").add(
            rate, **stage
        ),
        Family("ravnest_stage_busy_fraction", "Share of time spent computing.").add(busy, **stage),
        ratio,
    ]
    declared: dict[str, Family] = {}
    for spec_, labels, value in samples_of(m):
        family = declared.setdefault(spec_.name, Family(spec_.name, spec_.help, spec_.kind))
        family.add(value, **labels, **stage)
    families += declared.values()
    if spec.is_last and math.isfinite(loss):
        families.append(
            Family("ravnest_loss", "Training loss of the last step.").add(loss, **stage)
        )
    if m.eval_step:
        families += [
            Family("ravnest_eval_loss", "Mean loss of the newest evaluation on held-out "
                   "data.").add(m.eval_loss, **stage),
            Family("ravnest_eval_step", "The step the newest evaluation followed.").add(
                m.eval_step, **stage
            ),
        ]  # fmt: skip
    return families


def swarm_page_data(swarm: str, view: pb.SwarmView) -> dict[str, Any]:
    """What the page draws, from the coordinator's view of the swarm. Pure."""
    stages = {s.node_id: s for s in view.plan.stages}
    members = []
    for m in view.members:
        stage = stages.get(m.node_id)
        members.append(
            {
                "node_id": m.node_id,
                "address": m.address,
                "pipeline": stage.pipeline if stage else None,
                "stage": stage.index if stage else None,
                "blocks": [stage.first_block, stage.stop_block] if stage else None,
                "speed": m.speed,
                "gone": m.lease_expired or m.left,
            }
        )
    return {
        "swarm": swarm,
        "plan_epoch": view.plan.epoch if view.HasField("plan") else 0,
        "model": view.plan.run.model if view.HasField("plan") else "",
        "steps": view.plan.run.steps if view.HasField("plan") else 0,
        "step": view.step,
        "samples": view.samples,
        "samples_per_s": view.samples_per_s,
        "done": view.done,
        "members": members,
        "loss": [[s, v] for s, v in zip(view.loss_steps, view.losses, strict=True)],
        "eval_loss": [[s, v] for s, v in zip(view.eval_steps, view.eval_losses, strict=True)],
        "stages": [_stage_row(r) for r in view.stages],
    }


def _stage_row(report: pb.StageReport) -> dict[str, Any]:
    """A row of the page's stage table: where the stage is, and every metric of its latest
    report by its name in the metrics record."""
    where = {"pipeline": report.pipeline, "stage": report.stage, "node_id": report.node_id}
    return {**where, "step": report.step, **metrics_summary(from_report(report))}


@functools.cache
def page() -> bytes:
    """The live page (static, read once; it fetches /swarm.json)."""
    return resources.files("ravnest_node.daemon").joinpath("page.html").read_bytes()


class WebServer:
    """The HTTP endpoint: `metrics()` gives the families, `swarm()` the page's data (or
    raises, and the page says the coordinator does not answer)."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Callable[[], Iterable[Family]],
        swarm: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self._host, self._port = host, port
        self._metrics = metrics
        self._swarm = swarm
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        """The connections open now."""

    async def start(self) -> int:
        """Listen; the port (OSError if it cannot)."""
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, limit=MAX_HEAD_BYTES
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and end the connections still open (the node is stopping)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if len(self._writers) > MAX_CONNECTIONS:
                return
            try:
                async with asyncio.timeout(HEAD_TIMEOUT_S):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return
            status, kind, body = await self._answer(head)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPES[kind]}\r\n"
                f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, head: bytes) -> tuple[str, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"GET":
            return "405 Method Not Allowed", "json", b'{"error": "GET only"}'
        path = parts[1].split(b"?", 1)[0]
        if path == b"/metrics":
            return "200 OK", "metrics", render_metrics(self._metrics()).encode()
        if path == b"/":
            return "200 OK", "html", page()
        if path == b"/swarm.json":
            try:
                data = await self._swarm()
            except PeerError as exc:  # shown on the page: the coordinator may be restarting
                log.debug("swarm view for the page failed: %r", exc)
                data = {"error": f"the coordinator does not answer: {exc}"}
            return "200 OK", "json", json.dumps(data).encode()
        return "404 Not Found", "json", b'{"error": "no such page"}'
