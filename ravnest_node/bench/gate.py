"""How fast the TLS gate of a protected swarm moves bytes, against a plain loopback connection:
`python -m ravnest_node.bench.gate [MB]`. One client sends MB mebibytes through each path to a
sink that counts them (both ends in this process, like a node's gRPC server behind its gate),
and the figures are printed side by side. On loopback the link costs nothing, so this is the
gate's own ceiling: a link slower than it is not slowed by the gate. The client's encryption
runs on the same event loop and core as the gate, so the ceiling is understated.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import tempfile
import time
from pathlib import Path

from ravnest_node.transport.credentials import TLS_NAME, create_swarm
from ravnest_node.transport.gate import TlsGate

CHUNK = 256 * 1024


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read an 8-byte count, then that many bytes; answer with the count."""
    expected = int.from_bytes(await reader.readexactly(8), "big")
    total = 0
    while total < expected and (data := await reader.read(CHUNK)):
        total += len(data)
    writer.write(total.to_bytes(8, "big"))
    await writer.drain()
    writer.close()


async def _send(port: int, nbytes: int, tls: ssl.SSLContext | None) -> float:
    """Seconds to push `nbytes` to 127.0.0.1:`port` until the sink says it has them all."""
    extra: dict[str, object] = {"ssl": tls, "server_hostname": TLS_NAME} if tls else {}
    reader, writer = await asyncio.open_connection("127.0.0.1", port, **extra)  # type: ignore[arg-type]
    chunk = bytes(CHUNK)
    started = time.perf_counter()
    writer.write(nbytes.to_bytes(8, "big"))
    for _ in range(nbytes // CHUNK):
        writer.write(chunk)
        await writer.drain()
    counted = int.from_bytes(await reader.readexactly(8), "big")
    elapsed = time.perf_counter() - started
    writer.close()
    if counted != nbytes:
        raise RuntimeError(f"the sink counted {counted} of {nbytes} bytes")
    return elapsed


async def main(mib: int) -> None:
    nbytes = mib * 2**20
    with tempfile.TemporaryDirectory() as tmp:
        creds = create_swarm("bench", Path(tmp) / "swarm")
    sink = await asyncio.start_server(_sink, "127.0.0.1", 0)
    port = int(sink.sockets[0].getsockname()[1])
    gate = TlsGate("127.0.0.1", 0, ("127.0.0.1", port), creds.server_context())
    gate_port = await gate.start()
    try:
        plain = await _send(port, nbytes, None)
        tls = await _send(gate_port, nbytes, creds.client_context())
    finally:
        await gate.close()
        sink.close()
    print(f"{mib} MiB over loopback, one connection:")
    print(f"  plain TCP:              {mib / plain:8.0f} MiB/s")
    print(f"  mutual TLS, the gate:   {mib / tls:8.0f} MiB/s ({tls / plain:.1f}x the time)")
    print(f"  the gate's ceiling in bits: {8 * mib * 1.048576 / tls:.0f} Mbit/s")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 256))
