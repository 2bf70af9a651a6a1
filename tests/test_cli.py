"""The command line: help, one-line errors with exit status 2, config sources on the real tree."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ravnest_node import settings
from ravnest_node.cli.main import main
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.errors import ConfigError
from ravnest_node.launch.progress import ProgressBar

from .conftest import NODE_ENV, ravnest


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ravnest(*args), env=NODE_ENV, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _run_all(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """`_run` of each command, side by side (each spends seconds importing torch)."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "stdin": subprocess.DEVNULL}
    procs = [subprocess.Popen(ravnest(*a), env=NODE_ENV, text=True, **pipes) for a in commands]
    results = []
    for args, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=60)
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ravnest-node: error:")
    for needle in needles:
        assert needle in lines[0]


def test_help_explains_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in ("start", "demo", "status", "--join", "--mdns --join auto", "RAVNEST_TRAIN_STEPS"):
        assert text in out
    with pytest.raises(SystemExit):
        main(["start", "--help"])
    out = capsys.readouterr().out
    for flag in ("--listen", "--state-dir", "--join", "--swarm-size", "--model", "--codec",
                 "--peer", "--mdns", "--no-mdns", "--mdns-interface"):  # fmt: skip
        assert flag in out


def test_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("start", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path))
    _one_line_error(result, f"cannot listen on 127.0.0.1:{port}")


def test_unknown_model_is_a_one_line_error() -> None:
    start, demo = _run_all(("start", "--model", "gpt-9"), ("demo", "--model", "gpt-9"))
    _one_line_error(start, "unknown model 'gpt-9'", "bench-small")
    _one_line_error(demo, "unknown model 'gpt-9'")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[train\nsteps = 3\n", "bad.toml"),
        ("[train]\nstpes = 3\n", "unknown setting 'stpes'"),
        ("[train]\nsteps = 'many'\n", "steps must be an integer"),
        ("listen = 'nowhere'\n", "is not HOST:PORT"),
    ],
)
def test_malformed_config_file_is_a_one_line_error(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    _one_line_error(_run("start", "--config", str(path)), needle)


def test_missing_config_file_is_a_one_line_error(tmp_path: Path) -> None:
    _one_line_error(_run("demo", "--config", str(tmp_path / "nope.toml")), "not found")


def test_file_env_and_flags_fill_the_same_fields(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        "swarm_size = 2\n[train]\nsteps = 5\nlr = 0.001\n[transport]\nstop_grace_s = 1.5\n"
    )
    env = {"RAVNEST_TRAIN_STEPS": "7", "RAVNEST_TRAIN_CODEC": "bf16"}
    parser = main.__globals__["_parser"]()
    args = parser.parse_args(["start", "--steps", "9", "--config", str(path)])
    cfg = settings.load(NodeConfig, args=args, env=env, toml_path=path)
    assert cfg.membership.swarm_size == 2 and cfg.train.lr == 0.001
    assert cfg.transport.stop_grace_s == 1.5
    assert cfg.train.codec == "bf16"  # env over file
    assert cfg.train.steps == 9  # flag over env
    with pytest.raises(ConfigError, match="RAVNEST_TRAIN_STEPS"):
        settings.load(NodeConfig, env={"RAVNEST_TRAIN_STEPS": "x"})


def test_to_env_round_trips_the_training_config() -> None:
    cfg = settings.load(NodeConfig, env={"RAVNEST_TRAIN_LR": "0.0007", "RAVNEST_TRAIN_SEED": "3"})
    again = settings.load(NodeConfig, env=settings.to_env(cfg.train, ("train",)))
    assert again.train == cfg.train


def test_an_unbounded_staleness_is_refused() -> None:
    _one_line_error(_run("demo", "--max-staleness", "9"), "max_staleness=9: must be 0 to 8")


def test_gradient_only_codec_is_refused_for_activations() -> None:
    topk, zstd = _run_all(("demo", "--codec", "topk-ef"), ("demo", "--gradient-codec", "zstd"))
    _one_line_error(topk, "topk-ef is for gradients only")
    _one_line_error(zstd, "gradient_codec='zstd'")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_redraws_in_place_on_a_terminal_only() -> None:
    screen = _Terminal()
    bar = ProgressBar(screen, "ours", 40)
    bar.update(10)  # the first is drawn; quick ones after it are skipped, but the last
    bar.update(11)
    bar.update(40)
    frames = screen.getvalue().split("\r")[1:]
    assert frames[0] == "ours [" + "#" * 7 + "." * 23 + "] 10/40 steps"
    assert frames[-1] == "ours [" + "#" * 30 + "] 40/40 steps" and len(frames) == 2
    bar.clear()
    assert screen.getvalue().endswith("\r\x1b[K")
    log = io.StringIO()  # a file or a pipe: nothing
    quiet = ProgressBar(log, "ours", 40)
    quiet.update(40)
    quiet.clear()
    assert log.getvalue() == ""


def test_the_command_does_not_import_what_only_a_benchmark_needs() -> None:
    """Every node process imports the command line: torch.distributed.pipelining (and the
    torch._dynamo it pulls in, about a second a process) waits for the one bench that runs it."""
    code = ("import sys, ravnest_node.cli.main; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', "
            "'torch.distributed.pipelining'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=NODE_ENV, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"
