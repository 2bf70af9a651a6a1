"""The node daemon: one process, one event loop, one TaskGroup owning every background task.

`NodeDaemon.run` opens the gRPC server (services.py: boundary streams, node status and, on the
coordinator, the coordinator service), opens its relays (relays.py), starts mDNS if asked,
signals readiness, finds or elects the coordinator (failover.py), runs the worker, and on
`stop()` (SIGINT/SIGTERM) leaves the TaskGroup, stops mDNS (goodbye packets) and the server with
a grace period and returns. What it reports about itself is status.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch

from ravnest_node.averaging import AveragingService
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.coordination.coordinator.store import CoordinatorStore
from ravnest_node.coordination.election import ElectionService
from ravnest_node.coordination.locate import Found
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.daemon.failover import Leadership
from ravnest_node.daemon.relays import Relays, relay_advice
from ravnest_node.daemon.services import CoordinatorGate, NodeService, listen, probe_node
from ravnest_node.daemon.status import SwarmPage, node_status, open_web
from ravnest_node.daemon.worker.worker import Worker
from ravnest_node.devices import describe, resolve_device, resolve_precision
from ravnest_node.discovery import Advertisement, MdnsDiscovery, TxtRecord, advertised_ips
from ravnest_node.errors import (
    Banned,
    PeerError,
    PeerRefused,
    PeerUnavailable,
    RavnestError,
    RunFailed,
    Unreachable,
)
from ravnest_node.identity import NodeKey
from ravnest_node.models.pretrained import local_paths
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import BANNED, PROTOCOL
from ravnest_node.state import record_node_id, write_atomic
from ravnest_node.transport.authority import member_identity
from ravnest_node.transport.boundary import BoundaryServer, LinkCounters
from ravnest_node.transport.gate import TlsGate
from ravnest_node.transport.limits import PeerLimiter
from ravnest_node.transport.malformed import MalformedRequests
from ravnest_node.transport.membership import Membership, MembershipError
from ravnest_node.transport.options import server_options, split_host_port
from ravnest_node.transport.probe import ProbeServer

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
"""Start a background task (a coroutine, and the task's name) in the daemon's TaskGroup."""

READY_FILE = "ready.json"
# Calls a node serves at once (boundary streams, control calls, status); more fail. One peer
# gets at most TransportConfig.peer_max_calls of them (transport/limits.py).
MAX_CONCURRENT_RPCS = 1024
SUMMARY_FILE = "summary.json"
# Seconds a stopping node's own tasks get to end before its server's calls are ended for them.
STOP_TASKS_S = 1.0
# A stopping node's last checkpoint: seconds its stage may take to end at a step boundary, and
# then to pause where it is if it could not (writing it is not cut short: the stop watchdog
# bounds the whole stop).
STOP_DRAIN_S = 3.0
STOP_PAUSE_S = 1.0


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node announces when it is ready."""

    node_id: str
    address: str
    pid: int
    coordinator: bool
    metrics: str = ""
    """HOST:PORT of its HTTP endpoint (--metrics-port: /metrics and the live page), or ""."""


def banned(error: BaseException) -> BaseException:
    """`error` as `Banned` if it is the coordinator's refusal of a banned member (whichever
    call it refused: a heartbeat, a report, a join), else `error` itself."""
    if isinstance(error, PeerRefused) and BANNED in str(error):
        text = str(error)
        return Banned(f"this node is {text[text.index(BANNED) :]}")
    return error


class Ending:
    """How a node's run ends: a stop asked for (`stop`), a graceful leave asked for first
    (`leave`), and the error that failed the run (`error`; None if it did not fail)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.leave = asyncio.Event()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """The run failed with `error` (a peer's fault or a bad plan): say so and stop."""
        error = banned(error)
        log.error("training stopped: %s", error)
        self.error = error
        self.stop.set()


class NodeDaemon:
    """A running node. Create it, then `await run(on_ready)`; `stop()` ends it gracefully."""

    def __init__(self, config: NodeConfig) -> None:
        member = member_identity(config.transport.swarm_dir)
        self.key = member[0] if member else NodeKey.load_or_create(config.state_dir)
        """This node's key pair (identity.py): its id is made from it, and every call naming
        this node carries its proof (transport/proofs.py). A member directory's own key where
        the swarm's authority certifies its members (transport/authority.py)."""
        self.certificate = member[1] if member else b""
        """The authority's certificate for this node's key (b"" if none)."""
        creds = config.transport.credentials
        swarm_dir = config.transport.swarm_dir
        self.membership = Membership.of(
            creds.ca_pem if creds else None, creds.swarm if creds else "",
            state_dir=config.state_dir, swarm_dir=swarm_dir, member=member is not None,
        )  # fmt: skip
        """Whether members need certificates; the revoked ones (transport/membership.py)."""
        self.config = replace(config, transport=config.transport.proving(self.key))
        self.node_id = self.key.node_id
        before = record_node_id(config.state_dir, self.node_id)
        if before is not None:
            log.warning(
                "this node's id is now %s, made from its node key (it was %s): its "
                "checkpoints stay; a coordinator sees a new member", self.node_id, before,
            )  # fmt: skip
        self.address = ""
        self._worker: Worker | None = None
        self.leadership = Leadership(self.config, self.node_id, self._coordinator_service)
        self.leadership.certificate = self.certificate
        """The coordinator this node follows, its own coordinator service, its elections."""
        self.relays = Relays(self.config, self.node_id)
        self.counters = LinkCounters()
        self.averaging = AveragingService()
        """The Push handler, and the record of replicas banned from averaging (kept for the
        node's life, across plans)."""
        transport = config.transport
        self.limiter = PeerLimiter(
            max_calls=transport.peer_max_calls,
            calls_per_s=transport.peer_calls_per_s,
            messages_per_s=transport.peer_messages_per_s,
            inflight_bytes=transport.peer_inflight_bytes,
        )
        """The per-peer limits of this node's gRPC server (transport/limits.py)."""
        self.malformed = MalformedRequests()
        """Requests that did not parse, refused and counted per peer (transport/malformed.py)."""
        self.gate: TlsGate | None = None
        """A protected swarm's TLS gate in front of this node's gRPC server."""
        self.metrics_address = ""
        """HOST:PORT of the HTTP endpoint (--metrics-port), once it listens."""
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ravnest-compute")
        self._ending = Ending()
        self.device = resolve_device(config.compute.device)
        """The device this node's stages compute on (ConfigError above if it has none such)."""

    @property
    def worker(self) -> Worker | None:
        return self._worker

    @property
    def coordinator_service(self) -> CoordinatorService | None:
        """This node's coordinator service: from the start, after an election, or never."""
        return self.leadership.service

    async def stopping(self) -> BaseException | None:
        """Once the node has begun to stop: why, if on its own (a ban, a failed run), else
        None (asked to)."""
        await self._ending.stop.wait()
        return self._ending.error

    def stop(self) -> None:
        """Ask the node to stop (on the loop; a signal handler calls it). A worker with a stage
        first leaves and hands its blocks over (within leave_timeout_s); a second call, or any
        other node, stops at once."""
        ending, worker = self._ending, self._worker
        if (
            not ending.leave.is_set()
            and not ending.stop.is_set()
            and self.coordinator_service is None
            and worker is not None
            and worker.holds_stage
            and self.config.membership.leave_timeout_s > 0
        ):
            ending.leave.set()  # the TaskGroup's "leave" task leaves (`_leave`)
            return
        ending.stop.set()

    async def _leave(self, worker: Worker) -> None:
        """Once asked, leave the swarm gracefully: say so, stay until the blocks are handed
        over, stop."""
        await self._ending.leave.wait()
        timeout_s = self.config.membership.leave_timeout_s
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
            self._ending.stop.set()

    async def run(self, on_ready: Callable[[NodeInfo], None]) -> None:
        """Serve until stopped. Raises StartupError if the server cannot listen and RunFailed
        (after stopping cleanly) if this node's training run failed."""
        cfg = self.config
        if cfg.compute.compute_threads:
            torch.set_num_threads(cfg.compute.compute_threads)
        server = grpc.aio.server(
            options=server_options(cfg.transport),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            interceptors=[
                self.limiter.interceptor(),
                self.membership.interceptor(),
                self.malformed.interceptor(),
            ],
        )
        host, port, self.gate = await listen(server, cfg.listen, cfg.transport)
        tunnel = await self.relays.start(host, port, self.leadership.coordinator_address)
        self.address = tunnel or cfg.advertise or f"{host}:{port}"
        self.leadership.address = self.address
        if cfg.discovery.is_coordinator:
            self.leadership.found = Found(self.address, pb.FOUND_VIA_CONFIG)
        elif cfg.discovery.join_address is not None:
            self.leadership.found = Found(cfg.discovery.join_address, pb.FOUND_VIA_CONFIG)
        worker = self._worker = self._new_worker()
        self._add_services(server, worker)
        await server.start()
        try:
            async with contextlib.AsyncExitStack() as stack:
                if cfg.discovery.mdns:  # left after _serve: goodbye packets before the server
                    mdns = await _mdns_discovery(cfg, self.node_id, self.address)
                    self.leadership.mdns = await stack.enter_async_context(mdns)
                if cfg.web.metrics_port is not None:
                    page = SwarmPage(cfg.swarm_name, cfg.transport, self._coordinator_address)
                    self.metrics_address = await open_web(self, page, stack)
                info = self._write_ready()
                log.info("node %s listening on %s", self.node_id, self.address)
                log.info("device: %s, precision: %s", describe(self.device),
                         resolve_precision(cfg.train.precision, self.device))  # fmt: skip
                _log_security(cfg)
                on_ready(info)
                await self._serve(worker, server)
        finally:
            # After a failed run, end open streams at once so neighbours learn of it now.
            await server.stop(0 if self._ending.error else cfg.transport.stop_grace_s)
            await worker.close_channels()
            await self.relays.close()
            if self.gate is not None:
                await self.gate.close()
            # Wait for the torch op in progress (if any); nothing new is submitted after stop.
            await asyncio.to_thread(self._compute.shutdown, wait=True, cancel_futures=True)
        if self._ending.error is not None:
            failed = Banned if isinstance(self._ending.error, Banned) else RunFailed
            raise failed(str(self._ending.error)) from self._ending.error

    def _new_worker(self) -> Worker:
        cfg = self.config
        found = self.leadership.found
        worker = Worker(
            averaging=self.averaging,
            node_id=self.node_id,
            address=self.address,
            coordinator_address=found.address if found else "",
            compute_threads=torch.get_num_threads(),
            transport=cfg.transport,
            compute=self._compute,
            device=self.device,
            counters=self.counters,
            coordinator_grace_s=cfg.membership.coordinator_grace_s,
            checkpoints=(
                CheckpointDir(cfg.state_dir, cfg.checkpoints.checkpoint_keep)
                if cfg.state_dir is not None and not cfg.membership.coordinator_only
                else None
            ),
            resume=cfg.checkpoints.resume,
            model_dirs=(*map(Path, cfg.compute.model_dirs), *local_paths(cfg.train.model)),
            fault_fuzz_upstream=cfg.faults.fault_fuzz_upstream,
            certificate=self.certificate,
            on_revocations=self._revocations,
        )
        worker.relay_node_id = self.relays.relay_node_id
        worker.relay_address = self.relays.relay_address
        worker.compute_scale = cfg.faults.fault_compute_scale
        worker.block_delay_s = cfg.faults.fault_block_ms / 1000
        return worker

    def _revocations(self, blob: bytes) -> None:
        """A plan carries the authority's revocation list: take it if it is newer (its members
        are refused from now on: transport/membership.py)."""
        try:
            self.membership.adopt(blob)
        except MembershipError as exc:
            log.warning("ignoring the plan's revocation list: %s", exc)

    def _add_services(self, server: grpc.aio.Server, worker: Worker) -> None:
        """This node's services (services.py), and its coordinator service if it is the
        coordinator by configuration."""
        cfg = self.config
        server.add_generic_rpc_handlers([self.averaging.handler()])
        boundary = BoundaryServer(
            worker.open_session,
            worker.close_session,
            worker.on_refused,
            worker.limits,
            dial_in=worker.dial_in,
        )
        server.add_generic_rpc_handlers([boundary.handler()])
        server.add_generic_rpc_handlers([ProbeServer(self._admit_probe, self.counters).handler()])
        pb_grpc.add_NodeServicer_to_server(NodeService(self.status, lambda: self._worker), server)
        if cfg.discovery.is_coordinator:
            self.leadership.service = self._coordinator_service(epoch=1)
        if cfg.discovery.is_coordinator or cfg.discovery.elects:
            gate = CoordinatorGate(lambda: self.leadership.service)
            pb_grpc.add_CoordinatorServicer_to_server(gate, server)
        if self.leadership.votes is not None:
            ballot = partial(self.leadership.ballot, worker)
            election = ElectionService(cfg.swarm_name, self.leadership.votes, ballot,
                                       self.membership.check_member)  # fmt: skip
            pb_grpc.add_ElectionServicer_to_server(election, server)

    def _coordinator_address(self) -> str | None:
        found = self.leadership.found
        return found.address if found is not None else None

    async def status(self, brief: bool = False) -> pb.NodeStatus:
        """This node's `Node.Status` (status.py)."""
        return await node_status(self, brief)

    def _write_ready(self) -> NodeInfo:
        """This node's NodeInfo, written to READY_FILE in its state dir (again when its address
        changes: it went through a relay)."""
        cfg = self.config
        info = NodeInfo(
            self.node_id,
            self.address,
            os.getpid(),
            cfg.discovery.is_coordinator,
            self.metrics_address,
        )
        if cfg.state_dir is not None:
            write_atomic(cfg.state_dir / READY_FILE, json.dumps(asdict(info)).encode())
        return info

    async def _join_through_relay(self, worker: Worker, refused: Unreachable) -> bool:
        """The coordinator cannot reach this node at its address: go through a relay it
        offers (relays.py) and make the port there this node's address. False if asked to
        stop meanwhile; Unreachable, with what to do, if this node may not go through one."""
        coordinator = self.leadership.coordinator_address
        self.address = await self.relays.join_through(refused, coordinator)
        self.leadership.address = self.address
        if self._ending.stop.is_set():
            return False
        worker.reached_through(self.address, self.relays.relay_node_id)
        self._write_ready()
        return True

    async def _admit_probe(self, peer_node_id: str, epoch: int, nbytes: int, done: bool) -> None:
        """Link probes: under epoch 0 a member measuring its link to this coordinator or this
        node; under a plan's epoch, a neighbour of this node's stage; one prober at a time
        (`done`: the probe that ends a measurement). Refusal otherwise."""
        service = self.leadership.service
        if epoch == 0 and service is not None:
            service.admit_probe(peer_node_id, nbytes, done=done)
            return
        assert self._worker is not None
        await self._worker.admit_probe(peer_node_id, epoch, nbytes, done=done)

    def _coordinator_service(self, epoch: int) -> CoordinatorService:
        cfg = self.config
        store = None
        if cfg.membership.coordinator_only:
            assert cfg.state_dir is not None  # NodeConfig requires it
            store = CoordinatorStore(cfg.state_dir)
        return CoordinatorService(
            train=cfg.train,
            swarm_size=cfg.membership.swarm_size,
            swarm_id=f"{cfg.swarm_name}/{cfg.train.model}",
            summary_path=cfg.state_dir / SUMMARY_FILE if cfg.state_dir else None,
            epoch=epoch,
            lease_s=cfg.membership.lease_s,
            store=store,
            probe=partial(probe_node, transport=cfg.transport),
            reach=partial(probe_node, tries=1, transport=cfg.transport),
            node_id=self.node_id,
            relay_address=self.relays.relay_address,
            membership=self.membership,
        )

    async def _failing(self, work: Awaitable[None]) -> None:
        """Run a background loop whose failure (a peer's: PeerError; or RunFailed) fails this
        node's run."""
        try:
            await work
        except (PeerError, RunFailed) as exc:
            self._ending.fail(exc)

    async def _train(self, worker: Worker, spawn: Spawn) -> None:
        """Find or elect the coordinator and train until the run ends; through a relay if the
        coordinator cannot reach this node (its tunnel kept by a task `spawn` starts). A
        failure fails the node's run."""
        try:
            if self.config.discovery.elects:
                await self.leadership.elect(worker)
            elif not worker.coordinator_address:
                await self.leadership.find(worker)
            try:
                await worker.run()
            except Unreachable as exc:
                if not await self._join_through_relay(worker, exc):
                    return
                spawn(self._failing(self.relays.keep()), "tunnel")
                try:
                    await worker.run()
                except Unreachable as again:
                    assert self.relays.tunnel is not None
                    advice = relay_advice(self.relays.tunnel.relay)
                    raise Unreachable(f"{again}. {advice}") from None
        except Exception as exc:
            error = banned(_first_error(exc))
            if self._ending.stop.is_set():
                # Asked to stop: ending this node's own calls (below) can make the run
                # fail on its way out; that is the stop, not a failed run.
                log.info("training ended by the stop: %s", error)
                return
            self._ending.error = error
            if isinstance(error, RavnestError):  # a peer's fault or a bad plan
                log.error("training stopped: %s", error)
            else:  # our own bug: say so loudly, with the traceback
                log.exception("training stopped by an internal error", exc_info=error)
            self._ending.stop.set()

    async def _serve(self, worker: Worker, server: grpc.aio.Server) -> None:
        """Run this node's background tasks, all in one TaskGroup, until it is asked to stop;
        then end them (`_end`)."""
        cfg, leadership = self.config, self.leadership
        async with asyncio.TaskGroup() as tg:
            tasks: list[asyncio.Task[None]] = []

            def spawn(work: Coroutine[Any, Any, None], name: str) -> None:  # a Spawn
                tasks.append(tg.create_task(work, name=name))

            if not cfg.membership.coordinator_only:  # a lab coordinator holds no stage
                spawn(self._train(worker, spawn), "train")
                spawn(self._failing(worker.keep_membership()), "membership")
                spawn(self._leave(worker), "leave")
            if cfg.discovery.elects:
                keep = leadership.keep(
                    worker,
                    stopped=self._ending.stop.is_set,
                    leaving=lambda: self._ending.leave.is_set() or self._ending.stop.is_set(),
                )
                spawn(self._failing(keep), "election")
            if self.relays.tunnel is not None:
                spawn(self._failing(self.relays.keep()), "tunnel")
            if leadership.mdns is not None:
                spawn(leadership.mdns.run(), "mdns")
            await self._ending.stop.wait()
            await self._end(worker, server, tasks)

    async def _end(
        self, worker: Worker, server: grpc.aio.Server, tasks: list[asyncio.Task[None]]
    ) -> None:
        """Stop: the last checkpoint (unless the run failed), the worker, then every task."""
        if self._ending.error is None:
            await worker.checkpoint_on_stop(STOP_DRAIN_S, STOP_PAUSE_S)
        await worker.stop()
        for task in tasks:
            task.cancel()
        # A task cancelled while it waits for a reply from this node's own server (the
        # coordinator's worker reading its own WatchPlan) can stay cancelling until the
        # server's side of that call ends: grpc.aio finishes the client's cancel only then.
        # Seen as a stop that never finished, a few times in a hundred; so if the tasks do
        # not end promptly, end the server's calls first.
        # (A lab coordinator that was stopped before its swarm planned has no task at all.)
        _, lingering = await asyncio.wait(tasks, timeout=STOP_TASKS_S) if tasks else (set(), set())
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


async def _mdns_discovery(cfg: NodeConfig, node_id: str, address: str) -> MdnsDiscovery:
    """This node's mDNS advertisement and browser (entered by the caller)."""
    host, port = split_host_port(address)
    record = TxtRecord(
        swarm=cfg.swarm_name,
        node_id=node_id,
        protocol=PROTOCOL,
        role="coordinator" if cfg.discovery.is_coordinator else "worker",
    )
    ips = await advertised_ips(host, cfg.discovery.mdns_interface)
    return MdnsDiscovery(
        swarm=cfg.swarm_name,
        protocol=PROTOCOL,
        interface=cfg.discovery.mdns_interface,
        advertisement=Advertisement(txt=record, port=port, ips=ips),
    )


def _log_security(cfg: NodeConfig) -> None:
    """Say whether the swarm is open or protected (and until when this member may be in it)."""
    creds = cfg.transport.credentials
    if creds is None:
        log.warning("swarm %r is open: anyone who can reach this node may join it "
                    "(protect it with --swarm-dir DIR from `ravnest-node init-swarm`)",
                    cfg.swarm_name)  # fmt: skip
    else:
        log.info("swarm %r is protected: mutual TLS with every peer (member "
                 "certificate valid until %s)", cfg.swarm_name,
                 f"{creds.expires:%Y-%m-%d}")  # fmt: skip


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
