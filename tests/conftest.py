"""Helpers for tests that run real `ravnest-node` processes."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import grpc
import pytest

from ravnest_node.bench.links import netns_available
from ravnest_node.models import get_model
from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.inbox import Inbox
from ravnest_node.pipeline.metrics import StepReport
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import Schedule, expected_tensors
from ravnest_node.pipeline.stage import StageRuntime, StageSpec
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.options import TransportConfig, grpc_sync_channel

# Keep the suite predictable on a 2-core machine: one torch thread per node process.
NODE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RAVNEST_")} | {
    "PYTHONUNBUFFERED": "1",
}

STRICT = os.environ.get("RAVNEST_TEST_STRICT") == "1"
"""Set by .ci/run: a test must not skip for want of something the environment should have."""


def missing(reason: str) -> NoReturn:
    """Skip the test for want of something of the environment (network namespaces, Chromium,
    an optional package); under RAVNEST_TEST_STRICT=1 (CI, where everything is installed and
    the tests run as root) fail instead. Skips about a test's own parameters stay skips."""
    if STRICT:
        pytest.fail(f"{reason} (RAVNEST_TEST_STRICT=1: this environment must have it)")
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, why: str = "") -> ModuleType:
    """`pytest.importorskip`, with `missing`'s rule: the module, or a skip (a failure under
    RAVNEST_TEST_STRICT=1). Usable at module level."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"{name} is not installed{f' ({why})' if why else ''}: {exc}")


def has_module(name: str) -> bool:
    """Whether `name` can be imported, for a check that only runs with it (under
    RAVNEST_TEST_STRICT=1, its absence fails the test: that check must run)."""
    if importlib.util.find_spec(name) is not None:
        return True
    if STRICT:
        missing(f"{name} is not installed")
    return False


def require_netns() -> None:
    """Network namespaces, veth pairs and tbf usable here (root), or `missing`."""
    ok, reason = netns_available()
    if not ok:
        missing(reason)


async def _no_report(_: StepReport) -> None:
    raise AssertionError("no step should complete in these tests")


TINY_MIDDLE = StageSpec(index=1, num_stages=3, first_block=2, stop_block=3)
"""Stage 1 of 3 of tiny: its block 2."""


def tiny_middle_stage(pool: Executor, run: TrainConfig) -> StageRuntime:
    """Stage 1 of 3 of tiny (its block 2), as a swarm would build it, for tests that drive a
    stage runtime without sockets; it must not complete a step."""
    model = get_model("tiny")
    return StageRuntime(
        spec=TINY_MIDDLE,
        model=model,
        blocks=model.build_stage(0, 2, 3),
        run=run,
        compute=pool,
        report=_no_report,
    )


def tiny_middle_compute(pool: Executor, run: TrainConfig) -> StageCompute:
    """The torch side of `tiny_middle_stage`, for tests that call its compute directly."""
    model = get_model("tiny")
    return StageCompute(
        spec=TINY_MIDDLE, model=model, blocks=model.build_stage(0, 2, 3), run=run, executor=pool
    )


def tiny_middle_inbox(run: TrainConfig) -> Inbox:
    """The admission side of `tiny_middle_stage` (at step 0), for tests of what it takes."""
    forward, backward = expected_tensors(get_model("tiny"), TINY_MIDDLE, run.microbatch_size)
    return Inbox(Schedule(TINY_MIDDLE, run, start_step=0, forward=forward, backward=backward))


def ravnest(*args: str) -> list[str]:
    return [sys.executable, "-m", "ravnest_node", *args]


def demo_summary(tmp_path: Path, name: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Run `ravnest-node demo ARGS` to the end (work dir and summary under tmp_path/name) and
    return its summary; fails the test with the demo's output if it does not exit 0."""
    return demo_summaries(tmp_path, {name: args}, timeout=timeout)[name]


def _end_demo(proc: subprocess.Popen[str]) -> None:
    """End a demo started in a session of its own that has not exited 0, with the node
    processes it started (its process group): none outlives a test that failed or timed out."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def demo_summaries(
    tmp_path: Path,
    runs: dict[str, Sequence[str]],
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """`demo_summary` of several runs (name -> args) side by side, for runs whose results do
    not depend on timing (synchronous, fixed codec): their summaries by name. `env`: the
    demos' environment (default NODE_ENV), which their node processes inherit. A demo that
    fails or times out is ended with its nodes (`_end_demo`)."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
    procs = {}
    try:
        for name, args in runs.items():
            summary = str(tmp_path / f"{name}.json")
            command = ravnest("demo", "--work-dir", str(tmp_path / name), "--summary-json", summary)
            procs[name] = subprocess.Popen(
                [*command, *args], env=env or NODE_ENV, text=True, start_new_session=True, **pipes
            )
        for name, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"demo {name} did not end within {timeout} s") from None
            assert proc.returncode == 0, f"demo {name}:\n{out}"
    finally:
        for proc in procs.values():
            if proc.returncode != 0:
                _end_demo(proc)
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in runs}


def read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """One line of the process's stdout, or b"" at EOF; fails the test after `timeout_s`."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"no complete line from pid {proc.pid} within {timeout_s} s")
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                return buf
            buf += chunk
        return buf


def wait_for_line(proc: subprocess.Popen[bytes], needle: str, timeout_s: float) -> list[str]:
    """Lines of stdout up to and including the first that contains `needle`."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while True:
        line = read_line(proc, max(0.1, deadline - time.monotonic())).decode()
        if not line:
            raise AssertionError(f"stdout ended before {needle!r}; got {lines}")
        lines.append(line)
        if needle in line:
            return lines


class Procs:
    """Processes a test started; whatever is still running at the end is killed (by pid)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []
        self._leaders: set[int] = set()
        """Pids of those started in a session of their own (start_new_session=True)."""

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        kwargs.setdefault("env", NODE_ENV)
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(args, **kwargs)
        self.started.append(proc)
        if kwargs.get("start_new_session"):
            self._leaders.add(proc.pid)
        return proc

    def start_node(
        self,
        state_dir: Path,
        *args: str,
        command: str = "start",
        prefix: Sequence[str] = (),
        **kwargs: Any,
    ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        """`ravnest-node start` (or `command`) with its log in state_dir/node.log, run under
        `prefix` (a network namespace's `ip netns exec ...`); returns (proc, ready event). A
        later --listen in `args` wins over the default."""
        state_dir.mkdir(parents=True, exist_ok=True)
        log = open(state_dir / "node.log", "ab")  # noqa: SIM115 - closed by the child's exit
        proc = self.popen(
            [*prefix, *ravnest(command, "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
                               "--threads", "1", *args)],
            stderr=log, **kwargs,
        )  # fmt: skip
        log.close()
        line = read_line(proc, 60)
        if not line:
            proc.wait(10)
            raise AssertionError(
                f"node exited ({proc.returncode}) before ready:\n"
                + (state_dir / "node.log").read_text()
            )
        event: dict[str, Any] = json.loads(line)
        assert event["event"] == "ready"
        return proc, event

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            # Started in a session of its own (a demo, with its node processes): they go too,
            # rather than stay behind as orphans when a test fails midway.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if proc.pid in self._leaders:
                    os.killpg(proc.pid, signal.SIGKILL)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.cleanup()


def node_status(address: str, transport: TransportConfig | None = None) -> pb.NodeStatus:
    """A running node's `Node.Status` (with a protected swarm's credentials in `transport`)."""
    with grpc_sync_channel(address, transport or TransportConfig()) as channel:
        status: pb.NodeStatus = pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=30)
        return status


def swarm_view(address: str) -> pb.SwarmView:
    """The coordinator at `address`'s `Coordinator.Swarm`."""
    with grpc.insecure_channel(address) as channel:
        view: pb.SwarmView = pb_grpc.CoordinatorStub(channel).Swarm(pb.SwarmRequest(), timeout=30)
        return view


def poll_until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Poll `condition` (a question to live processes that cannot push the answer) until it
    holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        time.sleep(0.1)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, or None if there is no such task."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def pid_started(pid: int) -> str:
    """When `pid` started (clock ticks since boot): with the pid, names one process for good."""
    fields = _proc_stat(pid)
    assert fields is not None, f"no process {pid}"
    return fields[19]


def pid_alive(pid: int, started: str) -> bool:
    """True if the process `pid` that started at `started` (see pid_started) runs and is no zombie.

    The start time matters: with pid_max at 32768, a long test run wraps around, and a pid (or a
    thread id, which /proc also answers for) can belong to someone else seconds after its owner
    exited.
    """
    fields = _proc_stat(pid)
    return fields is not None and fields[19] == started and fields[0] != "Z"


_STREAMS: list[grpc.Channel] = []
"""Channels of progress streams a test opened: closed when it ends, even if it failed."""


@pytest.fixture(autouse=True)
def _close_streams() -> Iterator[None]:
    """A failed test keeps its frames (and so an open stream's generator) alive in its report:
    its channel must be closed here, or the interpreter hangs at exit waiting for the stream."""
    yield
    while _STREAMS:
        _STREAMS.pop().close()


def progress_events(
    coordinator: str, timeout_s: float = 120, transport: TransportConfig | None = None
) -> Iterator[pb.Progress]:
    """The coordinator's progress stream (blocking), ending with the summary event."""
    channel = grpc_sync_channel(coordinator, transport or TransportConfig())
    _STREAMS.append(channel)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        yield from stub.WatchProgress(pb.WatchProgressRequest(), timeout=timeout_s)
    finally:
        channel.close()
