"""Stopping: SIGTERM or Ctrl-C ends a daemon or a demo within 10 s, exit 0, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Procs, pid_alive, pid_started, progress_events, ravnest, wait_for_line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_idle_daemon_stops_on_signal(procs: Procs, tmp_path: Path, sig: signal.Signals) -> None:
    # A coordinator waiting for a second node that never comes: idle but fully up.
    proc, ready = procs.start_node(tmp_path / "n0", "--swarm-size", "2")
    assert ready["coordinator"] is True
    proc.send_signal(sig)
    assert proc.wait(10) == 0
    assert "node" in (tmp_path / "n0" / "node.log").read_text()


def test_training_daemon_stops_on_sigterm(procs: Procs, tmp_path: Path) -> None:
    coord, ready = procs.start_node(
        tmp_path / "n0", "--swarm-size", "2", "--model", "tiny", "--steps", "100000"
    )
    worker, _ = procs.start_node(tmp_path / "n1", "--join", ready["address"])
    assert next(progress_events(ready["address"])).step >= 1  # training is under way
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(10) == 0
    coord.send_signal(signal.SIGTERM)
    assert coord.wait(10) in (0, 1)  # 1 if it noticed first that its peer left mid-run


@pytest.mark.parametrize("whole_group", [False, True], ids=["sigint-demo", "ctrl-c-group"])
def test_demo_stops_on_interrupt(procs: Procs, tmp_path: Path, whole_group: bool) -> None:
    demo = procs.popen(
        ravnest("demo", "--model", "tiny", "--nodes", "3", "--steps", "100000",
                "--work-dir", str(tmp_path), "--threads", "1"),
        start_new_session=True, stderr=subprocess.PIPE,
    )  # fmt: skip
    lines = wait_for_line(demo, "step ", timeout_s=120)
    pids = [int(m) for line in lines for m in re.findall(r"\(pid (\d+)\)", line)]
    assert len(pids) == 3
    started = {pid: pid_started(pid) for pid in pids}
    if whole_group:  # what a terminal's Ctrl-C does: every process of the group gets SIGINT
        os.killpg(demo.pid, signal.SIGINT)
    else:
        demo.send_signal(signal.SIGINT)
    assert demo.wait(10) == 0
    assert not [pid for pid in pids if pid_alive(pid, started[pid])]


STUCK_STOP = """
import asyncio, sys
from ravnest_node.launch.signals import install_stop_handlers

async def main():
    never = asyncio.Event()
    # A stop that does not stop: the loop keeps waiting, as a stuck shutdown would.
    install_stop_handlers(asyncio.get_running_loop(), lambda: None, deadline_s=1.0)
    print("ready", flush=True)
    await never.wait()

asyncio.run(main())
"""


STOP_STUCK_HOLDING_THE_GIL = """
import asyncio, re
from ravnest_node.launch.signals import install_stop_handlers

def stop():
    # A stop stuck in C code that never lets go of the GIL (a regex that backtracks for ages),
    # so the Python watchdog thread never runs.
    re.match(r"(a|aa)+$", "a" * 64 + "b")

async def main():
    install_stop_handlers(asyncio.get_running_loop(), stop, deadline_s=1.0)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _stop_script(procs: Procs, script: str) -> tuple[int, str]:
    """Start `script`, SIGTERM it once ready: its exit status and standard error."""
    proc = procs.popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    assert wait_for_line(proc, "ready", timeout_s=30)
    proc.send_signal(signal.SIGTERM)
    status = proc.wait(10)
    assert proc.stderr is not None
    return status, proc.stderr.read().decode()


def test_a_stop_stuck_holding_the_gil_is_ended_with_every_threads_stack(procs: Procs) -> None:
    status, err = _stop_script(procs, STOP_STUCK_HOLDING_THE_GIL)
    assert status == 1
    assert "did not finish within" not in err  # the Python watchdog could not run
    assert "Timeout (0:00:02)!" in err and "in stop" in err  # faulthandler's, with the culprit


def test_a_stuck_stop_ends_at_its_deadline_and_says_what_it_waited_for(procs: Procs) -> None:
    status, err = _stop_script(procs, STUCK_STOP)
    assert status == 0
    assert "did not finish within 1 s" in err
    assert "pending <Task" in err and "in main" in err  # the task that never finished


OWN_STOP_STUCK = """
import asyncio
from ravnest_node.launch.signals import install_stop_handlers

async def main():
    deadline = install_stop_handlers(asyncio.get_running_loop(), lambda: None, deadline_s=1.0)
    print("ready", flush=True)
    # The process decided to stop on its own (say, banned: exit status 3), and its stop hangs.
    deadline.start(3)
    deadline.start(0)  # a later signal's deadline changes nothing
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_stop_of_its_own_that_hangs_ends_at_its_deadline_with_its_status(procs: Procs) -> None:
    proc = procs.popen([sys.executable, "-c", OWN_STOP_STUCK], stderr=subprocess.PIPE)
    assert wait_for_line(proc, "ready", timeout_s=30)
    assert proc.wait(10) == 3  # no signal came: the deadline the process started ended it
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert "did not finish within 1 s" in err and "pending <Task" in err
