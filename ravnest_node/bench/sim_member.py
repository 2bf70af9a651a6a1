"""Simulated members of a public swarm, for measuring what one coordinator holds
(bench/swarm_size.py): each makes the calls a real member makes to its coordinator, at the
rates a real member makes them, and nothing else (no model, no tensors).

A member serves `Node.Status` (the coordinator asks a newcomer's address whether it is that
node) and `Election.Vote` (the real `ElectionService`, voting as a member that lost its
coordinator would) on a gRPC server of its own; joins without, then with, capabilities (one
block time per block of the run's model); follows the plan stream; sends a heartbeat every
third of its lease; once it owns a stage, reports a step every `step_s` (the last stage of a
pipeline with a loss), as a stage does after each optimizer step, each at a phase of its own
within the step; and leaves. Every call
carries the member's proof, made with a node key of its own (identity.py: signing costs
the members' process, verifying the coordinator's, as in a real swarm), on a connection of its
own (per-peer limits count a loopback connection as a peer). Every call's latency is kept by kind.

Written here rather than reusing the daemon's worker: a worker computes; a thousand of them
do not fit on this machine, and the coordinator cannot tell these from real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ravnest_node.coordination.election import Ballot, ElectionService, VoteBook
from ravnest_node.identity import NodeKey
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import PROTOCOL, heartbeat_interval
from ravnest_node.transport.proofs import provers

__all__ = ["Latencies", "SimMember"]

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""A channel of its own connection (gRPC shares subchannels between channels otherwise)."""
CALL_TIMEOUT_S = 60.0


@dataclass
class Latencies:
    """Seconds each call took, by kind, and the calls that failed, by kind and code."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    failed: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def clear(self) -> None:
        self.seconds.clear()
        self.failed.clear()


class _Node(pb_grpc.NodeServicer):
    def __init__(self, node_id: str) -> None:
        self._node_id = node_id

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.NodeStatus:
        return pb.NodeStatus(node_id=self._node_id)


class SimMember:
    """One simulated member; `start` its server, then `join`, `tell`, `run`; `stop`."""

    def __init__(
        self, swarm: str, block_s: list[float], latencies: Latencies, step_s: float
    ) -> None:
        self.key = NodeKey.generate()
        self.node_id = self.key.node_id
        self._swarm = swarm
        self._block_s = block_s
        self.latencies = latencies
        self._step_s = step_s
        self.address = ""
        self.plan: pb.Plan | None = None
        self.plan_received = asyncio.Event()
        self.newest_epoch = 0
        """The newest plan epoch announced to it (a pending one included)."""
        self.lease_s = 8.0
        self.following = ""
        """The coordinator it follows ("": lost, for an election)."""
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.CoordinatorStub | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.votes = VoteBook(None)

    async def start(self) -> None:
        server = grpc.aio.server()
        pb_grpc.add_NodeServicer_to_server(_Node(self.node_id), server)
        pb_grpc.add_ElectionServicer_to_server(
            ElectionService(self._swarm, self.votes, self._ballot), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server, self.address = server, f"127.0.0.1:{port}"

    def _ballot(self) -> Ballot:
        epoch = self.plan.epoch if self.plan is not None else 0
        return Ballot(own_id=self.node_id, seen=frozenset(), following=self.following,
                      plan_epoch=epoch)  # fmt: skip

    def connect(self, coordinator: str) -> None:
        self._channel = grpc.aio.insecure_channel(coordinator, options=OWN_CONNECTION,
                                                  interceptors=provers(self.key))  # fmt: skip
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self.following = coordinator

    async def _call(self, kind: str, method: Callable[..., Any], request: Any) -> Any:
        started = time.perf_counter()
        try:
            reply = await method(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.latencies.failed[f"{kind} {exc.code().name}"] += 1
            return None
        self.latencies.seconds[kind].append(time.perf_counter() - started)
        return reply

    def _join_request(self, caps: bool, plan_epoch: int = 0) -> pb.JoinRequest:
        request = pb.JoinRequest(node_id=self.node_id, address=self.address, compute_threads=1,
                                 protocol=PROTOCOL, plan_epoch=plan_epoch)  # fmt: skip
        if caps:
            request.capabilities.block_s.extend(self._block_s)
            request.capabilities.memory_bytes = 24 << 30
            request.capabilities.device = "cpu"
            request.capabilities.decodes_klt = True
            request.capabilities.unpacks_deflate = True
        return request

    async def join(self, kind: str = "join") -> bool:
        """The first Join (the coordinator asks this member's address who answers there)."""
        assert self._stub is not None
        reply = await self._call(kind, self._stub.Join, self._join_request(False))
        if reply is not None and reply.lease_s:
            self.lease_s = reply.lease_s
        return reply is not None

    async def tell(self, kind: str = "join with capabilities", plan_epoch: int = 0) -> bool:
        """The second Join, with what this member measured."""
        assert self._stub is not None
        request = self._join_request(True, plan_epoch)
        return await self._call(kind, self._stub.Join, request) is not None

    def run(self) -> None:
        """Heartbeats, the plan stream and (once it owns a stage) step reports, in tasks."""
        self._tasks = [asyncio.create_task(self._beats()), asyncio.create_task(self._watch()),
                       asyncio.create_task(self._reports())]  # fmt: skip

    async def _beats(self) -> None:
        # (Members joined at different moments: their heartbeats keep different phases.)
        await asyncio.sleep(random.uniform(0, heartbeat_interval(self.lease_s)))
        while True:
            await asyncio.sleep(heartbeat_interval(self.lease_s))  # the heartbeat's period
            await self.beat()

    async def beat(self) -> bool:
        """One heartbeat."""
        assert self._stub is not None
        held = self.plan.epoch if self.plan is not None else 0
        request = pb.HeartbeatRequest(node_id=self.node_id, held_epoch=held)
        return await self._call("heartbeat", self._stub.Heartbeat, request) is not None

    async def _watch(self) -> None:
        assert self._stub is not None
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for plan in self._stub.WatchPlan(pb.WatchPlanRequest(node_id=self.node_id)):
                self.newest_epoch = max(self.newest_epoch, plan.epoch)
                if not plan.pending:
                    self.plan = plan
                    self.plan_received.set()

    def stage(self) -> pb.StageAssignment | None:
        if self.plan is None:
            return None
        return next((s for s in self.plan.stages if s.node_id == self.node_id), None)

    async def _reports(self) -> None:
        assert self._stub is not None
        await self.plan_received.wait()
        assert self.plan is not None
        me = self.stage()
        if me is None:  # a spare
            return
        last = max(s.index for s in self.plan.stages if s.pipeline == me.pipeline)
        step = self.plan.start_step
        # The stages of a pipeline end a step one after another, not together: each member
        # steps at its own phase within the step.
        await asyncio.sleep(random.uniform(0, self._step_s))
        while True:
            await asyncio.sleep(self._step_s)  # one optimizer step's compute, simulated
            step += 1
            report = pb.StageReport(
                node_id=self.node_id, stage=me.index, pipeline=me.pipeline,
                plan_epoch=self.plan.epoch, step=step, loss=3.0 if me.index == last else 0.0,
                bytes_sent=step * 1_000_000, compute_s=step * self._step_s,
            )  # fmt: skip
            await self._call("report", self._stub.Report, report)

    async def leave(self) -> None:
        assert self._stub is not None
        await self._call("leave", self._stub.Leave, pb.LeaveRequest(node_id=self.node_id))

    async def halt(self) -> None:
        """Stop its calls (its server still answers: it can vote)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def stop(self) -> None:
        await self.halt()
        if self._server is not None:
            await self._server.stop(0)
