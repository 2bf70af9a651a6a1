"""The node daemon: one process, one event loop, one TaskGroup owning every background task.

`NodeDaemon.run` opens the gRPC server (boundary streams, node status and, on the coordinator,
the coordinator service), starts mDNS if asked, signals readiness, finds the coordinator if no
address was given (coordination/locate.py), runs the worker, and on `stop()` (SIGINT/SIGTERM)
leaves the TaskGroup, stops mDNS (goodbye packets) and the server with a grace period and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from ravnest_node.averaging import AveragingService
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.coordination.coordinator import CoordinatorService
from ravnest_node.coordination.election import Ballot, ElectionService, VoteBook, stand
from ravnest_node.coordination.locate import (
    AskStatus,
    Found,
    check_coordinator,
    grpc_status_asker,
    grpc_vote_asker,
    locate_coordinator,
)
from ravnest_node.coordination.store import CoordinatorStore
from ravnest_node.daemon.config import (
    JOIN_AUTO,
    JOIN_ELECT,
    NodeConfig,
    ipaddress_is_wildcard,
    is_address,
    parse_port_range,
)
from ravnest_node.daemon.web import (
    Family,
    WebServer,
    node_families,
    stage_families,
    swarm_page_data,
)
from ravnest_node.daemon.worker import Worker, coordinator_errors
from ravnest_node.discovery import (
    Advertisement,
    MdnsDiscovery,
    TxtRecord,
    advertised_ips,
)
from ravnest_node.errors import (
    PeerError,
    PeerRefused,
    PeerUnavailable,
    RavnestError,
    RunFailed,
    StartupError,
    Unreachable,
)
from ravnest_node.models.pretrained import local_paths
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import PROTOCOL
from ravnest_node.state import load_or_create_node_id, write_atomic
from ravnest_node.transport.boundary import BoundaryServer, LinkCounters
from ravnest_node.transport.errors import Refusal, unanswered
from ravnest_node.transport.gate import TlsGate
from ravnest_node.transport.limits import PeerLimiter
from ravnest_node.transport.options import (
    TransportConfig,
    grpc_channel,
    server_options,
    split_host_port,
)
from ravnest_node.transport.probe import ProbeServer
from ravnest_node.transport.tunnel import RelayServer, TunnelClient, connect_rtt, host_port

T = TypeVar("T")
log = logging.getLogger(__name__)

READY_FILE = "ready.json"
# Calls a node serves at once (boundary streams, control calls, status); more fail. One peer
# gets at most TransportConfig.peer_max_calls of them (transport/limits.py).
MAX_CONCURRENT_RPCS = 1024
SUMMARY_FILE = "summary.json"
# Seconds a stopping node's own tasks get to end before its server's calls are ended for them.
STOP_TASKS_S = 1.0
# Seconds the live page's request for the swarm's view waits for the coordinator.
WEB_SWARM_TIMEOUT_S = 5.0
# The page's view of the swarm is asked of the coordinator at most this often.
WEB_SWARM_EVERY_S = 1.0
# A stopping node's last checkpoint: seconds its stage may take to end at a step boundary, and
# then to pause where it is if it could not (writing it is not cut short: the stop watchdog
# bounds the whole stop).
STOP_DRAIN_S = 3.0
STOP_PAUSE_S = 1.0
FAILOVER_STAND_S = 1.0
"""In a failover election the plan's members stand in the order of their node ids, this many
seconds apart: the first at once, each next one only if no coordinator has come up by then."""
FAILOVER_STATUS_S = 2.0
"""How long a failover waits for a member's Node.Status when looking for the new coordinator."""

# --no-inbound without --relay: of the relays the coordinator offers, at most this many are
# timed, each connect within this many seconds.
MAX_RELAY_OFFERS = 16
RELAY_RTT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node announces when it is ready."""

    node_id: str
    address: str
    pid: int
    coordinator: bool
    metrics: str = ""
    """HOST:PORT of its HTTP endpoint (--metrics-port: /metrics and the live page), or ""."""


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, daemon: NodeDaemon) -> None:
        self._daemon = daemon

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.NodeStatus:
        return await self._daemon.status(brief=request.brief)

    async def FetchBlock(
        self, request: pb.BlockRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.BlockChunk]:
        async for chunk in self._from_worker(context, lambda w: w.fetch_block(request)):
            yield chunk

    async def FetchCheckpoint(
        self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.CheckpointChunk]:
        async for chunk in self._from_worker(context, lambda w: w.fetch_checkpoint(request)):
            yield chunk

    async def _from_worker(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        stream: Callable[[Worker], AsyncIterator[T]],
    ) -> AsyncIterator[T]:
        """What the worker streams; its Refusal as the call's status."""
        worker = self._daemon.worker
        if worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node is starting")
        assert worker is not None
        try:
            async for item in stream(worker):
                yield item
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.reason)
            raise  # not reached: abort raises


async def probe_node(
    node_id: str, address: str, timeout_s: float, tries: int = 2, *, transport: TransportConfig
) -> bool:
    """Is node `node_id` alive at `address`? It answers a brief Node.Status (no compute)
    within `timeout_s` with its id, on the first or a later try (Coordinator.Suspect).
    Another node at that address is not it. (The node started again there is: its Join tells
    the coordinator of the restart.)"""
    for _ in range(tries):
        async with grpc_channel(address, transport) as channel:
            try:
                status = await pb_grpc.NodeStub(channel).Status(
                    pb.StatusRequest(brief=True), timeout=timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if unanswered(exc.code()):
                    continue
                return True  # it answered, if only to refuse
            return bool(status.node_id == node_id)
    return False


class CoordinatorGate(pb_grpc.CoordinatorServicer):
    """`ravnest.v1.Coordinator` on a node that is, or may become, the coordinator: calls go to
    its coordinator service once there is one, and are UNAVAILABLE before."""

    def __init__(self, daemon: NodeDaemon) -> None:
        self._daemon = daemon

    async def _service(self, context: grpc.aio.ServicerContext[Any, Any]) -> CoordinatorService:
        service = self._daemon.coordinator
        if service is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node is not the coordinator")
        assert service is not None
        return service

    async def Join(self, request: Any, context: Any) -> pb.JoinReply:
        return await (await self._service(context)).Join(request, context)

    async def Report(self, request: Any, context: Any) -> pb.ReportReply:
        return await (await self._service(context)).Report(request, context)

    async def Swarm(self, request: Any, context: Any) -> pb.SwarmView:
        return await (await self._service(context)).Swarm(request, context)

    async def Heartbeat(self, request: Any, context: Any) -> pb.HeartbeatReply:
        return await (await self._service(context)).Heartbeat(request, context)

    async def Leave(self, request: Any, context: Any) -> pb.LeaveReply:
        return await (await self._service(context)).Leave(request, context)

    async def Drain(self, request: Any, context: Any) -> pb.DrainReply:
        return await (await self._service(context)).Drain(request, context)

    async def Suspect(self, request: Any, context: Any) -> pb.SuspectReply:
        return await (await self._service(context)).Suspect(request, context)

    async def WatchPlan(self, request: Any, context: Any) -> AsyncIterator[pb.Plan]:
        async for plan in (await self._service(context)).WatchPlan(request, context):
            yield plan

    async def WatchProgress(self, request: Any, context: Any) -> AsyncIterator[pb.Progress]:
        async for event in (await self._service(context)).WatchProgress(request, context):
            yield event


class NodeDaemon:
    """A running node. Create it, then `await run(on_ready)`; `stop()` ends it gracefully."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._stop = asyncio.Event()
        self._counters = LinkCounters()
        self.node_id = load_or_create_node_id(config.state_dir)
        self.address = ""
        self._worker: Worker | None = None
        self._mdns: MdnsDiscovery | None = None
        self.found: Found | None = None
        """The coordinator this node follows and how it learned of it (None while looking)."""
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ravnest-compute")
        self.run_error: BaseException | None = None
        self.coordinator: CoordinatorService | None = None
        """This node's coordinator service: from the start, after an election, or never."""
        self._votes = VoteBook(config.state_dir) if config.elects else None
        self._relay_node_id = ""
        self._listening = ("", 0)
        """The host and port this node's server listens on (a tunnel's local end)."""
        self._tunnel: TunnelClient | None = None
        """This node's tunnel through its relay (--relay)."""
        self._relay: RelayServer | None = None
        """The relay this node serves (--relay-listen)."""
        self._gate: TlsGate | None = None
        """A protected swarm's TLS gate in front of this node's gRPC server."""
        self.metrics_address = ""
        """HOST:PORT of the HTTP endpoint (--metrics-port), once it listens."""
        self._page_view: tuple[float, dict[str, Any]] | None = None
        """The live page's last data and when it came (loop time)."""
        self._page_call: asyncio.Future[dict[str, Any]] | None = None
        self._page_channel: tuple[str, Any] | None = None
        """The channel the page's calls use: (coordinator address, grpc.aio channel)."""
        self._averaging = AveragingService()
        """The Push handler, and the record of replicas banned from averaging (kept for the
        node's life, across plans)."""
        transport = config.transport
        self._limiter = PeerLimiter(
            max_calls=transport.peer_max_calls,
            calls_per_s=transport.peer_calls_per_s,
            messages_per_s=transport.peer_messages_per_s,
            inflight_bytes=transport.peer_inflight_bytes,
        )
        """The per-peer limits of this node's gRPC server (transport/limits.py)."""
        self.led_term = 0
        """The election term this node won and leads as coordinator (0: none)."""
        self._lost_coordinators: set[str] = set()
        """Coordinators (node ids) this node lost: it never votes for them again."""
        self._leaving: asyncio.Task[None] | None = None

    @property
    def worker(self) -> Worker | None:
        return self._worker

    def stop(self) -> None:
        """Ask the node to stop (on the loop; a signal handler calls it). A worker with a stage
        first leaves and hands its blocks over (within leave_timeout_s); a second call, or any
        other node, stops at once."""
        worker = self._worker
        if (
            self._leaving is None
            and not self._stop.is_set()
            and self.coordinator is None
            and worker is not None
            and worker.holds_stage
            and self.config.leave_timeout_s > 0
        ):
            self._leaving = asyncio.get_running_loop().create_task(self._leave(worker))
            return
        self._stop.set()

    async def _leave(self, worker: Worker) -> None:
        """Leave the swarm gracefully: say so, stay until the blocks are handed over, stop."""
        timeout_s = self.config.leave_timeout_s
        log.info("leaving the swarm: handing this node's blocks over (at most %g s)", timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                if not await worker.leave():
                    log.info("nobody takes over this node's blocks; stopping")
                elif await worker.handed_over():
                    log.info("blocks handed over; stopping")
                else:
                    log.info("the coordinator is gone: stopping with this node's blocks "
                             "checkpointed")  # fmt: skip
        except TimeoutError:
            log.warning("blocks not handed over within %g s; stopping anyway", timeout_s)
        except (PeerUnavailable, PeerRefused) as exc:
            log.warning("cannot leave gracefully (%s); stopping", exc)
        finally:
            self._stop.set()

    async def run(self, on_ready: Callable[[NodeInfo], None]) -> None:
        """Serve until stopped. Raises StartupError if the server cannot listen and RunFailed
        (after stopping cleanly) if this node's training run failed."""
        cfg = self.config
        if cfg.compute_threads:
            torch.set_num_threads(cfg.compute_threads)
        server = grpc.aio.server(
            options=server_options(cfg.transport),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            interceptors=[self._limiter.interceptor()],
        )
        host, port = split_host_port(cfg.listen)
        _check_bindable(host, port, cfg.listen)
        creds = cfg.transport.credentials
        try:
            # Protected: the gRPC server listens on loopback, behind the TLS gate.
            grpc_port = server.add_insecure_port("127.0.0.1:0" if creds else cfg.listen)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {cfg.listen}: {_bind_reason(exc)}") from None
        if creds is not None:
            gate = TlsGate(host, port, ("127.0.0.1", grpc_port), creds.server_context())
            try:
                port = await gate.start()
            except OSError as exc:
                raise StartupError(
                    f"cannot listen on {cfg.listen}: {exc.strerror or exc}"
                ) from None
            self._gate = gate
        else:
            port = grpc_port
        self.address = cfg.advertise or f"{host}:{port}"
        self._listening = host, port
        if cfg.no_inbound and cfg.relay is None:
            await self._open_chosen_relay(host, port)
        await self._open_relays(host, port, cfg.relay)
        if cfg.is_coordinator:
            self.found = Found(self.address, pb.FOUND_VIA_CONFIG)
        elif cfg.join is not None and not cfg.finds_coordinator and not cfg.elects:
            self.found = Found(cfg.join, pb.FOUND_VIA_CONFIG)
        averaging = self._averaging
        worker = Worker(
            averaging=averaging,
            node_id=self.node_id,
            address=self.address,
            coordinator=self.found.address if self.found else "",
            compute_threads=torch.get_num_threads(),
            transport=cfg.transport,
            compute=self._compute,
            counters=self._counters,
            coordinator_grace_s=cfg.coordinator_grace_s,
            checkpoints=(
                CheckpointDir(cfg.state_dir, cfg.checkpoint_keep)
                if cfg.state_dir is not None and not cfg.coordinator_only
                else None
            ),
            resume=cfg.resume,
            model_dirs=(*map(Path, cfg.model_dirs), *local_paths(cfg.train.model)),
        )
        worker.relay_node_id = self._relay_node_id
        worker.relay_address = self._relay.address if self._relay is not None else ""
        worker.compute_scale = cfg.fault_compute_scale
        worker.block_delay_s = cfg.fault_block_ms / 1000
        worker.fuzz_upstream = cfg.fault_fuzz_upstream
        self._worker = worker
        server.add_generic_rpc_handlers([averaging.handler()])
        boundary = BoundaryServer(
            worker.open_session,
            worker.close_session,
            worker.on_refused,
            worker.limits,
            dial_in=worker.dial_in,
        )
        server.add_generic_rpc_handlers([boundary.handler()])
        server.add_generic_rpc_handlers([ProbeServer(self._check_probe, self._counters).handler()])
        pb_grpc.add_NodeServicer_to_server(NodeService(self), server)
        if cfg.is_coordinator:
            self.coordinator = self._coordinator_service(epoch=1)
        if cfg.is_coordinator or cfg.elects:
            pb_grpc.add_CoordinatorServicer_to_server(CoordinatorGate(self), server)
        if self._votes is not None:
            election = ElectionService(cfg.swarm_name, self._votes, self._ballot)
            pb_grpc.add_ElectionServicer_to_server(election, server)
        await server.start()
        try:
            async with contextlib.AsyncExitStack() as stack:
                if cfg.mdns:  # left after _serve: goodbye packets before the server stops
                    mdns = await self._mdns_discovery()
                    self._mdns = await stack.enter_async_context(mdns)
                if cfg.metrics_port is not None:
                    await self._open_web(stack)
                info = self._write_ready()
                log.info("node %s listening on %s", self.node_id, self.address)
                if creds is None:
                    log.warning("swarm %r is open: anyone who can reach this node may join it "
                                "(protect it with --swarm-dir DIR from `ravnest-node init-swarm`)",
                                cfg.swarm_name)  # fmt: skip
                else:
                    log.info("swarm %r is protected: mutual TLS with every peer (member "
                             "certificate valid until %s)", cfg.swarm_name,
                             f"{creds.expires:%Y-%m-%d}")  # fmt: skip
                on_ready(info)
                await self._serve(worker, server)
        finally:
            # After a failed run, end open streams at once so neighbours learn of it now.
            await server.stop(0 if self.run_error else cfg.transport.stop_grace_s)
            await worker.close_channels()
            if self._tunnel is not None:
                self._tunnel.close()
            if self._relay is not None:
                await self._relay.close()
            if self._gate is not None:
                await self._gate.close()
            # Wait for the torch op in progress (if any); nothing new is submitted after stop.
            await asyncio.to_thread(self._compute.shutdown, wait=True, cancel_futures=True)
        if self.run_error is not None:
            raise RunFailed(str(self.run_error)) from self.run_error

    async def _open_web(self, stack: contextlib.AsyncExitStack) -> None:
        """Serve /metrics and the live page (web.py) until the node stops."""
        cfg = self.config
        assert cfg.metrics_port is not None
        web = WebServer(cfg.metrics_host, cfg.metrics_port, self.metrics, self._page_swarm)
        try:
            port = await web.start()
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: "
                f"{exc.strerror or exc}"
            ) from None
        stack.push_async_callback(web.close)
        stack.push_async_callback(self._close_page_channel)
        self.metrics_address = host_port(cfg.metrics_host, port)
        log.info("metrics on http://%s/metrics, the swarm's page on http://%s/",
                 self.metrics_address, self.metrics_address)  # fmt: skip

    async def _page_swarm(self) -> dict[str, Any]:
        """The live page's data: the coordinator's view of the swarm, asked at most once per
        WEB_SWARM_EVERY_S however many pages and scrapers ask (one call in flight, its answer
        shared): the page must not spend this node's call budget at its coordinator.
        PeerError if the coordinator does not answer."""
        loop = asyncio.get_running_loop()
        cached = self._page_view
        if cached is not None and loop.time() - cached[0] < WEB_SWARM_EVERY_S:
            return cached[1]
        if self._page_call is None or self._page_call.done():
            self._page_call = asyncio.ensure_future(self._ask_swarm())
        data = await asyncio.shield(self._page_call)
        self._page_view = loop.time(), data
        return data

    async def _ask_swarm(self) -> dict[str, Any]:
        if self.found is None:
            raise PeerUnavailable("this node has not found its coordinator yet")
        address = self.found.address
        if self._page_channel is None or self._page_channel[0] != address:
            if self._page_channel is not None:
                await self._page_channel[1].close()
            self._page_channel = address, grpc_channel(address, self.config.transport)
        try:
            view = await pb_grpc.CoordinatorStub(self._page_channel[1]).Swarm(
                pb.SwarmRequest(), timeout=WEB_SWARM_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise PeerUnavailable(f"{exc.code().name}: {exc.details()}") from None
        return swarm_page_data(self.config.swarm_name, view)

    async def _close_page_channel(self) -> None:
        if self._page_channel is not None:
            await self._page_channel[1].close()

    def metrics(self) -> list[Family]:
        """This node's Prometheus series (docs/operations.md)."""
        worker = self._worker
        plan = worker.plan if worker else None
        if plan is None and self.coordinator is not None:  # a lab coordinator holds no stage
            plan = self.coordinator.plan
        families = node_families(
            node_id=self.node_id,
            swarm=self.config.swarm_name,
            role="coordinator" if self.coordinator else "worker",
            plan=plan,
            link_bytes=self._counters.bytes_sent,
            calls_limited=self._limiter.calls_refused,
            banned=len(self._averaging.bans.banned),
        )
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

    def _write_ready(self) -> NodeInfo:
        """This node's NodeInfo, written to READY_FILE in its state dir (again when its address
        changes: it went through a relay)."""
        cfg = self.config
        info = NodeInfo(
            self.node_id, self.address, os.getpid(), cfg.is_coordinator, self.metrics_address
        )
        if cfg.state_dir is not None:
            write_atomic(cfg.state_dir / READY_FILE, json.dumps(asdict(info)).encode())
        return info

    async def _join_through_relay(self, worker: Worker, refused: Unreachable) -> bool:
        """The coordinator cannot reach this node at its address: open a tunnel through a
        relay it offers and make the port there this node's address. False if asked to stop
        meanwhile; Unreachable, with what to do, if this node may not go through a relay
        (announced over mDNS, serving a relay, or reached through one already)."""
        cfg = self.config
        if self._tunnel is not None:
            raise Unreachable(f"{refused}. {_relay_advice(self._tunnel.relay)}")
        if cfg.mdns or cfg.relay_listen is not None:
            why = (
                "it serves a relay (--relay-listen), which must be reachable itself"
                if cfg.relay_listen is not None
                else "it is announced over mDNS, at its address on the LAN; across NAT, start "
                "it with --join or --peer and no --mdns"
            )
            raise Unreachable(f"{refused}. This node does not go through a relay: {why}")
        log.warning("%s. Going through a relay it offers", refused)
        await self._open_chosen_relay(*self._listening)
        if self._stop.is_set():
            return False
        assert self._tunnel is not None
        worker.reached_through(self.address, self._relay_node_id)
        self._write_ready()
        return True

    async def _open_chosen_relay(self, host: str, port: int) -> None:
        """--no-inbound without --relay, or a node the coordinator cannot reach: open this
        node's tunnel through the relay with the lowest round trip of those the coordinator
        offers, or the next if it cannot (`_choose_relays`). StartupError if none can."""
        relays = await self._choose_relays()
        for i, relay in enumerate(relays):
            try:
                await self._open_relays(host, port, relay)
                return
            except StartupError as exc:
                if i == len(relays) - 1:
                    raise
                log.warning("%s; trying the next relay", exc)

    async def _choose_relays(self) -> list[str]:
        """The relays the coordinator offers (SwarmView.relays) that answer, by their round
        trip (TCP connects), lowest first. The coordinator comes from --join, or from the
        bootstrap peers, and is kept as this node's. StartupError if there is none to ask, or
        no relay is offered or answers."""
        cfg = self.config
        timeout_s = cfg.transport.connect_timeout_s
        try:
            if self.found is None:
                if cfg.join not in (None, JOIN_AUTO, JOIN_ELECT):
                    assert cfg.join is not None
                    self.found = Found(cfg.join, pb.FOUND_VIA_CONFIG)
                else:
                    self.found = await locate_coordinator(
                        swarm=cfg.swarm_name, discovery=None, peers=cfg.peers,
                        ask=grpc_status_asker(cfg.transport), timeout_s=timeout_s,
                    )  # fmt: skip
            address = self.found.address
            async with grpc_channel(address, cfg.transport) as channel:
                with coordinator_errors(address):
                    view: pb.SwarmView = await pb_grpc.CoordinatorStub(channel).Swarm(
                        pb.SwarmRequest(), timeout=timeout_s
                    )
        except PeerError as exc:
            raise StartupError(
                f"behind NAT: cannot ask the coordinator for a relay: {exc}"
            ) from None
        offers = [o for o in view.relays[:MAX_RELAY_OFFERS] if is_address(o.address)]
        if not offers:
            raise StartupError(
                f"behind NAT: coordinator {address} offers no relay: start a reachable node "
                "with --relay-listen HOST:PORT, or name one with --relay"
            )
        rtts = await asyncio.gather(*(connect_rtt(o.address, RELAY_RTT_TIMEOUT_S) for o in offers))
        answered = [(rtt, o) for rtt, o in zip(rtts, offers, strict=True) if rtt is not None]
        if not answered:
            raise StartupError(
                "behind NAT: no relay the coordinator offers answers: "
                + ", ".join(f"{o.node_id} at {o.address}" for o in offers)
            )
        answered.sort(key=lambda a: a[0])
        rtt, best = answered[0]
        log.info("relay chosen: %s at %s (round trip %.1f ms, of %d offered, %d answered)",
                 best.node_id, best.address, rtt * 1e3, len(offers), len(answered))  # fmt: skip
        return [o.address for _, o in answered]

    async def _open_relays(self, host: str, port: int, relay_address: str | None) -> None:
        """A relay (--relay, or chosen): open this node's tunnel (its address is then the
        relay's port for it). --relay-listen: start serving as a relay. StartupError if either
        cannot."""
        cfg = self.config
        creds = cfg.transport.credentials  # a protected swarm: relays use mutual TLS too
        if relay_address is not None and self._tunnel is None:
            local = f"{'127.0.0.1' if ipaddress_is_wildcard(host) else host}:{port}"
            tunnel = TunnelClient(
                relay_address,
                self.node_id,
                local,
                connect_timeout_s=cfg.transport.connect_timeout_s,
                tls=creds.client_context() if creds is not None else None,
            )
            try:
                self.address = await tunnel.open()
            except PeerError as exc:
                tunnel.close()
                raise StartupError(
                    f"cannot be reached through relay {relay_address}: {exc}"
                ) from None
            except BaseException:  # cancelled (stopped) while it opened
                tunnel.close()
                raise
            self._tunnel, self._relay_node_id = tunnel, tunnel.relay_node_id
        if cfg.relay_listen is not None:
            public = split_host_port(cfg.advertise or cfg.relay_listen)[0]
            ports = parse_port_range(cfg.relay_ports) if cfg.relay_ports else None
            relay = RelayServer(
                cfg.relay_listen,
                public,
                node_id=self.node_id,
                ports=ports,
                tls=creds.server_context() if creds is not None else None,
            )
            try:
                await relay.start()
            except OSError as exc:
                raise StartupError(
                    f"cannot serve as a relay on {cfg.relay_listen}: {exc.strerror or exc}"
                ) from None
            self._relay = relay

    async def _check_probe(self, peer_node_id: str, epoch: int, nbytes: int) -> None:
        """Link probes: under epoch 0 a member measuring its link to this coordinator or this
        node; under a plan's epoch, a neighbour of this node's stage. Refusal otherwise."""
        service = self.coordinator
        if epoch == 0 and service is not None:
            service.check_link_probe(peer_node_id, nbytes)
            return
        assert self._worker is not None
        await self._worker.check_probe(peer_node_id, epoch, nbytes)

    async def _keep_tunnel(self, tunnel: TunnelClient) -> None:
        try:
            await tunnel.run()
        except PeerError as exc:
            self._fail(exc)

    def _coordinator_service(self, epoch: int) -> CoordinatorService:
        cfg = self.config
        store = None
        if cfg.coordinator_only:
            assert cfg.state_dir is not None  # NodeConfig requires it
            store = CoordinatorStore(cfg.state_dir)
        return CoordinatorService(
            train=cfg.train,
            swarm_size=cfg.swarm_size,
            swarm_id=f"{cfg.swarm_name}/{cfg.train.model}",
            summary_path=cfg.state_dir / SUMMARY_FILE if cfg.state_dir else None,
            epoch=epoch,
            lease_s=cfg.lease_s,
            store=store,
            probe=partial(probe_node, transport=cfg.transport),
            reach=partial(probe_node, tries=1, transport=cfg.transport),
            node_id=self.node_id,
            relay_address=self._relay.address if self._relay is not None else "",
        )

    def _ballot(self) -> Ballot:
        records = self._mdns.records() if self._mdns is not None else []
        worker = self._worker
        latest = worker.latest_plan if worker is not None else None
        return Ballot(
            own_id=self.node_id,
            seen=frozenset(r.txt.node_id for r in records),
            following=self.found.address if self.found is not None else "",
            plan_epoch=latest.epoch if latest is not None else 0,
            lost=frozenset(self._lost_coordinators),
        )

    async def _elect(self, worker: Worker) -> None:
        """--join elect: follow the coordinator the swarm elected, or stand and become it."""
        cfg, mdns, votes = self.config, self._mdns, self._votes
        assert mdns is not None and votes is not None  # settings require --mdns
        loop = asyncio.get_running_loop()
        timeout_s = cfg.transport.connect_timeout_s
        deadline = loop.time() + timeout_s
        ask = grpc_vote_asker(cfg.transport)
        log.info("electing a coordinator for swarm %r of %d nodes", cfg.swarm_name, cfg.swarm_size)
        while True:
            generation = mdns.generation
            records = mdns.records()
            if any(r.txt.role == "coordinator" for r in records):
                await self._find_coordinator(worker, deadline - loop.time())
                return
            # Stand once this node is announced (voters must see it) and sees the whole swarm.
            if (
                mdns.registered.is_set()
                and len(records) >= cfg.swarm_size - 1
                and all(self.node_id < r.txt.node_id for r in records)
            ):
                voters = [(r.txt.node_id, r.addresses[0]) for r in records if r.addresses]
                term = await stand(
                    book=votes,
                    own_id=self.node_id,
                    swarm=cfg.swarm_name,
                    swarm_size=cfg.swarm_size,
                    voters=voters,
                    ask=ask,
                )
                if term is not None:
                    self.coordinator, self.led_term = self._coordinator_service(epoch=term), term
                    self.found = Found(
                        self.address, pb.FOUND_VIA_ELECTION, f"term {term}", term, self.node_id
                    )
                    worker.coordinator = self.address
                    await mdns.set_role("coordinator")
                    return
            left = deadline - loop.time()
            if left <= 0:
                raise PeerUnavailable(
                    f"no coordinator of swarm {cfg.swarm_name!r} elected within {timeout_s:g} s; "
                    f"sees {len(records)} of the {cfg.swarm_size - 1} other nodes "
                    f"(term {votes.state.term}); {mdns.describe()}"
                )
            # A new record ends the wait at once; otherwise retry after a jittered back-off.
            await mdns.wait_newer(generation, min(left, random.uniform(0.3, 0.9)))

    async def _keep_coordinator(self, worker: Worker) -> None:
        """--join elect, once the swarm has a plan: while this node follows an elected
        coordinator, wait for its loss and elect another (`_fail_over`); while this node is
        the coordinator, watch for one of a higher term, and step down if there is one."""
        while not self._stop.is_set():
            if self.coordinator is None:
                await worker.wait_until(
                    lambda: (
                        self.coordinator is not None
                        or (
                            worker.coordinator_lost
                            and worker.started_plan is not None
                            and not worker.run_finished
                        )
                    )
                )
                if self.coordinator is not None:  # elected meanwhile (the first election)
                    continue
                if self._leaving is not None or self._stop.is_set():
                    return  # a node on its way out does not stand
                try:
                    await self._fail_over(worker)
                except PeerError as exc:
                    self._fail(exc)
                    return
            elif self.led_term:
                successor = await self._successor(worker, self.led_term, {self.node_id})
                if successor is not None or self._votes_for_later_term():
                    self._step_down(successor)
                    return
                # Each new mDNS record ends the wait (a successor's, say); otherwise a lease.
                lease_s = self.config.lease_s
                if self._mdns is not None:
                    await self._mdns.wait_newer(self._mdns.generation, lease_s)
                else:
                    await asyncio.sleep(lease_s)  # the period of a check, not a wait for one
            else:
                return  # a coordinator by configuration: nobody takes over from it

    def _votes_for_later_term(self) -> bool:
        """This coordinator voted in a term after the one it leads: another node won it."""
        return self._votes is not None and self._votes.state.term > self.led_term

    def _fail(self, error: BaseException) -> None:
        log.error("training stopped: %s", error)
        self.run_error = error
        self._stop.set()

    def _step_down(self, successor: Found | None) -> None:
        """A coordinator of a later term leads the swarm: stop acting as one (its calls are
        refused from now on) and stop this node, whose stage is of a run the swarm has left."""
        voted = self._votes.state.term if self._votes is not None else 0
        who = (f"node at {successor.address} leads term {successor.term}" if successor
               else f"this node voted in term {voted}")  # fmt: skip
        self.coordinator = None
        self._fail(RunFailed(
            f"this node led term {self.led_term} as coordinator, but the swarm has elected "
            f"another ({who}): it steps down and stops; start it again to rejoin the swarm"
        ))  # fmt: skip

    async def _successor(
        self, worker: Worker, above_term: int, lost: set[str], ask: AskStatus | None = None
    ) -> Found | None:
        """The coordinator of the highest term above `above_term` among the members of this
        node's newest plan and the coordinators advertised over mDNS (not `lost`, not this
        node), checked with Node.Status; None if there is none."""
        ask = ask or grpc_status_asker(self.config.transport)
        plan = worker.latest_plan
        hints = {s.node_id: s.address for s in plan.stages} if plan is not None else {}
        if self._mdns is not None:
            for r in self._mdns.records():
                if r.txt.role == "coordinator" and r.addresses:
                    hints.setdefault(r.txt.node_id, r.addresses[0])
        hints = {n: a for n, a in hints.items() if n not in lost and n != self.node_id}

        async def check(node_id: str, address: str) -> Found | None:
            try:
                status = await ask(address, FAILOVER_STATUS_S)
            except PeerError:
                return None
            if check_coordinator(status, self.config.swarm_name, node_id) is not None:
                return None
            if status.term <= above_term:
                return None
            return Found(address, pb.FOUND_VIA_ELECTION, f"term {status.term}", status.term,
                         status.node_id)  # fmt: skip

        found = [f for f in await asyncio.gather(*(check(n, a) for n, a in hints.items())) if f]
        return max(found, key=lambda f: f.term) if found else None

    async def _fail_over(self, worker: Worker) -> None:
        """The elected coordinator this node followed is lost (its plan stream unreachable, or
        its heartbeats failing): elect another among the members of the newest plan this node
        trained, and follow it, or take the run over if this node wins. If the old coordinator
        answers after all (only this node lost it), follow it again. PeerUnavailable if no
        coordinator comes up within the connect timeout plus two leases (a spare, which cannot
        stand, waits as long as it takes)."""
        cfg, votes, plan = self.config, self._votes, worker.started_plan
        assert votes is not None and plan is not None
        old, before = worker.coordinator, self.found
        lost_id = before.node_id if before is not None else ""
        lost = {s.node_id for s in plan.stages if s.node_id == lost_id or s.address == old}
        lost_term = before.term if before is not None else 0
        self._lost_coordinators |= lost
        self.found = None  # following nobody now: this node may vote
        members: dict[str, str] = {}
        for s in plan.stages:
            if s.node_id not in lost:
                members.setdefault(s.node_id, s.address)
        electorate = len({s.node_id for s in plan.stages})
        voters = [(n, a) for n, a in sorted(members.items()) if n != self.node_id]
        order = sorted(members)
        rank = order.index(self.node_id) if self.node_id in members else len(order)
        loop = asyncio.get_running_loop()
        start = loop.time()
        wait_s = cfg.transport.connect_timeout_s + 2 * cfg.lease_s
        log.warning("coordinator %s (%s, term %d) is lost: electing another among the %d "
                    "members of plan epoch %d", old, ", ".join(sorted(lost)) or "no member",
                    lost_term, len(members), plan.epoch)  # fmt: skip
        ask_vote = grpc_vote_asker(cfg.transport)
        ask_status = grpc_status_asker(cfg.transport)
        while True:
            found, alive = await asyncio.gather(
                self._successor(worker, lost_term, lost, ask_status),
                self._still_leads(old, lost, lost_term, ask_status),
            )
            if found is not None:
                self.found = found
                log.info("coordinator %s of term %d found after the failover", found.address,
                         found.term)  # fmt: skip
                await worker.follow(found.address)
                return
            if alive and before is not None:
                log.warning("coordinator %s answers after all: following it again", old)
                self.found = before
                self._lost_coordinators -= lost
                await worker.coordinator_back()
                return
            latest = worker.latest_plan or plan
            if self.node_id in members and loop.time() >= start + rank * FAILOVER_STAND_S:
                term = await stand(
                    book=votes,
                    own_id=self.node_id,
                    swarm=cfg.swarm_name,
                    swarm_size=electorate,
                    voters=voters,
                    ask=ask_vote,
                    plan_epoch=latest.epoch,
                )
                if term is not None:
                    service = self._coordinator_service(epoch=term)
                    service.take_over(plan, lost, term, known_epoch=latest.epoch)
                    self.coordinator, self.led_term = service, term
                    self.found = Found(
                        self.address, pb.FOUND_VIA_ELECTION, f"term {term}", term, self.node_id
                    )
                    if self._mdns is not None:
                        await self._mdns.set_role("coordinator")
                    await worker.follow(self.address)
                    return
            if loop.time() - start >= wait_s and self.node_id in members:
                raise PeerUnavailable(
                    f"coordinator {old} was lost and no other was elected within {wait_s:g} s "
                    f"(term {votes.state.term}; {len(members)} members of plan epoch "
                    f"{plan.epoch} left, {electorate // 2 + 1} votes needed)"
                )
            # A jittered back-off between rounds (two candidates must not keep colliding).
            await asyncio.sleep(random.uniform(0.3, 0.9))

    async def _still_leads(
        self, address: str, node_ids: set[str], term: int, ask: AskStatus
    ) -> bool:
        """The coordinator at `address` (one of `node_ids`) answers, and still leads `term`."""
        try:
            status = await ask(address, FAILOVER_STATUS_S)
        except PeerError:
            return False
        return (
            check_coordinator(status, self.config.swarm_name) is None
            and status.node_id in node_ids
            and status.term == term
        )

    async def _mdns_discovery(self) -> MdnsDiscovery:
        """This node's mDNS advertisement and browser (entered by the caller)."""
        cfg = self.config
        host, port = split_host_port(self.address)
        record = TxtRecord(
            swarm=cfg.swarm_name,
            node_id=self.node_id,
            protocol=PROTOCOL,
            role="coordinator" if cfg.is_coordinator else "worker",
        )
        ips = await advertised_ips(host, cfg.mdns_interface)
        return MdnsDiscovery(
            swarm=cfg.swarm_name,
            protocol=PROTOCOL,
            interface=cfg.mdns_interface,
            advertisement=Advertisement(txt=record, port=port, ips=ips),
        )

    async def _find_coordinator(self, worker: Worker, timeout_s: float | None = None) -> None:
        """Locate and check the coordinator (mDNS, --peer), within the connect timeout;
        PeerUnavailable naming what was tried if there is none."""
        cfg = self.config
        log.info(
            "looking for the coordinator of swarm %r (%s) for up to %g s",
            cfg.swarm_name,
            ", ".join((["mDNS"] if self._mdns else []) + [f"peer {p}" for p in cfg.peers]),
            cfg.transport.connect_timeout_s,
        )
        found = await locate_coordinator(
            swarm=cfg.swarm_name,
            discovery=self._mdns,
            peers=cfg.peers,
            ask=grpc_status_asker(cfg.transport),
            timeout_s=cfg.transport.connect_timeout_s if timeout_s is None else timeout_s,
        )
        log.info("coordinator %s found via %s (%s)", found.address, found.via_name, found.source)
        self.found = found
        worker.coordinator = found.address

    async def _serve(self, worker: Worker, server: grpc.aio.Server) -> None:
        async def train() -> None:
            try:
                if self.config.elects:
                    await self._elect(worker)
                elif not worker.coordinator:
                    await self._find_coordinator(worker)
                try:
                    await worker.run()
                except Unreachable as exc:
                    if not await self._join_through_relay(worker, exc):
                        return
                    assert self._tunnel is not None
                    tasks.append(tg.create_task(self._keep_tunnel(self._tunnel)))
                    try:
                        await worker.run()
                    except Unreachable as again:
                        advice = _relay_advice(self._tunnel.relay)
                        raise Unreachable(f"{again}. {advice}") from None
            except Exception as exc:
                error = _first_error(exc)
                if self._stop.is_set():
                    # Asked to stop: ending this node's own calls (below) can make the run
                    # fail on its way out; that is the stop, not a failed run.
                    log.info("training ended by the stop: %s", error)
                    return
                self.run_error = error
                if isinstance(error, RavnestError):  # a peer's fault or a bad plan
                    log.error("training stopped: %s", error)
                else:  # our own bug: say so loudly, with the traceback
                    log.exception("training stopped by an internal error", exc_info=error)
                self._stop.set()

        async with asyncio.TaskGroup() as tg:
            tasks = []
            if not self.config.coordinator_only:  # a lab coordinator holds no stage
                tasks += [tg.create_task(train(), name="train"),
                          tg.create_task(worker.keep_membership(), name="membership")]  # fmt: skip
            if self.config.elects:
                tasks.append(tg.create_task(self._keep_coordinator(worker), name="election"))
            if self._tunnel is not None:
                tasks.append(tg.create_task(self._keep_tunnel(self._tunnel), name="tunnel"))
            if self._mdns is not None:
                tasks.append(tg.create_task(self._mdns.run(), name="mdns"))
            await self._stop.wait()
            if self.run_error is None:
                await worker.checkpoint_on_stop(STOP_DRAIN_S, STOP_PAUSE_S)
            await worker.stop()
            for task in tasks:
                task.cancel()
            # A task cancelled while it waits for a reply from this node's own server (the
            # coordinator's worker reading its own WatchPlan) can stay cancelling until the
            # server's side of that call ends: grpc.aio finishes the client's cancel only then.
            # Seen as a stop that never finished, a few times in a hundred; so if the tasks do
            # not end promptly, end the server's calls first.
            _, lingering = await asyncio.wait(tasks, timeout=STOP_TASKS_S)
            if lingering:
                log.info("stopping: ending this node's calls so %d task(s) can end", len(lingering))
                await server.stop(0)
                # ... and its own calls to the coordinator (its own server, for a coordinator's
                # worker), which a cancelled task may still wait on.
                await worker.close_channels()
                _, stuck = await asyncio.wait(lingering, timeout=STOP_TASKS_S)
                for task in stuck:  # seen once in CI (an elected coordinator in a namespace)
                    log.warning("stopping: task %s still runs after its calls ended, at %s",
                                task.get_name(), _awaiting(task.get_coro()))  # fmt: skip

    async def status(self, brief: bool = False) -> pb.NodeStatus:
        worker = self._worker
        runtime = worker.runtime if worker else None
        status = pb.NodeStatus(
            node_id=self.node_id,
            address=self.address,
            stage=-1,
            bytes_sent=self._counters.total_bytes,
            role=pb.NODE_ROLE_COORDINATOR if self.coordinator else pb.NODE_ROLE_WORKER,
            swarm_name=self.config.swarm_name,
            # A coordinator: the term it leads; any other node: the last it voted in.
            term=self.led_term
            if self.coordinator is not None and self.led_term
            else self._votes.state.term
            if self._votes is not None
            else 0,
        )
        creds = self.config.transport.credentials
        status.security = "open" if creds is None else "mtls"
        if creds is not None:
            status.certificate_expires = creds.expires.timestamp()
        if self._gate is not None:
            status.refused_connections = self._gate.refused
        status.banned_replicas.update(self._averaging.bans.banned)
        status.calls_limited = self._limiter.calls_refused
        status.messages_delayed = self._limiter.messages_delayed
        if self._tunnel is not None:
            status.relay = self._tunnel.relay
        if self._relay is not None:
            status.relay_address = self._relay.address
            status.relayed.update(self._relay.tunnels())
            status.relayed_bytes.update(self._relay.bytes_carried())
        if self.found is not None:
            status.coordinator_address = self.found.address
            status.coordinator_found_via = self.found.via
            status.coordinator_found_from = self.found.source
        if self._mdns is not None:
            status.mdns_peers = len(self._mdns.records())
        if worker is not None:
            status.frames_refused = worker.frames_refused
            if worker.plan is not None:
                status.plan_epoch = worker.plan.epoch
            status.upstream_node_id = worker.upstream_node_id
        if runtime is not None:
            status.stage = runtime.spec.index
            status.first_block = runtime.spec.first_block
            status.stop_block = runtime.spec.stop_block
            status.version = runtime.version
            status.microbatches_in_flight = runtime.in_flight
            status.frames_accepted = runtime.frames_accepted
            status.run_done = runtime.done
            if not brief:  # the digest waits for the compute thread
                status.params_sha256 = await runtime.params_digest()
        return status


def _relay_advice(relay: str) -> str:
    """What to check when the coordinator cannot reach a node at the port its relay opened."""
    return (
        f"That is the port relay {relay} opened for this node: check the relay's --advertise "
        "(the host its ports are reached at) and that its firewall lets the swarm reach its "
        "ports (--relay-ports LOW-HIGH)"
    )


def _check_bindable(host: str, port: int, listen: str) -> None:
    """Fail early, with the system's own words, if the address cannot be bound (gRPC's own
    failure is a multi-line log on stderr)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise StartupError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise StartupError(f"cannot listen on {listen}: {exc.strerror or exc}") from None


def _bind_reason(exc: RuntimeError) -> str:
    text = str(exc)
    return "address already in use or not available" if "bind" in text.lower() else text


def _first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _awaiting(coro: Any) -> str:
    """Where a suspended coroutine waits: each coroutine (and generator) it awaits, in turn."""
    frames: list[str] = []
    while coro is not None and len(frames) < 32:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}"
                          f":{frame.f_lineno})")  # fmt: skip
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " -> ".join(frames) or "(nothing)"
