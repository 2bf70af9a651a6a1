"""`ravnest-node bench` end to end, on the tiny model: real node processes over emulated links."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.models.base import shapes_only
from ravnest_node.models.llama_bench import LlamaBench, LlamaBenchConfig
from ravnest_node.transport.credentials import create_swarm

from .conftest import NODE_ENV, ravnest, require_netns


def _bench(tmp_path: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    jsonl = tmp_path / "out.jsonl"
    result = subprocess.run(
        # fp32 and synchronous: these tests check the harness's accounting to the byte.
        ravnest("bench", "--model", "tiny", "--steps", "4", "--scenario", "lan",
                "--codec", "none", "--max-staleness", "0",
                "--jsonl", str(jsonl), "--work-dir", str(tmp_path / "work"), *args),
        env=NODE_ENV, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return records, result.stdout


def _suite(tmp_path: Path, suite: str, *args: str) -> tuple[list[dict[str, Any]], str]:
    """`bench SUITE --quick ARGS` on the tiny model: its JSON lines and what it printed."""
    jsonl = tmp_path / f"{suite}.jsonl"
    result = subprocess.run(
        ravnest("bench", suite, "--model", "tiny", "--quick", "--jsonl", str(jsonl),
                "--work-dir", str(tmp_path / "work"), *args),
        env=NODE_ENV, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in jsonl.read_text().splitlines()], result.stdout


def _same_training(a: dict[str, Any], b: dict[str, Any], rel: float = 1e-5) -> None:
    for x, y in zip(a["loss_history"], b["loss_history"], strict=True):
        assert math.isclose(x, y, rel_tol=rel), (a["system"], b["system"], x, y)


@pytest.mark.slow
def test_bench_over_relays(tmp_path: Path) -> None:
    records, out = _bench(tmp_path, "--emulation", "relay")
    by_system = {r["system"]: r for r in records}
    assert list(by_system) == ["compute-bound", "naive", "ours", "torch-pipelining", "hivemind"]
    assert "skipped" in by_system["torch-pipelining"] and "skipped" in by_system["hivemind"]
    assert "skipped: hivemind needs its p2pd daemon" in out  # reported, not dropped
    cb, naive, ours = by_system["compute-bound"], by_system["naive"], by_system["ours"]
    # Same model, data, seed and samples: the three train identically.
    _same_training(naive, cb)
    _same_training(ours, cb)
    assert cb["bytes_on_wire"] == 0
    # The pipelines compared have the workload's shape, one stage per node (--stages 3),
    # whatever the planner would make of the links.
    assert len(naive["stage_compute_s"]) == len(ours["stage_compute_s"]) == 3
    assert len(cb["stage_compute_s"]) == 1
    # Counted in the transport: tiny's boundaries carry 4 x 32 x 64 x 4 bytes per microbatch,
    # forward and back, over 2 boundaries, 4 microbatches, 4 steps; plus targets and headers.
    payload = 4 * 32 * 64 * 4 * 2 * 2 * 4 * 4
    assert payload < ours["bytes_on_wire"] < payload * 1.05
    # Both send fp32 activations; ours lz4-compresses the targets that travel with them.
    assert payload < ours["bytes_on_wire"] < naive["bytes_on_wire"]
    fields = "wall_s samples_per_s bytes_per_sample initial_loss final_loss loss_at_equal_samples"
    for field in (*fields.split(), "codec", "max_staleness", "replicas", "link"):
        assert field in ours, field
    assert ours["link"]["emulation"] == "relay"
    # Each run's final model, from its nodes' last checkpoints, on the same held-out windows:
    # the same model, so the same loss, and no gap to compute-bound's.
    for r in (cb, naive, ours):
        assert r["held_out_samples"] == 256
        assert math.isclose(r["held_out_loss"], cb["held_out_loss"], rel_tol=1e-4), r["system"]
        assert abs(r["held_out_gap"]) < 1e-4
    assert ours["held_out_loss"] < ours["initial_loss"]
    assert f"held-out {ours['held_out_loss']:.3f}" in out
    assert ours["efficiency"] is None  # relays pace connections, not hosts: no uplink bound
    assert (tmp_path / "out.md").read_text().count("| lan |") == 5
    assert (tmp_path / "out.png").stat().st_size > 10_000


@pytest.mark.slow
def test_bench_rounds_alternate_the_systems(tmp_path: Path) -> None:
    records, out = _bench(tmp_path, "--emulation", "relay", "--systems", "compute-bound,ours",
                          "--rounds", "2")  # fmt: skip
    assert [(r["round"], r["system"]) for r in records] == [
        (0, "compute-bound"), (0, "ours"), (1, "compute-bound"), (1, "ours"),
    ]  # fmt: skip
    assert "round 2 of 2" in out
    # Synchronous fp32: every round trains the same model as compute-bound.
    for r in records:
        assert abs(r["held_out_gap"]) < 1e-4
        assert r["log"].endswith(f"round-{r['round']}/{r['system']}")
    table = (tmp_path / "out.md").read_text()
    assert table.count("| lan |") == 4 + 1  # the runs, then ours over the rounds
    assert "| lan | ours | 2 |" in table


@pytest.mark.slow
def test_bench_in_namespaces_with_torch_pipelining(tmp_path: Path) -> None:
    require_netns()
    records, _ = _bench(tmp_path, "--emulation", "netns", "--systems", "ours,torch-pipelining")
    ours, torch_pp = records
    assert ours["link"]["emulation"] == "netns"
    # The interface counters see our frames plus TCP/IP and gRPC framing: a little more.
    assert ours["bytes_on_wire"] < ours["link_bytes"] < ours["bytes_on_wire"] * 1.25
    assert torch_pp["system"] == "torch-pipelining" and torch_pp["bytes_on_wire"] > 0
    for r in (ours, torch_pp):  # the same measure of each host's uplink for both systems
        assert len(r["node_link_bytes"]) == 3 and 0 < r["efficiency"] <= 1.5
    # PyTorch's pipeline on the same blocks, data and optimizer trains the same model.
    _same_training(torch_pp, ours, rel=1e-4)
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "rvb" not in leftovers


@pytest.mark.slow
def test_bench_codecs(tmp_path: Path) -> None:
    rows, _ = _suite(tmp_path, "codecs")
    micro = {(r["role"], r["codec"]): r for r in rows if r["table"] == "micro"}
    assert micro[("activation", "int8-block")]["bits_per_element"] <= 8.1
    assert micro[("activation", "none")]["relative_error"] == 0
    assert ("activation", "topk-ef") not in micro  # refused for activations
    conv = {r["codec"]: r for r in rows if r["table"] == "convergence"}
    assert set(conv) == {"none/none", "int8-block/int8-block", "int4-block/int4-block"}
    assert conv["none/none"]["loss_gap"] == 0
    # Quantised frames are measured, not estimated: int8 moves about a quarter of fp32's bytes.
    assert 3.5 < conv["int8-block/int8-block"]["bytes_ratio_vs_fp32"] < 4.1
    assert abs(conv["int8-block/int8-block"]["loss_gap"]) < 0.01
    assert (tmp_path / "codecs.md").read_text().count("|") > 40
    # The multi-epoch table: aq-delta sends a sample's first visit whole, then 2-bit deltas.
    epochs = {r["codec"]: r for r in rows if r["table"] == "epochs"}
    assert set(epochs) == {"none/none", "aq-delta/none", "aq-delta2/none"}  # --quick's
    assert epochs["none/none"]["epochs"] == 6
    aq2, aq4 = epochs["aq-delta2/none"], epochs["aq-delta/none"]
    # 6 visits: (32 + 5 x 2.5) / 6 = 7.4 bits per element on average, 4.3x fewer than fp32.
    assert 3.5 < aq2["activation_ratio_vs_fp32"] < 5 and aq4["activation_ratio_vs_fp32"] > 3
    assert abs(aq2["loss_gap"]) < 0.05


@pytest.mark.slow
def test_bench_replicas(tmp_path: Path) -> None:
    # In a protected swarm: every suite passes --swarm-dir on to its nodes.
    create_swarm("bench", tmp_path / "swarm")
    (one, double, two), stdout = _suite(
        tmp_path, "replicas", "--swarm-dir", str(tmp_path / "swarm")
    )
    assert (one["pipelines"], double["pipelines"], two["pipelines"]) == (1, 1, 2)
    assert one["samples"] == double["samples"] == two["samples"]
    assert one["steps"] == 2 * two["steps"] == 2 * double["steps"]
    assert one["averaging_rounds"] == 0 and two["averaging_rounds"] == two["steps"] // 4
    assert two["averaging_rounds_incomplete"] == 0
    # Measured averaging bytes against the two references they are compared with.
    assert 0 < two["averaging_bytes_per_sample"] < two["hivemind_bytes_per_sample"]
    assert two["hivemind_bytes_per_sample"] < two["fp32_every_step_bytes_per_sample"]
    assert 0 <= two["averaging_wait_share"] < 1
    assert "loss gap, two pipelines vs one pipeline" in stdout
    logs = [p.read_text() for p in (tmp_path / "work").glob("*/node-*/node.log")]
    assert len(logs) == 3 + 3 + 6
    assert all("swarm 'bench' is protected: mutual TLS with every peer" in log for log in logs)


def test_bench_on_a_device(tmp_path: Path) -> None:
    # `--device cpu`: every node process and the compute-bound baseline on it, said in the
    # records and the header; the torch-pipelining baseline (gloo) is CPU-only, so it runs
    # here or is skipped for the links, never for the device.
    records, out = _bench(tmp_path, "--emulation", "relay", "--device", "cpu",
                          "--systems", "compute-bound,ours")  # fmt: skip
    assert [r["system"] for r in records] == ["compute-bound", "ours"]
    assert all(r["device"] == "cpu" and r["precision"] == "fp32" for r in records)
    assert "samples per system on cpu;" in out
    _same_training(records[1], records[0])


def test_the_gpu_benchmark_model_is_llama_shaped_and_trains_on_bytes() -> None:
    model = get_model("llama-300m")
    assert model.num_blocks() == 26 and model.output_spec(5, 2).shape == (2, 256, 1024)
    with shapes_only():
        params = sum(p.numel() for b in model.build_blocks(0) for p in b.parameters())
    assert 250e6 < params < 300e6
    # The same blocks at a small size: a microbatch through all of them, a loss, a backward.
    small = LlamaBench(LlamaBenchConfig(hidden=32, layers=3, heads=4, kv_heads=2, ffn=64,
                                        seq_len=16))  # fmt: skip
    blocks = small.build_blocks(seed=1)
    assert blocks[1].k_proj.out_features == 16  # grouped-query: 2 key/value heads of 8
    x, y = small.dataset(seed=0).batch(0, 2)
    h = x
    for i, block in enumerate(blocks):
        h = block(h)
        assert h.shape == small.output_spec(i, 2).shape
    loss = small.loss(h, y)
    loss.backward()
    assert math.isfinite(loss.item()) and blocks[0].embed_tokens.weight.grad is not None
    costs = small.block_costs()
    assert len(costs) == 5 and costs[1] == costs[2] > costs[0] > 0
    timing = small.timing_blocks()
    assert len(timing) == 5 and timing[1] is timing[3]  # one layer, timed once
    with pytest.raises(ConfigError, match="multiple of kv_heads"):
        LlamaBenchConfig(hidden=32, layers=1, heads=4, kv_heads=3, ffn=8, seq_len=4)


@pytest.mark.slow
def test_bench_on_the_mobile_link_estimates_naive(tmp_path: Path) -> None:
    # 2 Mbit/s, 80 ms: naive runs 3 steps and is extrapolated, torch-pipelining is skipped;
    # ours (auto, one warm-up step) reports its codecs, its phases and its bytes against naive's.
    require_netns()
    records, out = _bench(tmp_path, "--emulation", "netns", "--scenario", "mobile",
                          "--codec", "auto", "--max-staleness", "1",
                          "--staleness-warmup-steps", "2",
                          "--systems", "naive,ours,torch-pipelining")  # fmt: skip
    naive, ours, torch_pp = records
    assert naive["steps"] == 3 and naive["estimated_steps"] == 4 and "estimated" in naive
    assert "held_out_loss" not in naive and 0 < ours["held_out_loss"] < 10  # naive ran 3 steps
    assert "too slow" in torch_pp["skipped"]
    assert ours["link"]["rate_mbit"] == 2 and ours["gpu_like"] == 1
    assert ours["fewer_boundary_bytes_than_naive"] >= 1
    assert ours["warmup_step_s"] > 0 and ours["async_step_s"] > 0
    assert [s["stage"] for s in ours["codec_frames"]] == [0, 1, 2]
    assert sum(ours["codec_frames"][0]["activation"].values()) == 4 * 4  # steps x microbatches
    assert "est. (3 steps run)" in (tmp_path / "out.md").read_text()
    assert "(est.)" in out
