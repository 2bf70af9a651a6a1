"""One replica-group member in its own process, for tests/test_averaging.py.

It serves `/ravnest.v1.Averaging/Push` on 127.0.0.1 (port 0) and talks JSON lines on stdio:

    stdout {"event": "ready", "port": P}
    stdin  {"members": [[node_id, address], ...]}
    stdout {"event": "attached"}
    stdin  go
    stdout {"event": "round", ...}        one per round (an honest member), naming the file
                                          (in --out) that holds the parameters before and
                                          after the round and the mean
    stdout {"event": "pushed", ...}       one per round (a poisoning member, which reads
                                          `again` on stdin before the last)
    stdout {"event": "done"}
    stdin  EOF                            then it exits 0

An honest member starts from the same parameters as every other (seed 0), takes a random "local
training" step of its own (--seed) before each round, and averages with OuterOptimizer and
ReplicaAverager. A poisoning member (--poison) pushes, in rounds 0-3: a delta full of NaN, one
--huge times the size of an honest member's, one --moderate times that size, and a --huge one
again, each after the honest members' pushes of that round reached it (so they have begun the
round and admit it). Then, once told `again` on stdin, it pushes a delta of round 4 without
waiting (the honest members have banned it by then).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
import torch
from fakes import claimed  # (run as a script: this file's folder is on the path)

from ravnest_node.averaging import AveragingConfig, AveragingService, OuterOptimizer, Replica
from ravnest_node.averaging.exchange import ReplicaAverager
from ravnest_node.averaging.outer import flatten_into, param_count
from ravnest_node.averaging.wire import SERVICE, Pusher
from ravnest_node.compression import get_codec
from ravnest_node.transport.frames import (
    FrameKind,
    FrameLimits,
    Outgoing,
    encode_frame,
    parse_frame,
)
from ravnest_node.transport.options import TransportConfig, server_options
from ravnest_node.transport.proofs import NODE_ID_KEY

SHAPES = [(40, 50), (50,), (17, 13)]
MAX_MESSAGE_BYTES = 4 * 2**20
LOCAL_STEP = 0.05
LIMITS = FrameLimits(max_message_bytes=MAX_MESSAGE_BYTES, max_tensors=1, max_samples=0)


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def read_stdin() -> str:
    return await asyncio.to_thread(sys.stdin.readline)


async def honest(
    args: argparse.Namespace, service: AveragingService, members: list[Replica]
) -> ReplicaAverager:
    init = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=init) * 0.1 for s in SHAPES]
    local = torch.Generator().manual_seed(args.seed)
    config = AveragingConfig(
        every_steps=4,
        outer_lr=args.outer_lr,
        momentum=args.momentum,
        codec=args.codec,
        timeout_s=args.timeout_s,
    )
    outer = OuterOptimizer(params, config)
    numel = param_count(params)
    averager = ReplicaAverager(
        node_id=args.node_id,
        members=members,
        config=config,
        numel=numel,
        max_message_bytes=MAX_MESSAGE_BYTES,
    )
    service.attach(averager)
    emit(event="attached")
    assert (await read_stdin()).strip() == "go"
    flat = torch.empty(numel)
    for r in range(args.rounds):
        for p in params:
            p.add_(torch.randn(p.shape, generator=local), alpha=LOCAL_STEP)
        before = flatten_into(params, flat).clone()
        delta = outer.begin_round(params)
        result = await averager.average(r, delta, step=(r + 1) * config.every_steps)
        outer.apply(params, result.mean)
        saved = args.out / f"{args.node_id}-{r}.pt"
        after = flatten_into(params, flat)
        torch.save({"before": before, "after": after, "mean": result.mean}, saved)
        emit(
            event="round",
            round=r,
            saved=str(saved),
            participants=list(result.participants),
            missing=list(result.missing),
            rejected=list(result.rejected),
            clipped=list(result.clipped),
            banned=list(result.banned),
            bytes_sent=result.bytes_sent,
            wait_s=result.wait_s,
        )
    return averager


class Sink:
    """The poisoning member's server: takes every push and remembers who sent which round."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.changed = asyncio.Condition()

    def handler(self) -> Any:
        async def push(request: bytes, context: Any) -> bytes:
            sender = dict(context.invocation_metadata())[NODE_ID_KEY]
            seq = parse_frame(request, LIMITS).seq
            async with self.changed:
                self.seen.add((sender, seq))
                self.changed.notify_all()
            return b""

        return grpc.method_handlers_generic_handler(
            SERVICE, {"Push": grpc.unary_unary_rpc_method_handler(push)}
        )


async def poison(args: argparse.Namespace, sink: Sink, members: list[Replica]) -> Pusher:
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    others = [m for m in members if m.node_id != args.node_id]
    pusher = Pusher(args.node_id, TransportConfig(max_message_bytes=MAX_MESSAGE_BYTES))
    emit(event="attached")
    assert (await read_stdin()).strip() == "go"
    noise = torch.Generator().manual_seed(args.seed)

    def sized(times: float) -> torch.Tensor:
        return torch.randn(numel, generator=noise) * LOCAL_STEP * times  # times an honest step

    deltas = [torch.full((numel,), float("nan")), sized(args.huge), sized(args.moderate)]
    deltas += [sized(args.huge), sized(1.0)]
    deadline = asyncio.get_running_loop().time() + 60
    for r, delta in enumerate(deltas):
        if r < 4:
            async with sink.changed:
                await sink.changed.wait_for(
                    lambda r=r: all((m.node_id, r) in sink.seen for m in others)
                )
        else:
            assert (await read_stdin()).strip() == "again"
        codec = get_codec("none" if r == 0 else "int8-block")
        message = encode_frame(FrameKind.DELTA, r, 0, [Outgoing("delta", delta, codec)])
        status = {}
        for m in others:
            try:
                await pusher.push(m, message, deadline)
                status[m.node_id] = "OK"
            except Exception as exc:  # the test reads the reason
                status[m.node_id] = str(exc)
        emit(event="pushed", round=r, status=status)
    return pusher


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default="int8-block")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--poison", action="store_true")
    parser.add_argument("--huge", type=float, default=1e4)
    parser.add_argument("--moderate", type=float, default=6.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = grpc.aio.server(options=server_options(TransportConfig()))
    port = server.add_insecure_port("127.0.0.1:0")
    service, sink = AveragingService(), Sink()
    # Members with readable ids (the test's): their pushes are taken unproven (fakes.py).
    handler = sink.handler() if args.poison else service.handler(caller=claimed)
    server.add_generic_rpc_handlers([handler])
    await server.start()
    emit(event="ready", port=port)
    members = [Replica(i, a) for i, a in json.loads(await read_stdin())["members"]]
    if args.poison:
        closer: Any = await poison(args, sink, members)
    else:
        closer = await honest(args, service, members)
    emit(event="done")
    await read_stdin()  # EOF: the test is finished with us
    await closer.close()
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
