"""`ravnest-node bench flaps` (issue #34): its figures from what a scenario recorded (no sockets),
and one short scenario end to end in network namespaces (root, iptables)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from ravnest_node.bench import flaps, flaps_report
from ravnest_node.bench.links import iptables_available
from ravnest_node.bench.suite import Suite
from ravnest_node.pipeline.run import TrainConfig

from .conftest import missing


def test_the_longest_stall_is_the_longest_wait_for_a_new_step() -> None:
    # Two nodes polled; a restore sets versions back (a redone step is no new one).
    progress = [(0.0, 1), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 1), (5.0, 2), (7.0, 4), (7.5, 5)]
    assert flaps_report.longest_stall_s(progress) == pytest.approx(5.5)  # 3 at 1.5, 4 at 7.0
    assert flaps_report.longest_stall_s([(0.0, 3)]) == 0.0


def test_warning_lines_count_warning_and_above_only() -> None:
    log = (
        "2026-01-01 00:00:00,000 INFO a: x\n2026-01-01 00:00:01,000 WARNING a: y\n"
        "2026-01-01 00:00:02,000 ERROR b: z\nTraceback (most recent call last):\n"
    )
    assert flaps_report.warning_lines(log) == 2


def _summary(wall_s: float, losses: list[float], samples: int = 160) -> dict[str, Any]:
    return {"wall_s": wall_s, "samples": samples, "steps": 10, "loss_history": losses,
            "samples_per_s": samples / wall_s, "redone_microbatches": 4,
            "plans": [{"epoch": 1, "start_step": 0, "nodes": 3},
                      {"epoch": 2, "start_step": 5, "nodes": 2}]}  # fmt: skip


def test_figures_against_clean_subtract_the_outage_and_compare_loss_and_rate() -> None:
    clean = flaps_report.summary_figures(_summary(10.0, [2.0] * 20), steps=10, batch_size=16)
    clean["outage_s"] = 0.0
    r = flaps_report.summary_figures(_summary(25.0, [2.0] * 10 + [2.02] * 10), 10, 16)
    r["outage_s"] = 10.0
    assert r["samples_ok"] and r["plans"] == [[1, 0, 3], [2, 5, 2]]
    assert r["final_loss"] == pytest.approx(2.02)  # the last 10 steps' mean
    rel = flaps_report.against_clean(r, clean)
    assert rel["lost_s"] == pytest.approx(15.0)
    assert rel["lost_minus_outage_s"] == pytest.approx(5.0)
    assert rel["loss_diff_pct"] == pytest.approx(1.0)
    assert rel["rate_vs_clean"] == pytest.approx(0.4)
    # A run that never finished: nothing is claimed for it.
    gone = flaps_report.summary_figures(None, 10, 16) | {"outage_s": 10.0}
    assert not gone["samples_ok"] and gone["samples_expected"] == 160
    assert set(flaps_report.against_clean(gone, clean).values()) == {None}
    assert flaps_report.against_clean(r, None)["lost_s"] is None
    wrong = flaps_report.summary_figures(_summary(10.0, [2.0], samples=176), 10, 16)
    assert not wrong["samples_ok"]


def test_only_picks_scenarios_clean_first_and_quick_leaves_out_the_five_minutes() -> None:
    assert [s.name for s in flaps.chosen("flap10, clean", quick=False)] == ["clean", "flap10"]
    assert "flap300" not in [s.name for s in flaps.chosen("", quick=True)]
    assert [s.name for s in flaps.chosen("", quick=False)] == [s.name for s in flaps.SCENARIOS]
    with pytest.raises(ValueError, match="flap7"):
        flaps.chosen("flap7", quick=False)


def test_without_namespaces_the_suite_says_why_and_measures_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flaps, "iptables_available", lambda: (False, "needs root"))
    out = io.StringIO()
    suite = Suite(train=TrainConfig(), jsonl=tmp_path / "f.jsonl", work_dir=tmp_path, out=out)
    assert flaps.run_flaps_bench(suite, only="clean") == 0
    assert "nothing measured: needs root" in out.getvalue()
    assert not suite.jsonl.exists()


def test_a_clean_run_through_the_suite_fills_its_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`clean` on tiny for 40 steps: three daemons in namespaces, the record in the jsonl and
    a row in the table; every daemon ran to the end and stopped with 0 on SIGTERM."""
    ok, why = iptables_available()
    if not ok:
        missing(why)
    monkeypatch.setattr(flaps, "NET_NAME", "rvtbflap")  # not a running `bench flaps`'s
    out = io.StringIO()
    suite = Suite(train=TrainConfig(batch_size=8), jsonl=tmp_path / "flaps.jsonl",
                  work_dir=tmp_path / "work", quick=True, out=out)  # fmt: skip
    assert flaps.run_flaps_bench(suite, only="clean", model="tiny", steps=40) == 0, out.getvalue()
    (r,) = [json.loads(line) for line in suite.jsonl.read_text().splitlines()]
    assert r["scenario"] == "clean" and r["run_finished"], out.getvalue()
    assert r["samples"] == r["samples_expected"] == 40 * 8 and r["samples_ok"]
    assert r["running_at_end"] == [True, True, True]
    assert r["exit_codes"] == [0, 0, 0]
    assert r["plans"] == [[1, 0, 3]] and r["redone_microbatches"] == 0
    assert r["outage_s"] == 0.0 and not r["fault_started"]
    assert r["lost_s"] == 0.0 and r["rate_vs_clean"] == 1.0 and r["loss_diff_pct"] == 0.0
    assert r["wall_s"] > 0 and r["final_loss"] > 0 and len(r["warning_lines"]) == 3
    assert "| clean |" in out.getvalue() and suite.jsonl.with_suffix(".md").exists()


def test_the_table_has_one_row_per_record_and_dashes_for_what_was_not_measured() -> None:
    gone = flaps_report.summary_figures(None, 10, 16) | flaps_report.against_clean({}, None)
    gone |= {"scenario": "flap300", "outage_s": 300.0, "run_ended_during_outage": True,
             "longest_stall_s": 12.0, "running_at_end": [True, False, True],
             "exit_codes": [0, 1, 0], "warning_lines": [1, 9, 2]}  # fmt: skip
    rows = flaps_report.table([gone]).splitlines()
    assert len(rows) == 3 and rows[0].count("|") == rows[1].count("|") == rows[2].count("|")
    assert rows[2].startswith("| flap300 | - | - | 300.0 (run ended in it) | - | 12.0 |")
    assert "- != 160" in rows[2] and "| 2/3 | [0, 1, 0] |" in rows[2]
