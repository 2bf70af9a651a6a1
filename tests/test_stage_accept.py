"""The stage's admission decisions, without sockets: what the plan allows is queued, the rest
is refused with a reason and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ravnest_node.compression import get_codec
from ravnest_node.errors import FrameError
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.stage import StageRuntime
from ravnest_node.transport.frames import Frame, FrameKind, FrameLimits, encode_frame, parse_frame

from .conftest import tiny_middle_stage

NONE = get_codec("none")


def _runtime(pool: ThreadPoolExecutor, steps: int, max_staleness: int = 0) -> StageRuntime:
    """Stage 1 of 3 (block 2 of tiny), as a swarm would build it."""
    run = TrainConfig(
        model="tiny", steps=steps, batch_size=16, microbatches=4, max_staleness=max_staleness
    )
    return tiny_middle_stage(pool, run)


@pytest.fixture
def stage() -> Iterator[StageRuntime]:
    with ThreadPoolExecutor(1) as pool:
        yield _runtime(pool, steps=2)


def _forward(seq: int, version: int | None = None, hidden: tuple[int, ...] = (4, 32, 64)) -> Frame:
    message = encode_frame(
        FrameKind.FORWARD,
        seq,
        seq // 4 if version is None else version,
        [
            ("hidden", torch.zeros(hidden), NONE),
            ("targets", torch.zeros(4, 32, dtype=torch.uint8), NONE),
        ],
    )
    return parse_frame(message, FrameLimits(max_message_bytes=1 << 24))


def _grad(seq: int) -> Frame:
    message = encode_frame(
        FrameKind.BACKWARD, seq, seq // 4, [("grad", torch.zeros(4, 32, 64), NONE)]
    )
    return parse_frame(message, FrameLimits(max_message_bytes=1 << 24))


async def _refused(stage: StageRuntime, frame: Frame, reason: str) -> None:
    before = (stage.queued, stage.frames_accepted, stage.received_all_forwards)
    with pytest.raises(FrameError, match=reason):
        await stage.accept_from_upstream(frame)
    assert (stage.queued, stage.frames_accepted, stage.received_all_forwards) == before


async def test_forward_frames_in_order_are_queued(stage: StageRuntime) -> None:
    await stage.accept_from_upstream(_forward(0))
    await stage.accept_from_upstream(_forward(1))
    assert stage.queued == 2 and stage.frames_accepted == 2
    await _refused(stage, _forward(1), "forward seq 1, expected 2")
    await _refused(stage, _forward(5), "forward seq 5, expected 2")


async def test_wrong_version_shape_or_kind_is_refused(stage: StageRuntime) -> None:
    await _refused(stage, _forward(0, version=1), "carries weight version 1, expected 0")
    await _refused(stage, _forward(0, hidden=(4, 32, 65)), r"shape \[4, 32, 65\]")
    await _refused(stage, _grad(0), "only forward frames travel downstream")
    with pytest.raises(FrameError, match="gradient for microbatch 0, which is not in flight"):
        await stage.accept_from_downstream(_grad(0))
    with pytest.raises(FrameError, match="only gradient frames travel upstream"):
        await stage.accept_from_downstream(_forward(0))
    assert stage.queued == 0


async def test_frames_past_the_run_are_refused() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage = _runtime(pool, steps=1)
        for seq in range(4):  # 1 step x 4 microbatches
            await stage.accept_from_upstream(_forward(seq))
        assert stage.received_all_forwards
        await _refused(stage, _forward(4), "past the plan's last microbatch 3")


async def test_a_flood_beyond_the_schedule_is_refused() -> None:
    """With max_staleness S, an upstream that follows the schedule has at most S + 1 steps of
    microbatches waiting here; one more is a flood."""
    for staleness in (0, 2):
        with ThreadPoolExecutor(1) as pool:
            stage = _runtime(pool, steps=10, max_staleness=staleness)
            window = (staleness + 1) * 4
            for seq in range(window):
                await stage.accept_from_upstream(_forward(seq, version=0))
            await _refused(
                stage, _forward(window, version=window // 4 - staleness), "more frames in flight"
            )


async def test_a_payload_that_does_not_decode_is_refused(stage: StageRuntime) -> None:
    int8 = get_codec("int8-block")
    message = bytearray(
        encode_frame(
            FrameKind.FORWARD,
            0,
            0,
            [
                ("hidden", torch.randn(4, 32, 64), int8),
                ("targets", torch.zeros(4, 32, dtype=torch.uint8), NONE),
            ],
            lz4_min_ratio=0,
        )
    )
    limits = FrameLimits(max_message_bytes=1 << 24)
    frame = parse_frame(bytes(message), limits)
    start = len(message) - frame.nbytes  # payloads follow the header, hidden first
    message[start + 16 * 4] = 0x80  # the first int8 code after 16 float32 scales: -128
    await _refused(stage, parse_frame(bytes(message), limits), "code")
    await stage.accept_from_upstream(_forward(0))  # the schedule did not move: seq 0 still fits


async def test_versions_older_than_the_staleness_bound_are_refused() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage = _runtime(pool, steps=10, max_staleness=1)
        for seq in range(4):
            await stage.accept_from_upstream(_forward(seq))  # step 0, version 0
        # Microbatch 4 is of step 1: computed with version 1, or 0 (one update behind).
        await _refused(stage, _forward(4, version=2), "version 2, expected 1 or down to 0")
        await stage.accept_from_upstream(_forward(4, version=0))
        await _refused(stage, _forward(5, version=2), "version 2, expected 1 or down to 0")
