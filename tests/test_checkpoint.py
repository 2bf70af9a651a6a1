"""Stage checkpoints on disk (ravnest_node/checkpoint/store.py): written atomically, loaded
verified, refused whole when anything is wrong, the previous good one used instead; and where a run
resumes from the checkpoints its members offer (negotiate.resume_point)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ravnest_node.blocks import BlockWeights, export_blocks
from ravnest_node.checkpoint import (
    SET_ASIDE_DIR,
    CheckpointDir,
    CheckpointError,
    run_key,
)
from ravnest_node.coordination.planning.negotiate import check_capabilities, resume_point
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb

MODEL = get_model("tiny")
RUN = TrainConfig(model="tiny").to_proto("fingerprint")


def trained_blocks(first: int, stop: int, step: int, seed: int = 0) -> dict[int, BlockWeights]:
    """Blocks [first, stop) after `step` AdamW steps on random data: real moments."""
    torch.manual_seed(seed)
    blocks = torch.nn.Sequential(*MODEL.build_stage(seed, first, stop))
    optimizer = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
    for _ in range(step):
        for p in blocks.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    return export_blocks(blocks, first, optimizer, step)


def save(store: CheckpointDir, blocks: dict[int, BlockWeights], step: int) -> None:
    store.save(blocks, step=step, run=RUN, pipeline=0, stage=1, plan_epoch=1)


def assert_same(a: dict[int, BlockWeights], b: dict[int, BlockWeights]) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].version == b[i].version and a[i].optimizer_step == b[i].optimizer_step
        assert a[i].tensors.keys() == b[i].tensors.keys()
        for key, t in a[i].tensors.items():
            assert torch.equal(t, b[i].tensors[key]), (i, key)


def test_a_checkpoint_loads_back_exactly_with_its_manifest(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path)
    blocks = trained_blocks(1, 3, step=3)
    save(store, blocks, 3)
    manifest, loaded = store.load(3, MODEL)
    assert_same(blocks, loaded)
    assert (manifest.step, manifest.first_block, manifest.stop_block) == (3, 1, 3)
    assert manifest.run_key == run_key(RUN) and manifest.samples_seen == 3 * RUN.batch_size
    assert manifest.optimizer_steps == {1: 3.0, 2: 3.0}
    assert sorted(p.name for p in store.path.iterdir()) == [
        f"step-00000003-{manifest.sha256[:16]}.safetensors", "step-00000003.json"
    ]  # fmt: skip


def test_only_the_newest_are_kept(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        save(store, trained_blocks(0, 1, step=step), step)
    assert store.steps() == [4, 3]
    assert len(list(store.path.iterdir())) == 4


def tensors_of(checkpoints: Path, step: int) -> Path:
    """The tensor file of the checkpoint at `step`."""
    (path,) = checkpoints.glob(f"step-{step:08d}-*.safetensors")
    return path


def corrupt(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda d: corrupt(tensors_of(d, 2), -5), "sha256 does not match"),
        (lambda d: corrupt(tensors_of(d, 2), 20), "sha256 does not match"),
        (lambda d: os.truncate(tensors_of(d, 2), 100), "truncated"),
        (lambda d: tensors_of(d, 2).unlink(), "cannot read it"),
        (lambda d: (d / "step-00000002.json").write_text("{"), "not a valid manifest"),
        (lambda d: (d / "step-00000002.json").write_bytes(b"\xff" * 40), "not a valid manifest"),
        (lambda d: (d / "step-00000002.json").write_text("[]"), "not a JSON object"),
        (lambda d: (d / "step-00000002.json").write_text("[" * 100_000), "not a valid manifest"),
    ],
    ids=["flipped-tail", "flipped-header", "truncated", "missing", "half-json", "binary",
         "not-object", "deep"],
)  # fmt: skip
def test_a_damaged_checkpoint_is_refused_and_the_previous_good_one_used(
    tmp_path: Path, damage: object, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointDir(tmp_path)
    good = trained_blocks(0, 2, step=1)
    save(store, good, 1)
    save(store, trained_blocks(0, 2, step=2), 2)
    damage(store.path)  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=why) as refused:
        store.load(2, MODEL)
    assert "step-00000002" in str(refused.value)  # the message names the file
    latest = store.latest(MODEL)
    assert latest is not None
    assert latest[0].step == 1
    assert_same(good, latest[1])
    assert "checkpoint refused" in caplog.text


def rewrite_manifest(store: CheckpointDir, at: int, changes: dict[str, object]) -> None:
    path = store.path / f"step-{at:08d}.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"model": "small"}, "of model 'small'"),
        ({"first_block": 0, "stop_block": 9}, "are not blocks of tiny"),
        ({"first_block": 0, "stop_block": 1}, "names blocks it does not hold"),
        ({"first_block": 0, "stop_block": 1, "optimizer_steps": {"0": 2.0}}, "unexpected tensor"),
        ({"step": 7}, "its name says 2"),
        ({"file": "../../etc/passwd"}, "is not step-00000002-<its sha256"),
        ({"written_unix": 10**400}, "not a valid manifest"),
        ({"format": "pickle"}, "format 'pickle'"),
        ({"optimizer_steps": {"1": 2.5, "2": 2.5}}, "optimizer step 2.5"),
        ({"bytes": -1}, "bytes must be an integer"),
    ],
)
def test_a_manifest_that_does_not_fit_its_tensors_is_refused(
    tmp_path: Path, changes: dict[str, object], why: str
) -> None:
    store = CheckpointDir(tmp_path)
    save(store, trained_blocks(1, 3, step=2), 2)
    rewrite_manifest(store, 2, changes)
    with pytest.raises(CheckpointError, match=why):
        store.load(2, MODEL)


def test_non_finite_weights_are_refused(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path)
    blocks = trained_blocks(0, 1, step=1)
    name = next(n for role, n in blocks[0].tensors if role == "param")
    blocks[0].tensors[("param", name)].view(-1)[0] = float("nan")
    save(store, blocks, 1)
    with pytest.raises(CheckpointError, match="not finite"):
        store.load(1, MODEL)
    assert store.latest(MODEL) is None


def test_checkpoints_newer_than_a_new_start_are_set_aside(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path)
    for step in (1, 2, 3):
        save(store, trained_blocks(0, 1, step=step), step)
    steps, folder = store.set_aside_after(1)
    assert steps == [2, 3] and folder is not None and folder.parent == tmp_path / SET_ASIDE_DIR
    assert store.steps() == [1] and store.latest(MODEL) is not None
    aside = CheckpointDir(tmp_path)
    aside.path = folder
    assert aside.steps() == [3, 2] and aside.latest(MODEL) is not None
    assert store.set_aside_after(1) == ([], None)
    # Set aside again later: nothing set aside before is lost.
    save(store, trained_blocks(0, 1, step=5), 5)
    again, second = store.set_aside_after(0)
    assert again == [1, 5] and second is not None and second != folder
    assert aside.steps() == [3, 2] and store.steps() == []


def test_writing_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path)
    save(store, trained_blocks(0, 2, step=2), 2)
    newer = trained_blocks(0, 2, step=2, seed=1)  # e.g. a plan ended here, then a stop
    save(store, newer, 2)
    assert_same(newer, store.load(2, MODEL)[1])
    assert len(list(store.path.glob("*.safetensors"))) == 1


def test_a_failed_write_keeps_the_older_checkpoints_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointDir(tmp_path)
    good = trained_blocks(0, 1, step=1)
    save(store, good, 1)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save(store, trained_blocks(0, 1, step=2), 2)
    monkeypatch.undo()
    assert [p.name for p in store.path.iterdir() if p.name.endswith(".tmp")] == []
    latest = store.latest(MODEL)
    assert latest is not None and latest[0].step == 1
    assert_same(good, latest[1])


# ----- the crash test ------------------------------------------------------------------------
WRITERS = """
import json, os, signal, sys, torch
from pathlib import Path
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.blocks import BlockWeights
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.models import get_model

run = TrainConfig(model="tiny").to_proto("fingerprint")
store = CheckpointDir(Path(sys.argv[1]), keep=2)
shapes = {n: p.shape for n, p in get_model("tiny").build_stage(0, 0, 2)[1].named_parameters()}

def write_until_killed(step, calls_left):
    # The writer SIGKILLs itself just before its N-th file-system call of the kinds a save
    # makes (open, fsync, rename, unlink): every step of a save is a place it can die.
    def killed_after(call):
        def wrapped(*args, **kwargs):
            nonlocal calls_left
            calls_left -= 1
            if calls_left <= 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return call(*args, **kwargs)
        return wrapped

    import builtins
    say = os.write
    builtins.open = killed_after(builtins.open)
    for name in ("fsync", "replace", "unlink"):
        setattr(os, name, killed_after(getattr(os, name)))
    while True:
        step += 1
        # Every value says which step wrote it: a mix of two checkpoints cannot pass for one.
        tensors = {("param", n): torch.full(s, float(step)) for n, s in shapes.items()}
        store.save({1: BlockWeights(1, step, 0.0, tensors)}, step=step, run=run, pipeline=0,
                   stage=0, plan_epoch=1)
        say(1, f"{step}\\n".encode())

# One writer process per line "STEP CALLS", forked from this one (torch imported once): it
# reports how the writer ended and the steps it said it finished.
for line in sys.stdin:
    step, calls = map(int, line.split())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        write_until_killed(step, calls)
    os.close(w)
    with os.fdopen(r, "rb") as said:
        out = said.read().decode()
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(json.dumps({"killed": killed, "status": status, "out": out}), flush=True)
"""


def test_a_writer_killed_anywhere_never_leaves_a_checkpoint_that_loads_wrongly(
    tmp_path: Path,
) -> None:
    """Kill a process that writes checkpoints in a loop at a random point of a save (a SIGKILL
    before its N-th file-system call), many times: the newest checkpoint that loads is always
    whole (every value is its own step), and never older than the last one it finished. The
    writers are forked from one process that imported torch once."""
    store = CheckpointDir(tmp_path, keep=2)
    rng = random.Random(7)
    finished = 0
    with subprocess.Popen(
        [sys.executable, "-c", WRITERS, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as writers:  # fmt: skip
        assert writers.stdin is not None and writers.stdout is not None
        for _ in range(25):
            writers.stdin.write(f"{finished} {rng.randint(1, 40)}\n")
            writers.stdin.flush()
            ended = json.loads(writers.stdout.readline())
            assert ended["killed"], ended
            for line in ended["out"].split():  # what it finished before it died
                finished = int(line)
            step = _latest_whole(store)
            assert step >= finished
            finished = step
        writers.stdin.close()
        assert writers.wait(30) == 0
    leftovers = [p.name for p in store.path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) <= 2  # at most what the last kill interrupted; the next save removes it


def _latest_whole(store: CheckpointDir) -> int:
    """The step of the newest checkpoint that loads, checked to be one write's whole."""
    latest = store.latest(MODEL)
    assert latest is not None
    manifest, blocks = latest
    for t in blocks[1].tensors.values():
        assert bool((t == manifest.step).all()), "a checkpoint mixes two writes"
    return manifest.step


# ----- where a run resumes -------------------------------------------------------------------
def offer(step: int, first: int, stop: int, key: str | None = None) -> pb.CheckpointOffer:
    return pb.CheckpointOffer(
        step=step, first_block=first, stop_block=stop, run_key=key or run_key(RUN)
    )


def caps(*offers: pb.CheckpointOffer) -> pb.Capabilities:
    return pb.Capabilities(block_s=[0.1] * MODEL.num_blocks(), checkpoints=offers)


MEMBERS = [Member(node_id=f"n{i}", address=f"127.0.0.1:{5000 + i}") for i in range(3)]


def point(capabilities: dict[str, pb.Capabilities], steps: int = 100) -> tuple[int, list[str]]:
    offers = {node: c.checkpoints for node, c in capabilities.items()}
    p = resume_point(MEMBERS, offers, run_key=run_key(RUN), num_blocks=4, steps=steps)
    return p.step, sorted(h.node_id for h in p.holders)


def test_a_run_resumes_at_the_newest_step_every_block_has() -> None:
    got = point({
        "n0": caps(offer(30, 0, 2), offer(20, 0, 2), offer(10, 0, 2)),
        "n1": caps(offer(30, 2, 3), offer(20, 2, 3)),
        "n2": caps(offer(25, 3, 4), offer(20, 3, 4)),  # its newest is a stop checkpoint
    })  # fmt: skip
    assert got == (20, ["n0", "n1", "n2"])


def test_checkpoints_of_another_run_or_past_its_end_or_partial_do_not_count() -> None:
    assert point({"n0": caps(offer(30, 0, 4, key="other"))}) == (0, [])
    assert point({"n0": caps(offer(100, 0, 4), offer(50, 0, 4))}) == (50, ["n0"])
    assert point({"n0": caps(offer(30, 0, 2)), "n1": caps(offer(30, 2, 3))}) == (0, [])
    assert point({}) == (0, [])
    # Replicas: every holder is listed, so a gaining node may fetch from its own pipeline.
    assert point({"n0": caps(offer(9, 0, 4)), "n1": caps(offer(9, 0, 4))}) == (9, ["n0", "n1"])


def test_offers_are_checked_like_every_capability() -> None:
    check_capabilities(caps(offer(1, 0, 4)), 4)
    too_far = pb.CheckpointOffer(step=1, first_block=0, stop_block=4, stage=4)
    for bad in (offer(1, 2, 2), offer(1, 0, 5), offer(1, 3, 1), offer(1, 0, 1, key="k" * 65),
                too_far):  # fmt: skip
        with pytest.raises(ConfigError, match="checkpoint offer"):
            check_capabilities(caps(bad), 4)
    with pytest.raises(ConfigError, match="at most"):
        check_capabilities(caps(*[offer(i, 0, 4) for i in range(65)]), 4)
