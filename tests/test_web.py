"""A node's HTTP endpoint (daemon/web.py): Prometheus metrics that move while a 3-node swarm
trains, the page's data, and the page itself in headless Chromium when it is installed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ravnest_node.daemon.web import Family, WebServer, render_metrics
from ravnest_node.errors import PeerUnavailable
from ravnest_node.pipeline.metrics import StageMetrics

from .conftest import Procs, missing, node_status, poll_until, ravnest, read_line

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SAMPLE = re.compile(r"^(ravnest_\w+)(?:\{(.*)\})? (\S+)$")
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        body: bytes = answer.read()
        return body


def scrape(address: str) -> Series:
    """The samples of http://ADDRESS/metrics, by (name, labels)."""
    out: Series = {}
    for line in _get(f"http://{address}/metrics").decode().splitlines():
        if line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, line
        name, labels, value = match.groups()
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.split(",")) if labels else ()
        out[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return out


def value(series: Series, name: str, **labels: str) -> float:
    want = frozenset(labels.items())
    found = [v for (n, ls), v in series.items() if n == name and want <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_the_text_format() -> None:
    text = render_metrics(
        [
            Family("ravnest_a", "A gauge.").add(1.5, peer='x"y'),
            Family("ravnest_b", "A counter.", "counter").add(3),
            Family("ravnest_empty", "Left out."),
            Family("ravnest_c", "Not a number.").add(math.nan),
        ]
    )
    assert text == (
        "# HELP ravnest_a A gauge.\n# TYPE ravnest_a gauge\n"
        'ravnest_a{peer="x\\"y"} 1.5\n'
        "# HELP ravnest_b A counter.\n# TYPE ravnest_b counter\nravnest_b 3\n"
        "# HELP ravnest_c Not a number.\n# TYPE ravnest_c gauge\nravnest_c NaN\n"
    )


async def test_the_endpoint_answers_get_only_and_drops_oversized_requests() -> None:
    async def nothing() -> dict[str, Any]:
        raise PeerUnavailable("no coordinator yet")

    web = WebServer("127.0.0.1", 0, lambda: [Family("ravnest_x", "X.").add(1)], nothing)
    port = await web.start()

    async def ask(request: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        answer = await reader.read()
        writer.close()
        return answer

    try:
        assert (await ask(b"GET /metrics HTTP/1.1\r\n\r\n")).endswith(b"ravnest_x 1\n")
        assert b"405" in (await ask(b"POST /metrics HTTP/1.1\r\n\r\n")).split(b"\r\n")[0]
        assert b"404" in (await ask(b"GET /etc/passwd HTTP/1.1\r\n\r\n")).split(b"\r\n")[0]
        page = await ask(b"GET /swarm.json HTTP/1.1\r\n\r\n")
        assert json.loads(page.split(b"\r\n\r\n", 1)[1]) == {
            "error": "the coordinator does not answer: no coordinator yet"
        }
        big = b"GET / HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n"
        try:
            dropped = await ask(big)
        except ConnectionResetError:  # closed with part of it unread: the kernel resets
            dropped = b""
        assert dropped == b""  # dropped without an answer
    finally:
        await web.close()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Three nodes training tiny (int8 frames), each serving its endpoint on a free port."""
    procs = Procs()
    root = tmp_path_factory.mktemp("web")
    common = ("--metrics-port", "0")
    try:
        _, coordinator = procs.start_node(
            root / "n0", "--swarm-size", "3", "--model", "tiny", "--steps", "3000",
            "--codec", "int8-block", *common,
        )  # fmt: skip
        others = [
            procs.start_node(root / "n1", "--join", coordinator["address"], *common)[1],
            procs.start_node(
                root / "n2", "--join", coordinator["address"], "--log-format", "json", *common
            )[1],
        ]
        nodes = [coordinator, *others]
        poll_until(lambda: all(node_status(n["address"]).version >= 5 for n in nodes), 90)
        yield nodes, root
    finally:
        procs.cleanup()


def test_metrics_of_a_training_swarm_move(swarm: Any) -> None:
    nodes, _ = swarm
    for n in nodes:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", n["metrics"])
    first = [scrape(n["metrics"]) for n in nodes]
    stage = [_stage(s) for s in first]
    assert sorted(stage) == [0, 1, 2]
    last = nodes[stage.index(2)]["metrics"]
    target = value(first[stage.index(2)], "ravnest_step") + 10
    poll_until(lambda: value(scrape(last), "ravnest_step") >= target, 60)
    later = [scrape(n["metrics"]) for n in nodes]
    for i, (a, b) in enumerate(zip(first, later, strict=True)):
        assert value(b, "ravnest_info", role="coordinator" if i == 0 else "worker") == 1
        assert value(b, "ravnest_plan_epoch") >= 1 and value(b, "ravnest_peers") == 2
        # The device it computes on (the CPU in fp32 here; no memory series: not tracked).
        assert value(b, "ravnest_device_info", device="cpu", precision="fp32") == 1
        assert not any(n.startswith("ravnest_device_memory") for (n, _) in b)
        assert value(b, "ravnest_step") > value(a, "ravnest_step")
        assert value(b, "ravnest_samples_per_second") > 0
        assert 0 < value(b, "ravnest_stage_busy_fraction") <= 1
        names = (
            "ravnest_link_bytes_sent_total",
            "ravnest_staleness_microbatches_total",
            "ravnest_frame_decode_seconds_total",
        )  # (every stage receives frames)
        for name in names:
            assert _sum(b, name) > _sum(a, name), name
        roles = (["activation"] if stage[i] < 2 else []) + (["gradient"] if stage[i] else [])
        for role in roles:
            sent = value(b, "ravnest_bytes_sent_total", role=role)
            assert sent > value(a, "ravnest_bytes_sent_total", role=role)
            # int8-block: about 4 bytes of float32 per byte sent (block scales, headers).
            assert 3.0 < value(b, "ravnest_codec_ratio", role=role) < 4.1
        if stage[i] == 2:
            losses = value(a, "ravnest_loss"), value(b, "ravnest_loss")
            assert all(math.isfinite(x) for x in losses) and losses[0] != losses[1]
        else:
            assert not any(n == "ravnest_loss" for (n, _) in b)  # the last stage's only


def _sum(series: Series, name: str) -> float:
    return sum(v for (n, _), v in series.items() if n == name)


def _stage(series: Series) -> int:
    stages = {dict(ls)["stage"] for (n, ls) in series if n == "ravnest_step"}
    assert len(stages) == 1, stages
    return int(stages.pop())


def test_the_page_data_and_the_page(swarm: Any) -> None:
    nodes, _ = swarm
    worker = nodes[1]["metrics"]  # any node serves it, from its coordinator
    data = json.loads(_get(f"http://{worker}/swarm.json"))
    assert len(data["members"]) == 3 and data["model"] == "tiny"
    assert data["node"] == {"device": "cpu", "precision": "fp32"}  # this node's compute
    assert sorted(m["stage"] for m in data["members"]) == [0, 1, 2]
    assert len(data["loss"]) >= 5 and all(math.isfinite(v) for _, v in data["loss"])
    # Every stage's latest metrics, each field of the record by its name (pipeline/metrics.py).
    names = {f.name for f in dataclasses.fields(StageMetrics)}
    assert sorted(s["stage"] for s in data["stages"]) == [0, 1, 2]
    assert all(names <= set(s) and s["compute_s"] > 0 and s["step"] >= 1 for s in data["stages"])
    last = data["loss"][-1][0]  # (at most 500 points are sent: the last step moves on)
    poll_until(lambda: json.loads(_get(f"http://{worker}/swarm.json"))["loss"][-1][0] > last, 60)
    html = _get(f"http://{worker}/").decode()
    assert '<svg id="loss"' in html and "/swarm.json" in html and 'id="compute"' in html
    with pytest.raises(urllib.error.HTTPError) as missing:
        _get(f"http://{worker}/nothing")
    assert missing.value.code == 404


def test_status_watch_redraws_until_interrupted(swarm: Any, procs: Procs) -> None:
    nodes, _ = swarm
    args = ("status", "--watch", "--every", "0.2", nodes[0]["address"])
    watching = procs.popen(ravnest(*args))
    frames: list[list[str]] = []
    while len(frames) < 3:  # a header line, then the node's view
        line = read_line(watching, 30).decode()
        assert line, "status --watch ended by itself"
        if "(Ctrl-C to stop)" in line:
            frames.append([])
        elif frames:
            frames[-1].append(line)
    assert all(any(nodes[0]["node_id"] in line for line in f) for f in frames[:2])
    watching.send_signal(signal.SIGINT)
    assert watching.wait(10) == 0


def test_a_node_logs_json_lines_when_asked(swarm: Any) -> None:
    nodes, root = swarm
    lines = (root / "n2" / "node.log").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    # Every line from Python's logging is one JSON object (gRPC's C core writes its own).
    assert not [line for line in lines if re.match(r"\d{4}-\d\d-\d\d .* ravnest_node", line)]
    assert len(events) >= 3
    assert {"time", "level", "logger", "message", "node_id"} <= set(events[0])
    assert all(e["node_id"] == nodes[2]["node_id"] for e in events)
    assert any(e["message"].startswith("metrics on http://") for e in events)
    assert not (root / "n1" / "node.log").read_text().startswith("{")  # text by default


def _dom(url: str, user_data: Path) -> str:
    """The page's DOM after its script ran (headless Chromium, as root: no sandbox)."""
    assert CHROMIUM is not None
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={user_data}", "--virtual-time-budget=4000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_page_in_a_browser_shows_three_nodes_and_a_loss_curve_that_grows(
    swarm: Any, tmp_path: Path
) -> None:
    if CHROMIUM is None:
        missing("no chromium (Debian: apt install chromium; make browser)")
    nodes, _ = swarm
    url = f"http://{nodes[0]['metrics']}/"
    first = _dom(url, tmp_path / "profile-1")
    assert first.count('class="node"') == 3, first
    for n in nodes:
        assert n["node_id"] in first
    assert "<polyline" in first and int(_attribute(first, "data-points")) >= 2
    assert 'data-stages="3"' in first and 'data-metric="idle_upstream_s"' in first
    shown = int(_attribute(first, "data-last-step"))
    poll_until(lambda: _last_step(nodes[0]["metrics"]) > shown, 60)  # the swarm moved on
    later = _dom(url, tmp_path / "profile-2")
    # The curve moved on (at most 500 points are drawn: its last step is what grows).
    assert int(_attribute(later, "data-last-step")) > shown


def _last_step(address: str) -> int:
    step: int = json.loads(_get(f"http://{address}/swarm.json"))["loss"][-1][0]
    return step


def _attribute(dom: str, name: str) -> str:
    """An attribute of the loss curve's <svg> in a dumped DOM."""
    match = re.search(rf'<svg id="loss"[^>]*{name}="(\d+)"', dom)
    assert match, dom[-2000:]
    return match.group(1)
