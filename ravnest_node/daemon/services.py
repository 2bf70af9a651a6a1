"""The gRPC services a node serves itself: `ravnest.v1.Node` (status, block and checkpoint
transfers), the gate in front of `ravnest.v1.Coordinator`, and `probe_node`, the liveness
question a coordinator asks of a member through that service; and `listen`, where the server
that serves them is reached.

They reach the daemon through callables, not the daemon itself: what they may ask of it is
exactly what they are given.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ravnest_node.coordination.coordinator.membership import ProbeAnswer
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.daemon.worker.worker import Worker
from ravnest_node.errors import StartupError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.errors import Refusal, unanswered
from ravnest_node.transport.gate import TlsGate
from ravnest_node.transport.options import (
    TransportConfig,
    grpc_channel,
    split_host_port,
    tcp_answer,
)
from ravnest_node.transport.proofs import check_request

T = TypeVar("T")


async def _proven(context: grpc.aio.ServicerContext[Any, Any], method: str, request: Any) -> None:
    """The request's node id is the caller's, proven (transport/proofs.py); the call is
    aborted UNAUTHENTICATED otherwise."""
    try:
        check_request(context, method, request)
    except Refusal as refusal:
        await context.abort(refusal.code, refusal.reason)


class NodeService(pb_grpc.NodeServicer):
    """`ravnest.v1.Node`: this node's status (`status(brief)`), and the blocks and checkpoints
    its worker streams (UNAVAILABLE while `worker()` is None: the node is starting)."""

    def __init__(
        self,
        status: Callable[[bool], Awaitable[pb.NodeStatus]],
        worker: Callable[[], Worker | None],
    ) -> None:
        self._status = status
        self._worker = worker

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.NodeStatus:
        return await self._status(request.brief)

    async def FetchBlock(
        self, request: pb.BlockRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.BlockChunk]:
        await _proven(context, "/ravnest.v1.Node/FetchBlock", request)
        async for chunk in self._from_worker(context, lambda w: w.fetch_block(request)):
            yield chunk

    async def FetchCheckpoint(
        self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.CheckpointChunk]:
        await _proven(context, "/ravnest.v1.Node/FetchCheckpoint", request)
        async for chunk in self._from_worker(context, lambda w: w.fetch_checkpoint(request)):
            yield chunk

    async def AuditRecord(
        self, request: pb.AuditRecordRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.AuditChunk]:
        await _proven(context, "/ravnest.v1.Node/AuditRecord", request)
        async for chunk in self._from_worker(context, lambda w: w.audit_record(request)):
            yield chunk

    async def _from_worker(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        stream: Callable[[Worker], AsyncIterator[T]],
    ) -> AsyncIterator[T]:
        """What the worker streams; its Refusal as the call's status."""
        worker = self._worker()
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
) -> ProbeAnswer:
    """Is node `node_id` alive at `address` (Coordinator.Suspect, and a joining node's
    address)? ALIVE: it answers a brief Node.Status (no compute) with its id within
    `timeout_s`, on the first or a later try. REFUSED: its address refuses a plain TCP
    connection (nobody listens: a killed process, found at once), or another node answers
    there (the node started again there is not it: its Join tells the coordinator of the
    restart). SILENT: nothing answered in time on any try (a machine off, a link cut): no
    verdict."""
    loop = asyncio.get_running_loop()
    for _ in range(tries):
        deadline = loop.time() + timeout_s
        connected = await _connect(address, timeout_s)
        if connected is not ProbeAnswer.ALIVE:
            if connected is ProbeAnswer.REFUSED:
                return connected
            continue
        left_s = max(deadline - loop.time(), 0.1)
        async with grpc_channel(address, transport) as channel:
            try:
                status = await pb_grpc.NodeStub(channel).Status(
                    pb.StatusRequest(brief=True), timeout=left_s
                )
            except grpc.aio.AioRpcError as exc:
                if unanswered(exc.code()):
                    continue
                return ProbeAnswer.ALIVE  # it answered, if only to refuse
            return ProbeAnswer.ALIVE if status.node_id == node_id else ProbeAnswer.REFUSED
    return ProbeAnswer.SILENT


async def _connect(address: str, timeout_s: float) -> ProbeAnswer:
    """A plain TCP connection to `address` (`tcp_answer`): ALIVE if it is accepted, REFUSED
    if the address refuses it, SILENT if nothing answers in time."""
    answer = await tcp_answer(address, timeout_s)
    return (
        ProbeAnswer.SILENT
        if answer is None
        else (ProbeAnswer.ALIVE if answer else ProbeAnswer.REFUSED)
    )


class CoordinatorGate(pb_grpc.CoordinatorServicer):
    """`ravnest.v1.Coordinator` on a node that is, or may become, the coordinator: calls go to
    its coordinator service (`service()`) once there is one, and are UNAVAILABLE before."""

    def __init__(self, service: Callable[[], CoordinatorService | None]) -> None:
        self._current = service

    async def _service(self, context: grpc.aio.ServicerContext[Any, Any]) -> CoordinatorService:
        service = self._current()
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

    async def ReportAudit(self, request: Any, context: Any) -> pb.AuditReply:
        return await (await self._service(context)).ReportAudit(request, context)

    async def Revoke(self, request: Any, context: Any) -> pb.RevokeReply:
        return await (await self._service(context)).Revoke(request, context)

    async def WatchPlan(self, request: Any, context: Any) -> AsyncIterator[pb.Plan]:
        async for plan in (await self._service(context)).WatchPlan(request, context):
            yield plan

    async def WatchProgress(self, request: Any, context: Any) -> AsyncIterator[pb.Progress]:
        async for event in (await self._service(context)).WatchProgress(request, context):
            yield event


async def listen(
    server: grpc.aio.Server, address: str, transport: TransportConfig
) -> tuple[str, int, TlsGate | None]:
    """Bind `server` to `address` (HOST:PORT); in a protected swarm it listens on loopback,
    behind a TLS gate on `address`. The host and port it is reached at, and the gate if any.
    StartupError if it cannot listen."""
    host, port = split_host_port(address)
    _check_bindable(host, port, address)
    creds = transport.credentials
    try:
        grpc_port = server.add_insecure_port("127.0.0.1:0" if creds else address)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {address}: {_bind_reason(exc)}") from None
    if creds is None:
        return host, grpc_port, None
    gate = TlsGate(host, port, ("127.0.0.1", grpc_port), creds.server_context())
    try:
        port = await gate.start()
    except OSError as exc:
        raise StartupError(f"cannot listen on {address}: {exc.strerror or exc}") from None
    return host, port, gate


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
