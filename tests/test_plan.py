"""`ravnest-node plan` and its cost model (coordination/planning/estimate.py and shapes.py):
pure parts, the CLI's parsing and exit statuses, and one real `python -m ravnest_node plan
--json` process."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ravnest_node.cli.main import main
from ravnest_node.cli.plan import (
    GIB,
    GPUS,
    MFU,
    add_arguments,
    parse_link,
    parse_nodes,
    pretrained_shape,
    rate_text,
    run_plan,
)
from ravnest_node.compression.codecs import INT4_BLOCK, INT8_BLOCK
from ravnest_node.coordination.planning.estimate import (
    DoesNotFit,
    NodeGroup,
    SharedHost,
    Training,
    codec_bits,
    estimate,
)
from ravnest_node.coordination.planning.placement import Link
from ravnest_node.coordination.planning.shapes import LLAMA_PRESETS, LlamaConfig, model_shape
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.models.pretrained import model as pretrained_model

from .test_pretrained import make_bert, make_llama

LORA_INT8 = Training(mode="lora", base="int8")


def rtx4090s(count: int = 16) -> list[NodeGroup]:
    return parse_nodes(f"{count}xrtx4090")


# ---- shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "published"), [("llama-8b", 8.03e9), ("llama-70b", 70.6e9)])
def test_llama_presets_have_their_published_parameter_counts(name: str, published: float) -> None:
    shape = LLAMA_PRESETS[name].shape(name)
    assert shape.params == pytest.approx(published, rel=0.005)
    assert len(shape.blocks) == LLAMA_PRESETS[name].layers + 2
    assert shape.blocks[1].boundary_elements == 2048 * LLAMA_PRESETS[name].hidden


def test_a_registered_model_is_measured_from_its_blocks() -> None:
    model = get_model("bench-small")
    shape = model_shape(model)
    assert shape.params == model.num_parameters()
    assert shape.tokens_per_sample == 128
    assert [b.forward_flops for b in shape.blocks] == model.block_costs()
    assert shape.blocks[1].boundary_elements == 128 * 256
    # A layer keeps several [T, d] tensors and the MLP's [T, 4d] ones for its backward.
    assert 5 * 128 * 256 * 4 < shape.blocks[1].saved_bytes < 60 * 128 * 256 * 4
    assert shape.blocks[-1].transient and not shape.blocks[1].transient
    assert shape.activation_dtype == torch.float32


def test_llama_shape_is_validated() -> None:
    with pytest.raises(ConfigError, match="must divide"):
        LlamaConfig(layers=2, hidden=100, heads=3, kv_heads=1, mlp_hidden=256, vocab=10)
    with pytest.raises(ConfigError, match="positive integer"):
        LlamaConfig(layers=0, hidden=64, heads=2, kv_heads=1, mlp_hidden=256, vocab=10)


# ---- codecs -----------------------------------------------------------------------------------


def test_codec_sizes_come_from_the_codecs() -> None:
    n = 4 * 128 * 256
    assert codec_bits("none", n, torch.float32) == 32
    assert codec_bits("none", n, torch.bfloat16) == 16
    assert codec_bits("bf16", n, torch.float32) == 16
    assert codec_bits("int8-block", n, torch.float32) == pytest.approx(8 + 32 / INT8_BLOCK)
    assert codec_bits("int4-block", n, torch.float32) == pytest.approx(4 + 32 / INT4_BLOCK)


# ---- parsing ----------------------------------------------------------------------------------


def test_nodes_by_memory_gpu_name_and_groups() -> None:
    (plain,) = parse_nodes("16x24gb")
    assert (plain.count, plain.memory_bytes) == (16, 24 * GIB)
    assert plain.flops_per_s == pytest.approx(GPUS["rtx3090"].bf16_tflops * 1e12 * MFU)
    assert "assumed" in plain.label
    (named,) = parse_nodes("16xrtx4090", mfu=0.5)
    assert named.flops_per_s == pytest.approx(165.2e12 * 0.5)
    fast, small = parse_nodes("8x24gb@165, 8x12GiB")
    assert (fast.count, fast.flops_per_s) == (8, pytest.approx(165e12 * MFU))
    assert small.memory_bytes == 12 * GIB
    assert parse_nodes("h100")[0].count == 1


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("16xrtx9999", "unknown GPU"),
        ("16x24", "unknown GPU"),
        ("sixteen", "unknown GPU"),
        ("16x24gb,", "is not COUNTx"),
        ("0x24gb", "must be positive"),
        ("4x24gb@0", "must be positive"),
    ],
)
def test_bad_nodes_are_refused_with_the_reason(spec: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_nodes(spec)


def test_links() -> None:
    assert parse_link("1gbit") == Link(1e9, 0.0)
    assert parse_link("100mbit") == Link(1e8, 0.0)
    assert parse_link("50mbit,20ms") == Link(5e7, 0.02)
    assert parse_link("10 Mbps, 0.1s") == Link(1e7, 0.1)
    for bad in ("fast", "100mb", "1gbit,soon", "0mbit"):
        with pytest.raises(ConfigError, match="--link"):
            parse_link(bad)


def test_rates_read_as_people_write_them() -> None:
    """The demo's summary and `plan` print rates alike; a link between two nodes on one machine
    (a probe no slower than an empty one: 1 MiB in 1 µs) is not printed as 8,388,608 Mbit/s."""
    assert [rate_text(b) for b in (50e6, 584.3e6, 1277e6, 2.5e6, 900.0)] == [
        "50 Mbit/s", "584.3 Mbit/s", "1.277 Gbit/s", "2.5 Mbit/s", "900 bit/s"
    ]  # fmt: skip
    assert rate_text(2**20 * 8 / 1e-6) == "over 1 Tbit/s"
    assert rate_text(float("inf")) == "unlimited"
    assert rate_text(999.96e6) == "1 Gbit/s"  # rounded before the unit is chosen


# ---- the estimate -----------------------------------------------------------------------------


def test_llama_70b_full_does_not_fit_sixteen_24gb_gpus_and_says_by_how_much() -> None:
    shape = LLAMA_PRESETS["llama-70b"].shape("llama-70b")
    with pytest.raises(DoesNotFit, match=r"short by [\d,.]+ GiB"):
        estimate(shape, parse_nodes("16x24gb"), Link(1e9), Training(mode="full"))


def test_llama_70b_lora_int8_fits_and_is_compute_bound_at_1gbit() -> None:
    shape = LLAMA_PRESETS["llama-70b"].shape("llama-70b")
    found = estimate(shape, rtx4090s(), Link(1e9), LORA_INT8)
    blocks = [(s.first_block, s.stop_block) for s in found.stages]
    assert blocks[0][0] == 0 and blocks[-1][1] == len(shape.blocks)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    for stage in found.stages:
        assert stage.memory["total"] <= stage.memory["usable"]
    assert found.bottleneck.startswith("compute")
    assert found.codec == "none"  # a bf16 activation fits in half the compute at 1 Gbit/s
    # The step is the slowest stage: its forward FLOPs x (2 for LoRA + 1 recomputed).
    slowest = max(stage.compute_s for stage in found.stages)
    assert found.samples_per_s == pytest.approx(LORA_INT8.microbatch / slowest)


def test_at_100mbit_auto_compresses_and_an_uncompressed_link_is_the_bottleneck() -> None:
    shape = LLAMA_PRESETS["llama-70b"].shape("llama-70b")
    auto = estimate(shape, rtx4090s(), Link(1e8), LORA_INT8)
    assert set(auto.auto_choices) == {"int4-block"}
    assert auto.codec == "int4-block"
    raw = estimate(shape, rtx4090s(), Link(1e8), LORA_INT8, codec="none")
    assert "link" in raw.bottleneck
    assert raw.samples_per_s < auto.samples_per_s
    # Bytes per step scale with the codec's bits; a link microbatch is bytes x 8 / bandwidth.
    rows = auto.links
    assert rows["int8-block"]["bytes_per_step_each_way"] == pytest.approx(
        rows["none"]["bytes_per_step_each_way"] * (8 + 32 / INT8_BLOCK) / 16
    )
    per_mb = rows["none"]["bytes_per_step_each_way"] / LORA_INT8.microbatches
    assert rows["none"]["link_s_per_microbatch"] == pytest.approx(per_mb * 8 / 1e8)


def test_an_int8_base_holds_less_than_a_bf16_one() -> None:
    shape = LLAMA_PRESETS["llama-8b"].shape("llama-8b")
    bf16 = estimate(shape, rtx4090s(3), Link(1e9), Training(mode="lora", base="bf16"))
    int8 = estimate(shape, rtx4090s(3), Link(1e9), LORA_INT8)
    weights = [sum(s.memory["weights"] for s in e.stages) for e in (bf16, int8)]
    # The linear layers' matrices halve; the embedding table and the vectors stay fp32.
    matrices = sum(b.matrix_params for b in shape.blocks)
    assert weights[0] - weights[1] == pytest.approx(matrices, rel=0.01)


def test_recompute_only_when_needed_unless_asked() -> None:
    shape = LLAMA_PRESETS["llama-8b"].shape("llama-8b")
    roomy = estimate(shape, parse_nodes("16xa100-80gb"), Link(1e9), LORA_INT8)
    assert not roomy.recompute
    with pytest.raises(DoesNotFit):
        estimate(shape, rtx4090s(2), Link(1e9), Training(mode="lora", recompute="off"))
    forced = estimate(
        shape,
        parse_nodes("16xa100-80gb"),
        Link(1e9),
        Training(mode="lora", base="int8", recompute="on"),
    )
    assert forced.recompute and forced.samples_per_s < roomy.samples_per_s


def test_a_shared_host_bounds_the_step_by_its_cores() -> None:
    shape = model_shape(get_model("tiny"))
    group = NodeGroup(count=3, memory_bytes=2**30, flops_per_s=1e9, label="cpu")
    alone = estimate(shape, [group], Link(1e10), Training(recompute="off"))
    shared = estimate(
        shape, [group], Link(1e10), Training(recompute="off"), host=SharedHost(cores=2)
    )
    assert shared.step_s == pytest.approx(sum(s.compute_s for s in alone.stages) / 2)
    assert "cores" in shared.bottleneck and shared.samples_per_s < alone.samples_per_s


def test_over_a_slow_link_auto_plans_the_pipeline_the_swarm_would() -> None:
    """bench-small on 3 like nodes over 10 Mbit/s: fp32 boundaries would make one node alone
    faster (2 spare), but the swarm's planner counts auto as int4-block, whose pipeline is
    faster still; --stages asks for a shape whatever the codec."""
    shape = model_shape(get_model("bench-small"))
    group = [NodeGroup(count=3, memory_bytes=2**30, flops_per_s=1e11, label="cpu")]
    link, train = Link(1e7, 0.05), Training(recompute="off")
    auto = estimate(shape, group, link, train)
    raw = estimate(shape, group, link, train, codec="none")
    assert (len(auto.stages), auto.spare, auto.codec) == (3, (), "int4-block")
    assert len(raw.stages) == 1 and len(raw.spare) == 2
    assert auto.samples_per_s > raw.samples_per_s
    shaped = estimate(shape, group, link, Training(recompute="off", stages=3), codec="none")
    assert len(shaped.stages) == 3 and not shaped.spare
    assert shaped.samples_per_s < raw.samples_per_s  # the shape asked for, not the fastest
    two = estimate(shape, group, link, Training(recompute="off", stages=2))
    assert len(two.stages) == 2 and len(two.spare) == 1


def test_impossible_settings_are_config_errors() -> None:
    shape = model_shape(get_model("tiny"))
    group = NodeGroup(count=2, memory_bytes=2**30, flops_per_s=1e9, label="cpu")
    with pytest.raises(ConfigError, match="pipeline"):
        estimate(shape, [group], Link(1e9), Training(pipelines=3))
    with pytest.raises(ConfigError, match="codec"):
        estimate(shape, [group], Link(1e9), Training(), codec="zip")
    with pytest.raises(ConfigError, match="at most 2"):
        estimate(shape, [group], Link(1e9), Training(stages=3))
    with pytest.raises(ConfigError, match="stages"):
        Training(stages=-1)
    with pytest.raises(ConfigError, match="int8"):
        Training(mode="full", base="int8")
    with pytest.raises(ConfigError, match="multiple"):
        Training(batch_size=10, microbatches=4)


# ---- the command ------------------------------------------------------------------------------


def test_the_printed_plan_marks_the_row_it_predicts_and_why_nodes_are_spare(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "--model", "llama-8b", "--nodes", "16x24gb", "--mode", "lora"]
    assert main(args) == 0
    text = capsys.readouterr().out
    (marked,) = [line for line in text.splitlines() if line.endswith("<- prediction")]
    assert marked.startswith("int4-block")
    predicted = marked.split()[-3]  # the row's samples/s
    assert f"predicted {predicted} samples/s" in text
    assert "with auto (stages cut as for int4-block; it would send " in text
    assert main([*args, "--codec", "none", "--stages", "12"]) == 0
    text = capsys.readouterr().out
    (marked,) = [line for line in text.splitlines() if line.endswith("<- prediction")]
    assert marked.startswith("none") and "with none;" in text
    assert "spare nodes (not in the --stages asked for): n12, n13, n14, n15" in text


def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-8b", "--nodes", "16xrtx9999"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown GPU 'rtx9999'" in err[0]
    assert main(["plan", "--model", "bench-small", "--layers", "4", "--nodes", "3x24gb"]) == 2
    assert "shape flags" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_exits_1_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-70b", "--nodes", "16x24gb", "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["fits"] is False
    assert "short by" in record["shortfall"] and "--mode lora" in record["hint"]


def test_plan_json_from_a_real_process() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ravnest_node",
            "plan",
            "--model",
            "llama-8b",
            "--nodes",
            "8x24gb,8x12gb@30",
            "--link",
            "100mbit,20ms",
            "--mode",
            "lora",
            "--base",
            "bf16",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["fits"] is True
    assert record["model"]["params"] == LLAMA_PRESETS["llama-8b"].shape().params
    assert record["link"] == {"bandwidth_bps": 1e8, "rtt_s": 0.02}
    stages = record["stages"]
    assert stages[0]["blocks"][0] == 0 and stages[-1]["blocks"][1] == record["model"]["blocks"]
    for stage in stages:
        memory = stage["memory_bytes"]
        assert memory["total"] <= memory["usable"] <= memory["node"]
    assert set(record["links"]) == {"none", "fp16", "bf16", "int8-block", "int4-block"}
    predicted = record["predicted"]
    assert predicted["samples_per_s"] > 0 and predicted["bottleneck"]
    assert predicted["tokens_per_s"] == pytest.approx(predicted["samples_per_s"] * 2048)
    assert record["codec"] in record["auto_choices"]
    # Under auto the stages are cut as the swarm's planner counts it, and the prediction is
    # that cut's row of the table, whatever each link would then send.
    assert record["cut_for"] == "int4-block"
    row = record["links"][record["cut_for"]]
    assert predicted["samples_per_s"] == pytest.approx(row["samples_per_s"])
    assert row["stages"] == len(stages)


def test_a_local_llama_is_planned_from_its_config(tmp_path: Path) -> None:
    """hf:DIR of a Llama: the presets' formulas on its config.json, no weight read; its LoRA
    options are the plan's default mode."""
    make_llama(tmp_path / "llama")
    c = json.loads((tmp_path / "llama" / "config.json").read_text())
    name = f"hf:{tmp_path / 'llama'},seq=16"
    shape = pretrained_shape(name)
    same = LlamaConfig(
        layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"],
        kv_heads=c["num_key_value_heads"], mlp_hidden=c["intermediate_size"],
        vocab=c["vocab_size"], seq_len=16,
    ).shape(name)  # fmt: skip
    assert shape == same
    assert shape.params == get_model(name).num_parameters()

    def plan(*args: str) -> dict[str, Any]:
        out = io.StringIO()
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        assert run_plan(parser.parse_args([*args, "--nodes", "2x4gb", "--json"]), out) == 0
        return dict(json.loads(out.getvalue()))

    lora = plan("--model", f"{name},lora=4,base=bf16")["training"]
    assert (lora["mode"], lora["lora_rank"], lora["base"]) == ("lora", 4, "bf16")
    full = plan("--model", f"{name},lora=4,base=int8", "--mode", "full")["training"]
    assert full["mode"] == "full"


def test_a_local_bert_is_measured_without_reading_its_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_bert(tmp_path / "bert")
    name = f"hf:{tmp_path / 'bert'},seq=12"
    params = get_model(name).num_parameters()

    def refuse(*_: Any) -> None:
        raise AssertionError("plan read weights")

    monkeypatch.setattr(pretrained_model, "load_tensors", refuse)
    shape = pretrained_shape(f"{name},lora=2")  # the shape before LoRA
    assert shape.params == params
    assert len(shape.blocks) == get_model(name).num_blocks()


def test_where_the_default_batch_does_not_fit_plan_finds_one_that_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The issue's command: a 70B LoRA on an nf4 base over four 24 GB cards fits, at the
    largest power-of-two batch below the default that does, and says so; a batch the user
    gave is never changed."""
    argv = ["plan", "--model", "llama-70b", "--nodes", "4x24gb", "--mode", "lora", "--base", "nf4"]
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["training"]["batch_size"] == 4 and record["training"]["microbatches"] == 4
    assert record["smaller_batch"].startswith("the default batch of 16 samples does not fit")
    assert all(s["memory_bytes"]["total"] <= s["memory_bytes"]["usable"] for s in record["stages"])
    assert main([*argv, "--batch-size", "16", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main([*argv, "--batch-size", "8", "--microbatches", "8", "--json"]) == 1
