"""What audits cost (issue #35): the same `ours` run on one emulated link with each audit
share, alternating (A B A B: this machine is noisy), side by side. Each run is a plain
`ravnest-node bench --systems ours` process; its record says the samples/s, the boundary bytes
per sample, and the audits (their count, their records' bytes, their recomputation seconds).

    python -m ravnest_node.bench.audit_cost [--scenario home] [--steps 40] [--shares 0 0.01]
        [--rounds 2] [--jsonl docs/bench/audit-cost.jsonl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _one(scenario: str, steps: int, share: float, extra: Sequence[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ravnest-audit-cost-") as tmp:
        jsonl = Path(tmp) / "run.jsonl"
        work = str(Path(tmp) / "work")
        command = [sys.executable, "-m", "ravnest_node", "bench", "--scenario", scenario,
                   "--systems", "ours", "--steps", str(steps), "--audit-share", str(share),
                   "--jsonl", str(jsonl), "--work-dir", work, *extra]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        record: dict[str, Any] = json.loads(jsonl.read_text().splitlines()[0])
    samples = record["samples"]
    return {
        "scenario": scenario, "steps": steps, "audit_share": share,
        "samples_per_s": record["samples_per_s"], "bytes_per_sample": record["bytes_per_sample"],
        "audits": record.get("audits", 0),
        "audit_bytes_per_sample": record.get("audit_bytes", 0) / samples,
        "audit_s": record.get("audit_s", 0.0), "final_loss": record["final_loss"],
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="home")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.01])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--jsonl", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="more `bench` arguments (after --)")
    args = parser.parse_args(argv)
    rows = []
    print("| round | audit share | samples/s | vs share 0 | boundary B/sample | audits | "
          "audit B/sample | audit s | final loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        base = None
        for share in args.shares:
            row = {"round": r, **_one(args.scenario, args.steps, share, args.extra)}
            rows.append(row)
            base = row["samples_per_s"] if share == 0 else base
            ratio = f"{row['samples_per_s'] / base:.3f}" if base else "-"
            print(f"| {r} | {share:g} | {row['samples_per_s']:.2f} | {ratio} | "
                  f"{row['bytes_per_sample']:,.0f} | {row['audits']} | "
                  f"{row['audit_bytes_per_sample']:,.0f} | {row['audit_s']:.2f} | "
                  f"{row['final_loss']:.4f} |", flush=True)  # fmt: skip
    if args.jsonl is not None:
        args.jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
