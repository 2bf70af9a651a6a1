"""Evaluations on held-out data across node processes (`--eval-every`): a 3-node swarm
evaluates exactly what one process evaluates, and what a plain loop computes from the trained
weights; a running swarm shows its evaluations in the demo's progress lines, `status` (of a
node and of the swarm), `/metrics` and the page's data."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from ravnest_node.checkpoint.export import blocks_at
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig

from .conftest import NODE_ENV, Procs, node_status, poll_until, ravnest, require_module
from .test_chat_data import conversation, write_jsonl
from .test_web import _get, scrape, value

require_module("transformers")
from .test_llm_finetune import make_qwen3  # noqa: E402 - needs transformers

SYNC = ("--seed", "0", "--max-staleness", "0", "--codec", "none", "--threads", "1")


def _model(root: Path) -> str:
    """A tiny Qwen3 with its chat template, and chat data of which a quarter is held out."""
    make_qwen3(root / "qwen3")
    data = write_jsonl(root / "chat.jsonl", [{"messages": conversation(k)} for k in range(24)])
    return f"hf:{root / 'qwen3'},seq=64,lora=8,data={data},eval=0.25"


def _plain_eval(name: str, state_dirs: list[Path], run: TrainConfig) -> tuple[float, float]:
    """The evaluation a plain loop computes (the mean over the held-out batches' microbatches
    of the model's loss), with the weights the run's checkpoints hold at its end, and with the
    initial ones."""
    model = get_model(name)
    chain = torch.nn.Sequential(*model.build_blocks(run.seed))
    data = model.eval_dataset(seed=run.seed)

    def mean_loss() -> float:
        losses = []
        with torch.no_grad():
            for b in range(run.eval_batches):
                x, y = data.batch(b, run.batch_size)
                for i in range(run.microbatches):
                    rows = slice(i * run.microbatch_size, (i + 1) * run.microbatch_size)
                    losses.append(model.loss(chain(x[rows]), y[rows]).item())
        return sum(losses) / len(losses)

    initial = mean_loss()
    step, blocks = blocks_at(state_dirs, model)
    assert step == run.steps
    for index, weights in blocks.items():
        params = dict(chain[index].named_parameters())
        for (role, pname), tensor in weights.tensors.items():
            if role == "param":
                params[pname].data.copy_(tensor)
    return mean_loss(), initial


def test_three_nodes_evaluate_as_one_and_as_a_plain_loop(tmp_path: Path) -> None:
    name = _model(tmp_path)
    args = (*SYNC, "--model", name, "--steps", "10", "--lr", "3e-2", "--eval-every", "4")
    procs = {}
    for nodes in ("1", "3"):
        command = ravnest("demo", "--work-dir", str(tmp_path / nodes), "--summary-json",
                          str(tmp_path / f"{nodes}.json"), "--nodes", nodes, *args)  # fmt: skip
        procs[nodes] = subprocess.Popen(
            command, env=NODE_ENV, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    out = {}
    for nodes, proc in procs.items():
        out[nodes], _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[nodes]
    one, three = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("1", "3"))
    # After steps 4 and 8 and the run's last: the same evaluations, to the bit.
    assert [s for s, _ in three["eval_history"]] == [4, 8, 10]
    assert three["eval_history"] == one["eval_history"]
    assert three["final_eval_loss"] == three["eval_history"][-1][1]
    assert all(stage["evals_lost"] == 0 for stage in three["stages"])
    # The progress lines show the newest evaluation from the step after it.
    lines = [line for line in out["3"].splitlines() if line.startswith("step ")]
    first = f"eval {three['eval_history'][0][1]:7.4f} (step 4)"
    assert "eval" not in lines[3] and first in lines[4]
    # What a plain loop computes from the trained weights, not from the initial ones.
    run = TrainConfig(model=name, steps=10, eval_every=4)
    trained, initial = _plain_eval(name, sorted((tmp_path / "3").glob("node-*")), run)
    assert math.isclose(three["final_eval_loss"], trained, rel_tol=1e-5)
    assert three["final_eval_loss"] < 0.9 * initial


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Three nodes fine-tuning the tiny Qwen3 for long, evaluating every 3 steps."""
    procs = Procs()
    root = tmp_path_factory.mktemp("eval")
    common = ("--metrics-port", "0", "--swarm-name", "evals")
    try:
        _, coordinator = procs.start_node(
            root / "n0", "--swarm-size", "3", "--model", _model(root), "--steps", "3000",
            "--eval-every", "3", *common,
        )  # fmt: skip
        others = [procs.start_node(root / f"n{i}", "--join", coordinator["address"],
                                   "--model-dir", str(root), *common)[1]
                  for i in (1, 2)]  # fmt: skip
        yield [coordinator, *others]
    finally:
        procs.cleanup()


def test_a_running_swarm_shows_its_evaluations(swarm: Any) -> None:
    nodes = swarm
    poll_until(lambda: any(node_status(n["address"]).eval_step >= 6 for n in nodes), 120)
    statuses = [node_status(n["address"]) for n in nodes]
    last = next(i for i, s in enumerate(statuses) if s.eval_step)
    assert statuses[last].stage == 2 and statuses[last].eval_step % 3 == 0
    assert all(s.eval_step == 0 for i, s in enumerate(statuses) if i != last)  # the last only
    shown = subprocess.run(ravnest("status", nodes[last]["address"]), env=NODE_ENV, check=True,
                           capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    assert "evaluation on held-out data after step " in shown
    series = scrape(nodes[last]["metrics"])
    assert math.isfinite(value(series, "ravnest_eval_loss", stage="2"))
    assert value(series, "ravnest_eval_step", stage="2") % 3 == 0
    page = json.loads(_get(f"http://{nodes[0]['metrics']}/swarm.json"))
    assert len(page["eval_loss"]) >= 2 and [s % 3 for s, _ in page["eval_loss"]] == [0] * len(
        page["eval_loss"]
    )
    swarm_shown = subprocess.run(
        ravnest("status", "--swarm", "evals", "--peer", nodes[0]["address"], "--mdns-interface",
                "127.0.0.1", "--timeout-s", "5"),
        env=NODE_ENV, check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert ", eval loss " in swarm_shown
