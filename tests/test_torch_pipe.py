"""The torch.distributed.pipelining baseline: it runs, and it trains exactly what we train."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ravnest_node.bench import torch_pipe
from ravnest_node.bench.scenario_links import free_port
from ravnest_node.bench.torch_pipe import RankConfig, build_schedule, command, read_results
from ravnest_node.data import StdlibBytes
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from tests.conftest import Procs

MODEL, STEPS, BATCH, MICROBATCHES, LR, SEED = "tiny", 6, 16, 4, 3e-4, 0


def our_losses(
    model_name: str, steps: int, batch_size: int, microbatches: int, lr: float, seed: int
) -> list[float]:
    """Our pipeline's training, in one process (pipeline/stage.py): per microbatch
    backward(loss / microbatches), then AdamW(lr, weight_decay) step; step loss = their sum."""
    weight_decay = TrainConfig().weight_decay
    model = get_model(model_name)
    net = torch.nn.Sequential(*model.build_blocks(seed))
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=seed)
    mb = batch_size // microbatches
    history = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run; summation order can depend on it
    try:
        for step in range(steps):
            x, y = data.batch(step, batch_size)
            step_loss = 0.0
            for i in range(microbatches):
                part = slice(i * mb, (i + 1) * mb)
                loss = model.loss(net(x[part]), y[part]) / microbatches
                torch.autograd.backward(loss)
                step_loss += loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append(step_loss)
    finally:
        torch.set_num_threads(threads)
    return history


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_three_ranks_train_what_we_train(
    procs: Procs, tmp_path: Path, schedule: torch_pipe.ScheduleName
) -> None:
    world = 3
    master = f"127.0.0.1:{free_port()}"
    ifname = "lo" if Path("/sys/class/net/lo/statistics/tx_bytes").exists() else None
    outs = [tmp_path / f"rank{r}.jsonl" for r in range(world)]
    errs = [tmp_path / f"rank{r}.err" for r in range(world)]
    ranks = []
    for r in range(world):
        argv = command(
            r, world, master, model=MODEL, steps=STEPS, batch_size=BATCH,
            microbatches=MICROBATCHES, lr=LR, seed=SEED, threads=1, out=outs[r],
            ifname=ifname, schedule=schedule,
        )  # fmt: skip
        with errs[r].open("wb") as err:
            ranks.append(procs.popen(argv, stderr=err))

    deadline = time.monotonic() + 60
    for r, proc in enumerate(ranks):
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {r} still running after 60 s:\n{errs[r].read_text()}")
    for r, proc in enumerate(ranks):
        assert proc.returncode == 0, f"rank {r} exited {proc.returncode}:\n{errs[r].read_text()}"
        assert proc.stdout is not None
        done = json.loads(proc.stdout.read().decode().strip().splitlines()[-1])
        assert done["event"] == "done" and done["rank"] == r and done["steps"] == STEPS

    results = read_results(outs)
    losses = results["loss_history"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert results["t_history"] == sorted(results["t_history"])
    assert results["wall_s"] == results["t_history"][-1] > 0
    if ifname is not None:
        sent = results["tx_bytes_history"]
        assert sent is not None and len(sent) == STEPS and sent[-1] > 0

    # The same model, data, seed and optimizer as our own pipeline: the same losses.
    expected = our_losses(MODEL, STEPS, BATCH, MICROBATCHES, LR, SEED)
    assert losses == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_schedule_gradients_are_those_of_the_mean_microbatch_loss(
    schedule: torch_pipe.ScheduleName,
) -> None:
    """AdamW hardly sees a constant factor on the gradients, so the loss histories above would
    match even with the gradients scaled wrongly; check the gradients themselves, on a pipeline
    of one stage in this process."""
    model = get_model(MODEL)
    train = TrainConfig(model=MODEL, batch_size=BATCH, microbatches=MICROBATCHES, seed=SEED)
    x, y = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=SEED).batch(0, BATCH)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        module, runner = build_schedule(model, train, 0, 1, schedule)
        losses: list[torch.Tensor] = []
        runner.step(x, target=y, losses=losses, return_outputs=False)
    finally:
        dist.destroy_process_group()

    reference = torch.nn.Sequential(*model.build_blocks(SEED))
    mb = BATCH // MICROBATCHES
    step_loss = 0.0
    for i in range(MICROBATCHES):
        part = slice(i * mb, (i + 1) * mb)
        loss = model.loss(reference(x[part]), y[part]) / MICROBATCHES
        torch.autograd.backward(loss)
        step_loss += loss.item()
    assert math.fsum(v.item() for v in losses) / len(losses) == pytest.approx(step_loss, rel=1e-6)
    for (name, ours), theirs in zip(reference.named_parameters(), module.parameters(), strict=True):
        assert ours.grad is not None and theirs.grad is not None
        torch.testing.assert_close(theirs.grad, ours.grad, rtol=1e-5, atol=1e-8, msg=name)


def test_command_round_trips_through_the_parser(tmp_path: Path) -> None:
    argv = command(
        2, 3, "10.213.0.1:29500", model="bench-small", steps=10, batch_size=16,
        microbatches=4, lr=3e-4, seed=7, threads=2, out=tmp_path / "r.jsonl", ifname="veth2",
        schedule="gpipe",
    )  # fmt: skip
    assert argv[1:3] == ["-m", "ravnest_node.bench.torch_pipe"]
    args = torch_pipe._parser().parse_args(argv[3:])
    assert (args.rank, args.world_size, args.master) == (2, 3, "10.213.0.1:29500")
    assert (args.model, args.steps, args.batch_size, args.microbatches) == (
        "bench-small",
        10,
        16,
        4,
    )
    assert (args.lr, args.seed, args.threads, args.ifname) == (3e-4, 7, 2, "veth2")
    assert (args.out, args.schedule) == (tmp_path / "r.jsonl", "gpipe")


def test_read_results_merges_ranks(tmp_path: Path) -> None:
    rows: dict[int, list[tuple[float, float | None, int]]] = {
        0: [(0.5, None, 100), (1.0, None, 250)],
        1: [(0.6, 5.5, 40), (1.2, 5.0, 90)],
    }
    paths = []
    for rank, steps in rows.items():
        path = tmp_path / f"r{rank}.jsonl"
        lines = [
            {"rank": rank, "step": i + 1, "t": t, "loss": loss, "tx_bytes": tx}
            for i, (t, loss, tx) in enumerate(steps)
        ]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(path)
    assert read_results(paths) == {
        "loss_history": [5.5, 5.0],
        "t_history": [0.6, 1.2],
        "tx_bytes_history": [140, 340],
        "wall_s": 1.2,
    }
    # A rank that stopped early is not a complete run.
    paths[0].write_text(paths[0].read_text().splitlines()[0] + "\n")
    with pytest.raises(ValueError, match=r"r0\.jsonl: 1 steps, but another rank has 2"):
        read_results(paths)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"rank": 3}, "rank=3"),
        ({"world_size": 5}, "at most 4 stages"),
        ({"master": "localhost"}, "HOST:PORT"),
        ({"train": TrainConfig(model="tiny", microbatches=2, batch_size=16)}, "Schedule1F1B"),
        ({"ifname": "no-such-if0"}, "no-such-if0"),
    ],
)
def test_rank_config_says_what_is_wrong(
    tmp_path: Path, changes: dict[str, object], needle: str
) -> None:
    fields: dict[str, object] = {
        "rank": 0,
        "world_size": 3,
        "master": "127.0.0.1:29500",
        "train": TrainConfig(model="tiny"),
        "out": tmp_path / "r.jsonl",
    }
    with pytest.raises(ConfigError, match=needle):
        RankConfig(**(fields | changes))  # type: ignore[arg-type]
