"""What a flood from one peer costs a training swarm: `python -m ravnest_node.bench.flood
[STEPS]`.

Three runs of the same local demo (tiny model, 3 node processes, STEPS steps, default 300):
undisturbed, flooded, undisturbed again (so that drift of this noisy machine shows). During the
flooded run one peer (this process, one connection) holds FLOOD_STREAMS WatchProgress streams
open at the coordinator and sends Status calls to the middle node from FLOOD_WORKERS threads as
fast as they are answered. Per-peer limits (transport/limits.py) refuse what is over that
peer's budgets. Printed: samples/s of each run, the flooded run against the mean of the
undisturbed ones, how much of the flood was answered and refused, and the CPU the flooding
process used. The swarm runs on one core and the flooding process on the others (SWARM_CPUS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

CPUS = sorted(os.sched_getaffinity(0))
SWARM_CPUS = set(CPUS[:1] if len(CPUS) > 1 else CPUS)
"""The swarm's demos run on the first core (in every run, flooded or not), the flooding peer on
the others: two processes of one machine do not compete for cores, as the node and a flooding
host of a real network would not."""
FLOOD_CPUS = set(CPUS[1:] or CPUS)
FLOOD_STREAMS = 200
FLOOD_WORKERS = 8
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _demo(work_dir: Path, steps: int) -> subprocess.Popen[bytes]:
    args = [
        "--model",
        "tiny",
        "--nodes",
        "3",
        "--steps",
        str(steps),
        "--seed",
        "0",
        "--max-staleness",
        "0",
        "--codec",
        "int8-block",
    ]  # deterministic: runs compare
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVNEST_")}
    return subprocess.Popen(
        [sys.executable, "-m", "ravnest_node", "demo", "--work-dir", str(work_dir),
         "--summary-json", str(work_dir / "summary.json"), *args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, SWARM_CPUS),
    )  # fmt: skip


def _address(work_dir: Path, index: int, proc: subprocess.Popen[bytes]) -> str:
    path = work_dir / f"node-{index}" / "ready.json"
    deadline = time.monotonic() + 120
    while not path.exists():  # the demo writes it when the node listens
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"node {index} of {work_dir} did not start")
        time.sleep(0.05)
    address: str = json.loads(path.read_text())["address"]
    return address


def _flooded(work_dir: Path, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    proc = _demo(work_dir, steps)
    coordinator = _address(work_dir, 0, proc)
    middle = _address(work_dir, 1, proc)
    codes: Counter[str] = Counter()
    stop = threading.Event()
    lock = threading.Lock()
    with (
        grpc.insecure_channel(coordinator, options=OWN_CONNECTION) as streams,
        grpc.insecure_channel(middle, options=OWN_CONNECTION) as calls,
    ):
        watch = streams.unary_stream("/ravnest.v1.Coordinator/WatchProgress")
        held = [watch(b"") for _ in range(FLOOD_STREAMS)]
        status = calls.unary_unary("/ravnest.v1.Node/Status")

        def spam() -> None:
            while not stop.is_set():
                try:
                    status(b"\x08\x01", timeout=5)  # StatusRequest(brief=True)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
                with lock:
                    codes[code] += 1

        cpu_started = time.process_time()
        workers = [threading.Thread(target=spam) for _ in range(FLOOD_WORKERS)]
        for w in workers:
            w.start()
        try:
            if proc.wait(600) != 0:
                raise RuntimeError(f"the flooded demo in {work_dir} failed")
        finally:
            stop.set()
            for w in workers:
                w.join()
            flooder_cpu_s = time.process_time() - cpu_started
        refused_streams = sum(
            1 for c in held if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
    summary = json.loads((work_dir / "summary.json").read_text())
    flood = {
        "streams": FLOOD_STREAMS,
        "streams_refused": refused_streams,
        "status_calls_answered": codes["OK"],
        "status_calls_refused": codes["RESOURCE_EXHAUSTED"],
        "status_codes": dict(codes),
        "flooder_cpu_s": flooder_cpu_s,
    }
    return summary, flood


def _undisturbed(work_dir: Path, steps: int) -> dict[str, Any]:
    proc = _demo(work_dir, steps)
    if proc.wait(600) != 0:
        raise RuntimeError(f"the demo in {work_dir} failed")
    summary: dict[str, Any] = json.loads((work_dir / "summary.json").read_text())
    return summary


def main(steps: int) -> None:
    os.sched_setaffinity(0, FLOOD_CPUS)
    with tempfile.TemporaryDirectory(prefix="ravnest-flood-") as tmp:
        root = Path(tmp)
        before = _undisturbed(root / "before", steps)
        flooded, flood = _flooded(root / "flooded", steps)
        after = _undisturbed(root / "after", steps)
    clean = (before["samples_per_s"] + after["samples_per_s"]) / 2
    wall = flooded["wall_s"]
    print(f"tiny, 3 nodes, {steps} steps, on core(s) {sorted(SWARM_CPUS)}; one peer on core(s) "
          f"{sorted(FLOOD_CPUS)} holds {FLOOD_STREAMS} WatchProgress streams at the coordinator "
          f"and sends Status calls to the middle node from {FLOOD_WORKERS} threads")  # fmt: skip
    print(
        f"samples/s undisturbed {before['samples_per_s']:.1f} and {after['samples_per_s']:.1f}, "
        f"flooded {flooded['samples_per_s']:.1f}: x{flooded['samples_per_s'] / clean:.2f}"
    )
    print(f"streams refused {flood['streams_refused']} of {flood['streams']}; Status calls "
          f"answered {flood['status_calls_answered']} ({flood['status_calls_answered'] / wall:.0f}"
          f"/s), refused {flood['status_calls_refused']} "
          f"({flood['status_calls_refused'] / wall:.0f}/s); all codes {flood['status_codes']} "
          "(UNAVAILABLE: after the run ended)")  # fmt: skip
    print(
        f"the flooding process used {flood['flooder_cpu_s']:.0f} CPU-seconds in the flooded "
        f"run's {wall:.0f} s"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
