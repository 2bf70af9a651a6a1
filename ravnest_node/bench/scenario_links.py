"""The emulated network of one bench scenario: where each node runs and how it is reached.

As root, each node runs in its own network namespace (`links.NetnsSwarm`: tbf rate caps per host)
behind a relay that adds the one-way delay; without root, a relay on loopback in front of each
node does both rate and delay, per connection rather than per host. Also where node ports picked
ahead of their bind come from (`free_port`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from ravnest_node.bench.config import NODES
from ravnest_node.bench.links import LinkSpec, NetnsSwarm
from ravnest_node.errors import RunFailed
from ravnest_node.launch.demo import NodeSlot

NODE_PORT = 7070
RELAY_PORT = 7071

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORTS = (20_000, 32_768)
"""Where node ports picked ahead of their bind come from: below the system's ephemeral range,
so an outgoing connection of any process cannot take one between the pick and the bind (one did,
once in CI: "Address already in use")."""


def free_port() -> int:
    """A port on 127.0.0.1 free now, outside the ephemeral range (see FIXED_PORTS)."""
    low, high = FIXED_PORTS
    with contextlib.suppress(OSError, ValueError, IndexError):
        high = min(high, int(EPHEMERAL_RANGE.read_text().split()[0]))
    candidates = range(low, max(low, high))
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every one tried is taken: let the system choose
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


class ScenarioLinks:
    """The emulated network of one scenario: where each node runs and how it is reached."""

    def __init__(self, link: LinkSpec, mode: str, work_dir: Path) -> None:
        self.link = link
        self.mode = mode
        self.work_dir = work_dir
        self.netns: NetnsSwarm | None = None
        self.slots: list[NodeSlot] = []
        self._relays: list[asyncio.subprocess.Process] = []

    @property
    def description(self) -> str:
        if self.mode == "netns":
            return "network namespaces, tbf rate caps per host, relay delay"
        return "loopback relays for rate and delay (per connection, not per host: no root)"

    @contextlib.asynccontextmanager
    async def up(self) -> AsyncIterator[ScenarioLinks]:
        stack = contextlib.AsyncExitStack()
        async with stack:
            if self.mode == "netns":
                self.netns = stack.enter_context(NetnsSwarm(NODES, self.link))
            stack.push_async_callback(self._stop_relays)
            for i in range(NODES):
                self.slots.append(await self._slot(i))
            yield self

    async def _slot(self, i: int) -> NodeSlot:
        if self.netns is not None:
            host = self.netns.hosts[i]
            await self._relay(
                self.netns.exec_prefix(i),
                f"{host.address}:{RELAY_PORT}",
                f"127.0.0.1:{NODE_PORT}",
                rate=False,
            )
            return NodeSlot(
                prefix=tuple(self.netns.exec_prefix(i)),
                listen=f"0.0.0.0:{NODE_PORT}",
                advertise=f"{host.address}:{RELAY_PORT}",
                reach=f"{host.address}:{NODE_PORT}",
            )
        node_port = free_port()
        relay_port = await self._relay([], "127.0.0.1:0", f"127.0.0.1:{node_port}", rate=True)
        return NodeSlot(
            listen=f"127.0.0.1:{node_port}",
            advertise=f"127.0.0.1:{relay_port}",
            reach=f"127.0.0.1:{node_port}",
        )

    async def _relay(self, prefix: list[str], listen: str, target: str, *, rate: bool) -> int:
        args = [*prefix, sys.executable, "-m", "ravnest_node.bench.relay", "--listen", listen,
                "--target", target, "--delay-ms", str(self.link.delay_ms)]  # fmt: skip
        if rate:
            args += ["--rate-mbit", str(self.link.rate_mbit)]
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
        )
        self._relays.append(proc)
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        try:
            port = int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError):
            raise RunFailed(f"relay for {target} did not start: {line[:200]!r}") from None
        return port

    async def _stop_relays(self) -> None:
        for proc in self._relays:
            if proc.returncode is None:
                proc.terminate()
        for proc in self._relays:
            try:
                async with asyncio.timeout(5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        self._relays.clear()

    def tx_bytes(self) -> list[int] | None:
        if self.netns is None:
            return None
        return [self.netns.tx_bytes(i) for i in range(NODES)]
