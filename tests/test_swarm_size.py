"""The coordinator's size benchmark (`python -m ravnest_node.bench.swarm_size`), at its
smallest: a real lab coordinator process and 25 simulated members (one pipeline of 25 stages)
join, get the plan, heartbeat and report, one leaves, and after the coordinator is killed the
others elect one of them and join it again."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from .conftest import NODE_ENV


def test_the_swarm_size_benchmark_at_its_smallest(tmp_path: Path) -> None:
    out = tmp_path / "sizes.json"
    done = subprocess.run(
        [sys.executable, "-m", "ravnest_node.bench.swarm_size", "--members", "25",
         "--steady-s", "6", "--step-s", "0.5", "--json", str(out)],
        env=NODE_ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[0] == "members" and lines[1].split()[0] == "25"
    [r] = json.loads(out.read_text())
    assert (r["joined"], r["told"], r["spares"], r["plan_epoch"]) == (25, 25, 0, 1)
    assert not r["join_failures"] and not r["steady_failures"] and not r["rejoin_failures"]
    # Every stage reported about every half second; every member beat (every lease / 3, at a
    # phase of its own: at least once in 6 s).
    assert r["report"]["n"] >= 25 and r["heartbeat"]["n"] >= 25
    assert 0 < r["steady_cpu_share"] < 1 and r["rss_mib"] > 0
    assert math.isfinite(r["replan_s"])  # every other member saw the plan without the leaver
    assert r["vote_won"] and r["rejoined"] == 24
    assert r["election_and_takeover_s"] >= r["vote_s"] > 0
