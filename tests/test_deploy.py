"""deploy/ and docker-compose.yml: the files parse and hold what they claim, with no Docker
engine; the compose file's commands run as they are (host names and paths mapped to this
machine) and train together."""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest_node import settings
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.transport.credentials import create_swarm

from .conftest import NODE_ENV, Procs, progress_events, ravnest, read_line

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.toml"))
SWARM_DIR = "/etc/ravnest-node/swarm"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_configs_load(path: Path, tmp_path: Path) -> None:
    """Each example is a valid node config (its credentials made for the test)."""
    text = path.read_text()
    name = tomllib.loads(text).get("swarm_name", "default")
    if SWARM_DIR in text:
        create_swarm(name, tmp_path / "swarm")
        text = text.replace(SWARM_DIR, str(tmp_path / "swarm"))
    copy = tmp_path / path.name
    copy.write_text(text)
    overrides = {"coordinator_only": True} if "coordinator" in path.stem else None
    cfg = settings.load(NodeConfig, env={}, toml_path=copy, overrides=overrides)
    assert cfg.swarm_name == name and cfg.state_dir == Path("/var/lib/ravnest-node")
    assert (cfg.transport.credentials is not None) == (SWARM_DIR in path.read_text())
    assert len(EXAMPLES) == 4  # home LAN, lab coordinator and node, public swarm


def test_the_systemd_unit_starts_a_node_from_its_config() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "deploy" / "ravnest-node.service")
    start = unit["Service"]["ExecStart"].split()
    assert start[1:4] == ["start", "--config", "/etc/ravnest-node/node.toml"]
    assert unit["Service"]["KillSignal"] == "SIGTERM"  # a graceful stop
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_the_compose_file_is_valid() -> None:
    """What `docker compose config` checks that matters here, without the engine."""
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"coordinator", "node1", "node2", "node3"}
    for name, service in services.items():
        dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
        assert dockerfile.is_file(), name
        command = service["command"]
        assert isinstance(command, list) and all(isinstance(a, str) for a in command)
        assert command[0] in ("start", "coordinator")
        assert set(service.get("depends_on", [])) <= set(services)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], volume
        assert service["environment"]["RAVNEST_COMPUTE_THREADS"] == "1"
        for port in service.get("ports", []):
            assert re.fullmatch(r"(\d+\.\d+\.\d+\.\d+:)?\d+:\d+", port), port
    workers = [s for s in services.values() if s["command"][0] == "start"]
    assert all("coordinator:7070" in s["command"] for s in workers)
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["ravnest-node"]' in dockerfile
    # CPU by default, the CUDA variant by one build argument; torch pinned either way.
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile
    assert "torch==2.13.0 --index-url ${TORCH_INDEX}" in dockerfile


def test_the_compose_commands_train_together_outside_docker(procs: Procs, tmp_path: Path) -> None:
    """Each service's command as it is, with its host name mapped to a loopback address of
    its own, /state to a directory, and the coordinator told to train tiny for a few steps."""
    services = _compose()["services"]
    hosts = {name: f"127.0.0.{11 + i}" for i, name in enumerate(services)}

    def local(arg: str, me: str) -> str:
        arg = arg.replace("0.0.0.0", hosts[me])
        for name, ip in hosts.items():
            arg = re.sub(rf"^{name}:", f"{ip}:", arg)
        return str(tmp_path / me) if arg == "/state" else arg

    for name, service in services.items():
        args = [local(a, name) for a in service["command"]]
        if args[0] == "coordinator":
            args += ["--model", "tiny", "--steps", "6", "--metrics-port", "0"]
        env = NODE_ENV | service["environment"]
        proc = procs.popen(ravnest(*args), env=env, stderr=subprocess.DEVNULL)
        assert json.loads(read_line(proc, 60))["event"] == "ready", name
    coordinator = f"{hosts['coordinator']}:7070"
    done = [e for e in progress_events(coordinator) if e.done]
    assert len(done) == 1 and not done[0].error
    assert json.loads(done[0].summary_json)["nodes"] == 3
