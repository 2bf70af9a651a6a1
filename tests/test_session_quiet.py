"""The upstream stream of a stage opens once the measurements of the stage's links have ended
(daemon/worker/sessions.py, `Session.quiet`): frames sent meanwhile would share the links
with the probes and make them read low."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import ravnest_node.daemon.worker.sessions as sessions_module
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.sessions import Session, Sessions
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.boundary import LinkCounters
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import TransportConfig

EPOCH = 1


class _Coordinator:
    address = "coordinator:1"
    latest_plan = pb.Plan(epoch=EPOCH)
    started_plan = pb.Plan(epoch=EPOCH)

    async def swarm(self) -> pb.SwarmView:
        return pb.SwarmView()


def _runtime() -> SimpleNamespace:
    return SimpleNamespace(
        spec=SimpleNamespace(is_first=False, index=1),
        upstream=None,
        window=4,
        run_config=SimpleNamespace(link_pace_bps=lambda index: 0.0),
        first_seq=0,
        accept_from_upstream=lambda frame: None,
        admitted_forwards=lambda: None,
        done=False,
    )


async def _sessions(probers: frozenset[str]) -> tuple[Sessions, Session]:
    sessions = Sessions(
        node_id="middle",
        transport=TransportConfig(),
        counters=LinkCounters(),
        changes=Changes(5.0),
        coordinator=_Coordinator(),
    )
    session = Session(
        _runtime(),  # type: ignore[arg-type]
        "first",
        asyncio.get_running_loop().create_future(),
        downstream_node_id="last",
        probers=probers,
    )
    await sessions.start(pb.Plan(epoch=EPOCH), session)
    return sessions, session


async def _still_waiting(task: asyncio.Task[object]) -> bool:
    for _ in range(20):  # (lets every ready callback run; nothing it waits for comes)
        await asyncio.sleep(0)
    return not task.done()


async def test_the_upstream_stream_opens_once_every_measurement_of_the_links_has_ended() -> None:
    sessions, session = await _sessions(frozenset({"first", "last"}))
    opening = asyncio.create_task(sessions.open_session("first", EPOCH))
    assert await _still_waiting(opening)
    # The last stage measures this node; a probe that does not end its measurement changes
    # nothing, the one that does ends it.
    await sessions.admit_probe("last", EPOCH, 64 << 10)
    await sessions.admit_probe("last", EPOCH, 0, done=True)
    assert await _still_waiting(opening)
    session.links_measured()  # this stage's own measurements
    assert await _still_waiting(opening)
    assert session.runtime.upstream is None
    await sessions.admit_probe("first", EPOCH, 0, done=True)
    async with asyncio.timeout(5):
        link, _, _ = await opening
    assert session.runtime.upstream is link and link.peer == "first"
    # A resumed call of the same stream does not wait again.
    async with asyncio.timeout(5):
        again, _, _ = await sessions.open_session("first", EPOCH)
    assert again is link


async def test_without_probers_the_stream_waits_only_for_the_stages_own_measurements() -> None:
    sessions, session = await _sessions(frozenset())
    opening = asyncio.create_task(sessions.open_session("first", EPOCH))
    assert await _still_waiting(opening)
    session.links_measured()
    async with asyncio.timeout(5):
        await opening


async def test_a_prober_that_never_ends_holds_the_stream_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sessions_module, "QUIET_WAIT_S", 0.05)
    sessions, session = await _sessions(frozenset({"last"}))
    session.links_measured()
    async with asyncio.timeout(5):
        link, _, _ = await sessions.open_session("first", EPOCH)
    assert session.runtime.upstream is link and not session.quiet.is_set()


async def test_an_unknown_peer_is_refused_without_waiting() -> None:
    sessions, _ = await _sessions(frozenset({"first"}))
    with pytest.raises(Refusal, match="unknown peer"):
        async with asyncio.timeout(5):
            await sessions.open_session("stranger", EPOCH)
