"""What a running node says about itself: its `Node.Status`, its Prometheus families
(/metrics), and the live page's view of the swarm, served by its HTTP endpoint (web.py).

All of it is read from the node's parts (`NodeParts`, which NodeDaemon is); nothing here
changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc
import torch

from ravnest_node import devices
from ravnest_node.averaging import AveragingService
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.daemon.failover import Leadership
from ravnest_node.daemon.relays import Relays
from ravnest_node.daemon.web import (
    Family,
    WebServer,
    device_families,
    node_families,
    stage_families,
    swarm_page_data,
)
from ravnest_node.daemon.worker.worker import Worker
from ravnest_node.errors import PeerUnavailable, StartupError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.boundary import LinkCounters
from ravnest_node.transport.gate import TlsGate
from ravnest_node.transport.limits import PeerLimiter
from ravnest_node.transport.malformed import MalformedRequests
from ravnest_node.transport.options import TransportConfig, grpc_channel
from ravnest_node.transport.tunnel import host_port

log = logging.getLogger(__name__)

# Seconds the live page's request for the swarm's view waits for the coordinator.
WEB_SWARM_TIMEOUT_S = 5.0
# The page's view of the swarm is asked of the coordinator at most this often.
WEB_SWARM_EVERY_S = 1.0


MALFORMED_PEERS_SHOWN = 16
"""Peers whose malformed requests `status` lists (the most recent)."""


class NodeParts(Protocol):
    """The parts of a running node its status and metrics are read from."""

    @property
    def config(self) -> NodeConfig: ...
    @property
    def node_id(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def worker(self) -> Worker | None: ...
    @property
    def leadership(self) -> Leadership: ...
    @property
    def relays(self) -> Relays: ...
    @property
    def counters(self) -> LinkCounters: ...
    @property
    def limiter(self) -> PeerLimiter: ...
    @property
    def malformed(self) -> MalformedRequests: ...
    @property
    def averaging(self) -> AveragingService: ...
    @property
    def gate(self) -> TlsGate | None: ...


async def node_status(node: NodeParts, brief: bool = False) -> pb.NodeStatus:
    """`Node.Status` of `node`; `brief` leaves out what waits for the compute thread."""
    leadership = node.leadership
    status = pb.NodeStatus(
        node_id=node.node_id,
        address=node.address,
        stage=-1,
        bytes_sent=node.counters.total_bytes,
        role=pb.NODE_ROLE_COORDINATOR if leadership.service else pb.NODE_ROLE_WORKER,
        swarm_name=node.config.swarm_name,
        term=leadership.term,
    )
    creds = node.config.transport.credentials
    status.security = "open" if creds is None else "mtls"
    if creds is not None:
        status.certificate_expires = creds.expires.timestamp()
    if node.gate is not None:
        status.refused_connections = node.gate.refused
    status.banned_replicas.update(node.averaging.bans.banned)
    status.calls_limited = node.limiter.calls_refused
    status.messages_delayed = node.limiter.messages_delayed
    status.requests_malformed = node.malformed.total
    recent = list(node.malformed.by_peer.items())[-MALFORMED_PEERS_SHOWN:]
    status.requests_malformed_by_peer.update(recent)
    _relays_status(node.relays, status)
    if leadership.found is not None:
        status.coordinator_address = leadership.found.address
        status.coordinator_found_via = leadership.found.via
        status.coordinator_found_from = leadership.found.source
    if leadership.mdns is not None:
        status.mdns_peers = len(leadership.mdns.records())
    if node.worker is not None:
        _compute_status(node.worker, status)
        await _worker_status(node.worker, status, brief)
    return status


def compute_of(worker: Worker) -> tuple[torch.device, str]:
    """The device the worker computes on and the precision it computes in (its stage's, or
    before a plan what `auto` gives on its device)."""
    return worker.device, worker.precision


def _compute_status(worker: Worker, status: pb.NodeStatus) -> None:
    device, precision = compute_of(worker)
    status.device, status.precision = devices.describe(device), precision


def _relays_status(relays: Relays, status: pb.NodeStatus) -> None:
    if relays.tunnel is not None:
        status.relay = relays.tunnel.relay
    if relays.server is not None:
        status.relay_address = relays.server.address
        status.relayed.update(relays.server.tunnels())
        status.relayed_bytes.update(relays.server.bytes_carried())


async def _worker_status(worker: Worker, status: pb.NodeStatus, brief: bool) -> None:
    status.frames_refused = worker.frames_refused
    if worker.plan is not None:
        status.plan_epoch = worker.plan.epoch
    status.upstream_node_id = worker.upstream_node_id
    runtime = worker.runtime
    if runtime is not None:
        status.stage = runtime.spec.index
        status.first_block = runtime.spec.first_block
        status.stop_block = runtime.spec.stop_block
        status.version = runtime.version
        status.microbatches_in_flight = runtime.in_flight
        status.frames_accepted = runtime.frames_accepted
        status.run_done = runtime.done
        evals = runtime.evaluations
        if evals.step:
            status.eval_step, status.eval_loss = evals.step, evals.loss
        if not brief:  # the digest waits for the compute thread
            status.params_sha256 = await runtime.params_digest()


def node_metrics(node: NodeParts) -> list[Family]:
    """This node's Prometheus series (docs/operations.md)."""
    worker = node.worker
    service = node.leadership.service
    plan = worker.plan if worker else None
    if plan is None and service is not None:  # a lab coordinator holds no stage
        plan = service.plan
    families = node_families(
        node_id=node.node_id,
        swarm=node.config.swarm_name,
        role="coordinator" if service else "worker",
        plan=plan,
        link_bytes=node.counters.bytes_sent,
        calls_limited=node.limiter.calls_refused,
        requests_malformed=node.malformed.total,
        banned=len(node.averaging.bans.banned),
    )
    if worker is not None:
        families += _device_families(worker)
    runtime = worker.runtime if worker else None
    if runtime is not None:
        families += stage_families(
            runtime.spec,
            runtime.metrics(),
            step=runtime.version,
            samples=(runtime.version - runtime.start_step) * runtime.run_config.batch_size,
            loss=runtime.last_loss,
        )
    return families


def _device_families(worker: Worker) -> list[Family]:
    device, precision = compute_of(worker)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return device_families(
        str(device),
        precision,
        memory_in_use_bytes=devices.memory_in_use_bytes(device),
        memory_peak_bytes=peak,
        utilisation=devices.utilisation(device),
    )


def compute_page_data(worker: Worker | None) -> dict[str, Any]:
    """What the live page says of this node's compute: {"device", "precision"} (empty
    strings on a node without a worker)."""
    if worker is None:
        return {"device": "", "precision": ""}
    device, precision = compute_of(worker)
    return {"device": devices.describe(device), "precision": precision}


class SwarmPage:
    """The live page's data: the coordinator's view of the swarm, asked at most once per
    WEB_SWARM_EVERY_S however many pages and scrapers ask (one call in flight, its answer
    shared): the page must not spend this node's call budget at its coordinator.

    It owns that call and its channel: `close` ends both."""

    def __init__(
        self, swarm_name: str, transport: TransportConfig, coordinator: Callable[[], str | None]
    ) -> None:
        self._swarm_name = swarm_name
        self._transport = transport
        self._coordinator = coordinator
        """The address of the coordinator this node follows (None while it looks for it)."""
        self._view: tuple[float, dict[str, Any]] | None = None
        """The last data and when it came (loop time)."""
        self._call: asyncio.Task[dict[str, Any]] | None = None
        self._channel: tuple[str, grpc.aio.Channel] | None = None
        """The channel the calls use: (coordinator address, grpc.aio channel)."""

    async def data(self) -> dict[str, Any]:
        """The page's data (web.swarm_page_data); PeerError if the coordinator does not
        answer."""
        loop = asyncio.get_running_loop()
        cached = self._view
        if cached is not None and loop.time() - cached[0] < WEB_SWARM_EVERY_S:
            return cached[1]
        if self._call is None or self._call.done():
            self._call = loop.create_task(self._ask(), name="swarm-page")
        data = await asyncio.shield(self._call)
        self._view = loop.time(), data
        return data

    async def _ask(self) -> dict[str, Any]:
        address = self._coordinator()
        if address is None:
            raise PeerUnavailable("this node has not found its coordinator yet")
        if self._channel is None or self._channel[0] != address:
            if self._channel is not None:
                await self._channel[1].close()
            self._channel = address, grpc_channel(address, self._transport)
        try:
            view = await pb_grpc.CoordinatorStub(self._channel[1]).Swarm(
                pb.SwarmRequest(), timeout=WEB_SWARM_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise PeerUnavailable(f"{exc.code().name}: {exc.details()}") from None
        return swarm_page_data(self._swarm_name, view)

    async def close(self) -> None:
        """End the call in flight (if any) and close the channel."""
        call = self._call
        if call is not None:
            call.cancel()
            await asyncio.wait([call])
            if not call.cancelled():
                call.exception()  # a failed call was the page's answer; nothing more to say
        if self._channel is not None:
            await self._channel[1].close()


async def open_web(node: NodeParts, page: SwarmPage, stack: contextlib.AsyncExitStack) -> str:
    """Serve /metrics and the live page (web.py) until `stack` closes (then the page is
    closed too); the endpoint's HOST:PORT. StartupError if it cannot listen."""
    web_cfg = node.config.web
    assert web_cfg.metrics_port is not None

    async def page_data() -> dict[str, Any]:
        return {**await page.data(), "node": compute_page_data(node.worker)}

    web = WebServer(
        web_cfg.metrics_host, web_cfg.metrics_port, lambda: node_metrics(node), page_data
    )
    try:
        port = await web.start()
    except OSError as exc:
        raise StartupError(
            f"cannot serve metrics on {web_cfg.metrics_host}:{web_cfg.metrics_port}: "
            f"{exc.strerror or exc}"
        ) from None
    stack.push_async_callback(page.close)
    stack.push_async_callback(web.close)  # first: no page asks for data once the page closes
    address = host_port(web_cfg.metrics_host, port)
    log.info("metrics on http://%s/metrics, the swarm's page on http://%s/", address, address)
    return address
