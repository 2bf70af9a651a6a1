"""The node daemon: one process, one event loop, one TaskGroup owning every background task.

`NodeDaemon.run` opens the gRPC server (boundary streams, node status and, on the coordinator,
the coordinator service), signals readiness, runs the worker, and on `stop()` (SIGINT/SIGTERM)
leaves the TaskGroup, stops the server with a grace period and returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import torch

from ravnest_node.averaging import AveragingService
from ravnest_node.coordination.coordinator import CoordinatorService
from ravnest_node.daemon.worker import Worker
from ravnest_node.errors import ConfigError, RavnestError, RunFailed, StartupError
from ravnest_node.pipeline.run import TrainConfig, check_frame_limit, check_swarm_shape
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.state import load_or_create_node_id, write_atomic
from ravnest_node.transport.boundary import BoundaryServer, LinkCounters
from ravnest_node.transport.options import TransportConfig, server_options, split_host_port
from ravnest_node.transport.probe import ProbeServer

log = logging.getLogger(__name__)

LogLevel = Literal["debug", "info", "warning", "error"]
READY_FILE = "ready.json"
# Calls a node serves at once (boundary streams, control calls, status); more wait or fail.
MAX_CONCURRENT_RPCS = 64
SUMMARY_FILE = "summary.json"


@dataclass(kw_only=True, frozen=True, slots=True)
class NodeConfig:
    """One ravnest-node daemon."""

    listen: str = "127.0.0.1:0"
    """Address of this node's gRPC server, HOST:PORT; port 0 picks a free port."""
    advertise: str | None = None
    """Address other nodes use to reach this one (default: the listen address)."""
    state_dir: Path | None = None
    """Directory for this node's id and state files (default: none kept, a new id each start)."""
    join: str | None = field(default=None, metadata={"flag": "--join"})
    """Coordinator to join, HOST:PORT; without it this node is the coordinator."""
    swarm_size: int = 1
    """Coordinator only: nodes to wait for before handing out the plan (itself included)."""
    swarm_name: str = "default"
    """Coordinator only: name of the swarm, part of its id."""
    compute_threads: int = field(default=0, metadata={"flag": "--threads"})
    """Threads torch may use for this node's compute (0 = torch's default)."""
    log_level: LogLevel = "info"
    """How much the node logs (to standard error)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training run (used by the coordinator, which hands it to every node)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Limits and timeouts of the gRPC transport."""

    def __post_init__(self) -> None:
        split_host_port(self.listen)
        if self.advertise is not None:
            _, port = split_host_port(self.advertise)
            if port == 0:
                raise ConfigError(f"advertise={self.advertise!r}: needs a real port, not 0")
        if self.join is not None:
            split_host_port(self.join)
        if not 1 <= self.swarm_size <= 1024:
            raise ConfigError(f"swarm_size={self.swarm_size}: must be between 1 and 1024")
        if self.compute_threads < 0:
            raise ConfigError(f"compute_threads={self.compute_threads}: must be >= 0")
        if self.is_coordinator:
            check_frame_limit(self.train, self.transport.max_message_bytes)
            check_swarm_shape(self.swarm_size, self.train)

    @property
    def is_coordinator(self) -> bool:
        return self.join is None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node announces when it is ready."""

    node_id: str
    address: str
    pid: int
    coordinator: bool


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, daemon: NodeDaemon) -> None:
        self._daemon = daemon

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.NodeStatus:
        return await self._daemon.status()


class NodeDaemon:
    """A running node. Create it, then `await run(on_ready)`; `stop()` ends it gracefully."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._stop = asyncio.Event()
        self._counters = LinkCounters()
        self.node_id = load_or_create_node_id(config.state_dir)
        self.address = ""
        self._worker: Worker | None = None
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ravnest-compute")
        self.run_error: BaseException | None = None

    def stop(self) -> None:
        """Ask the node to stop (safe to call from a signal handler on the loop)."""
        self._stop.set()

    async def run(self, on_ready: Callable[[NodeInfo], None]) -> None:
        """Serve until stopped. Raises StartupError if the server cannot listen and RunFailed
        (after stopping cleanly) if this node's training run failed."""
        cfg = self.config
        if cfg.compute_threads:
            torch.set_num_threads(cfg.compute_threads)
        server = grpc.aio.server(
            options=server_options(cfg.transport), maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS
        )
        host, port = split_host_port(cfg.listen)
        _check_bindable(host, port, cfg.listen)
        try:
            port = server.add_insecure_port(cfg.listen)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {cfg.listen}: {_bind_reason(exc)}") from None
        self.address = cfg.advertise or f"{host}:{port}"
        coordinator_address = cfg.join or self.address
        averaging = AveragingService()
        worker = Worker(
            averaging=averaging,
            node_id=self.node_id,
            address=self.address,
            coordinator=coordinator_address,
            compute_threads=torch.get_num_threads(),
            transport=cfg.transport,
            compute=self._compute,
            counters=self._counters,
        )
        self._worker = worker
        server.add_generic_rpc_handlers([averaging.handler()])
        boundary = BoundaryServer(
            worker.open_session, worker.close_session, worker.on_refused, worker.limits
        )
        server.add_generic_rpc_handlers([boundary.handler()])
        server.add_generic_rpc_handlers([ProbeServer(worker.check_probe).handler()])
        pb_grpc.add_NodeServicer_to_server(NodeService(self), server)
        if cfg.is_coordinator:
            swarm_id = f"{cfg.swarm_name}/{cfg.train.model}"
            summary_path = cfg.state_dir / SUMMARY_FILE if cfg.state_dir else None
            coordinator = CoordinatorService(
                train=cfg.train,
                swarm_size=cfg.swarm_size,
                swarm_id=swarm_id,
                summary_path=summary_path,
            )
            pb_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        await server.start()
        try:
            info = NodeInfo(self.node_id, self.address, os.getpid(), cfg.is_coordinator)
            if cfg.state_dir is not None:
                write_atomic(cfg.state_dir / READY_FILE, json.dumps(asdict(info)).encode())
            log.info("node %s listening on %s", self.node_id, self.address)
            on_ready(info)
            await self._serve(worker)
        finally:
            # After a failed run, end open streams at once so neighbours learn of it now.
            await server.stop(0 if self.run_error else cfg.transport.stop_grace_s)
            # Wait for the torch op in progress (if any); nothing new is submitted after stop.
            await asyncio.to_thread(self._compute.shutdown, wait=True, cancel_futures=True)
        if self.run_error is not None:
            raise RunFailed(str(self.run_error)) from self.run_error

    async def _serve(self, worker: Worker) -> None:
        async def train() -> None:
            try:
                await worker.run()
            except Exception as exc:
                error = _first_error(exc)
                self.run_error = error
                if isinstance(error, RavnestError):  # a peer's fault or a bad plan
                    log.error("training stopped: %s", error)
                else:  # our own bug: say so loudly, with the traceback
                    log.exception("training stopped by an internal error", exc_info=error)
                self._stop.set()

        async with asyncio.TaskGroup() as tg:
            training = tg.create_task(train())
            await self._stop.wait()
            training.cancel()

    async def status(self) -> pb.NodeStatus:
        worker = self._worker
        runtime = worker.runtime if worker else None
        status = pb.NodeStatus(
            node_id=self.node_id,
            address=self.address,
            stage=-1,
            bytes_sent=self._counters.total_bytes,
        )
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
            status.params_sha256 = await runtime.params_digest()
        return status


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
