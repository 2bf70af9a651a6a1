"""A stage's frames are coded on the encoder's coder thread while the loop goes on; each link
still gets its frames in order, counted once, without sockets."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import GRAD, HIDDEN, TARGETS
from ravnest_node.transport.frames import FrameLimits, parse_frame

from .conftest import tiny_middle_compute, tiny_middle_stage

LIMITS = FrameLimits(max_message_bytes=1 << 24)


class RecordingLink:
    """Stands for a BoundaryLink: records what is queued on it."""

    def __init__(self) -> None:
        self.queued: list[tuple[int, bytes]] = []

    async def send(self, message: bytes, seq: int) -> None:
        self.queued.append((seq, message))


async def test_a_link_gets_its_frames_in_order_whatever_order_they_are_coded() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage = tiny_middle_stage(pool, TrainConfig(model="tiny", steps=2, microbatches=4))
        link: Any = RecordingLink()
        first: Future[bytes] = Future()
        second: Future[bytes] = Future()
        second.set_result(b"second")  # coded before the frame given to the link before it
        await stage._send(link, first, 0, activations=True)  # nothing before it: returns
        waiting = asyncio.create_task(stage._send(link, second, 1, activations=True))
        for _ in range(20):  # (yields only: every callback that is ready runs)
            await asyncio.sleep(0)
        assert link.queued == [] and not waiting.done()
        first.set_result(b"first")
        await waiting
        await stage._flush_sends()
        assert link.queued == [(0, b"first"), (1, b"second")]
        assert stage.metrics().activation_bytes_sent == len(b"first") + len(b"second")
        assert stage.metrics().gradient_bytes_sent == 0


async def test_a_frame_that_fails_to_code_fails_the_sends_after_it() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage = tiny_middle_stage(pool, TrainConfig(model="tiny", steps=2, microbatches=4))
        link: Any = RecordingLink()
        bad: Future[bytes] = Future()
        bad.set_exception(ValueError("klt: the tensor holds values that are not finite"))
        good: Future[bytes] = Future()
        good.set_result(b"good")
        await stage._send(link, bad, 0, activations=False)
        with pytest.raises(ValueError, match="not finite"):
            await stage._send(link, good, 1, activations=False)
        with pytest.raises(ValueError, match="not finite"):
            await stage._flush_sends()
        assert link.queued == []


def test_compute_hands_its_frames_to_the_coder_thread() -> None:
    run = TrainConfig(model="tiny", steps=2, batch_size=16, microbatches=4, codec="klt")
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as pool:
        compute = tiny_middle_compute(pool, run)
        threads: list[str] = []
        encode = compute.encoder.forward

        def recording_forward(*args: Any) -> bytes:
            threads.append(threading.current_thread().name)
            return encode(*args)

        compute.encoder.forward = recording_forward  # type: ignore[method-assign]
        hidden = torch.randn(4, 32, 64)
        targets = torch.zeros(4, 32, dtype=torch.long)
        frames = [
            pool.submit(compute.forward, seq, 0, {HIDDEN: hidden, TARGETS: targets}, ()).result()
            for seq in range(3)
        ]
        seqs = [parse_frame(f.result(), LIMITS).seq for f in frames]
        assert seqs == [0, 1, 2]
        assert threads == ["coder-1_0"] * 3
        _, grad = pool.submit(compute.backward, 0, torch.randn(4, 32, 64)).result()
        assert grad is not None and GRAD in parse_frame(grad.result(), LIMITS).decode()
        compute.encoder.close()
