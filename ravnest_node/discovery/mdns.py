"""mDNS with python-zeroconf's async API: advertise this node, browse for nodes of its swarm.

`MdnsDiscovery` is an async context manager. Entering it opens the zeroconf sockets on the
chosen interface (StartupError if that fails) and starts browsing for `SERVICE_TYPE`; `run()`,
a task of the node's TaskGroup, registers this node's service and resolves what the browser
reports; leaving it sends goodbye packets and closes the sockets.

Zeroconf calls the browser's handler on the event loop, so the handler never blocks: it queues
the name (bounded; a flood is dropped) or forgets a removed one. Names are resolved with
`AsyncServiceInfo.async_request` in tasks of `run()`, at most MAX_RESOLVING at once. A resolved
record is read by the pure functions of records.py; what they refuse is logged at debug level
and counted, never raised.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass, replace
from types import TracebackType

import ifaddr
import zeroconf
from zeroconf import InterfaceChoice, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from ravnest_node.discovery.base import ChangeSignal
from ravnest_node.discovery.records import (
    SERVICE_TYPE,
    Ignored,
    PeerRecord,
    Role,
    TxtRecord,
    encode_txt,
    parse_txt,
    peer_addresses,
)
from ravnest_node.errors import StartupError

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_MS = 3000
REGISTER_WAIT_S = 10.0
# Bounds against a noisy or hostile LAN: records kept, names waiting, resolutions at once.
MAX_RECORDS = 256
MAX_PENDING = 256
MAX_RESOLVING = 16
MAX_LABEL = 63  # a DNS label


@dataclass(frozen=True, slots=True)
class Advertisement:
    """What this node announces: its TXT keys, gRPC port and IP addresses."""

    txt: TxtRecord
    port: int
    ips: tuple[str, ...]


async def advertised_ips(host: str, interface: str | None) -> tuple[str, ...]:
    """The IP addresses to announce for a gRPC server reachable at `host`: that IP; for a
    wildcard (0.0.0.0, ::) the mDNS interface, or every non-loopback address of this machine;
    for a host name its resolved addresses. StartupError if a host name does not resolve."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and not ip.is_unspecified:
        return (str(ip),)
    if interface:
        return (interface,)
    if ip is None:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, None, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            raise StartupError(f"cannot resolve {host!r} to advertise it: {exc}") from None
        return tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    found: list[str] = []
    for adapter in ifaddr.get_adapters():  # getifaddrs(): a local call, no I/O
        for entry in adapter.ips:
            if not isinstance(entry.ip, str):  # IPv6 entries are (ip, flowinfo, scope)
                if ip.version != 6:
                    continue
                candidate = ipaddress.ip_address(entry.ip[0])
            else:
                candidate = ipaddress.ip_address(entry.ip)
            if not (candidate.is_loopback or candidate.is_link_local):
                found.append(str(candidate))
    return tuple(dict.fromkeys(found)) or ("127.0.0.1",)


def _drop_queued_answers(zc: Zeroconf) -> None:
    """Drop the multicast answers zeroconf holds back to send later, before the goodbyes.

    A responder sends a multicast answer 20-120 ms after the query, and over a second later for
    records it multicast within the last second (RFC 6762 sections 6 and 14); python-zeroconf
    (0.154) keeps such answers in queues that unregistering does not empty. An answer queued
    just before the goodbye then goes out after it and brings the record back at every
    listener, which also drops the goodbye's repeats as duplicates of the first: the stopped
    node would stay listed for the record's TTL (75 minutes for the service's pointer). Seen
    as a worker still counted by its coordinator 10 s after it stopped, and reproduced with
    three zeroconf instances (a fresh browser's query about a second before the close: 2 in 25
    closes). The queues are zeroconf's own attributes, not its API: a version without them
    is left as it is (the race then stays)."""
    for name in ("out_queue", "out_delay_queue"):
        pending = getattr(getattr(zc, name, None), "queue", None)
        if pending is not None:
            pending.clear()


class MdnsDiscovery:
    """Advertises one node (optional) and keeps the records of the other nodes of its swarm.

    Implements `Discovery`. Use as `async with MdnsDiscovery(...) as mdns:` and run
    `mdns.run()` as a task inside it; records appear as the browser finds them."""

    def __init__(
        self,
        *,
        swarm: str,
        protocol: str,
        interface: str | None = None,
        advertisement: Advertisement | None = None,
    ) -> None:
        self._swarm = swarm
        self._protocol = protocol
        self._interface = interface
        self._advertisement = advertisement
        self._own_id = advertisement.txt.node_id if advertisement else None
        self._records: dict[str, PeerRecord] = {}  # by service name
        self._pending: asyncio.Queue[str] = asyncio.Queue(MAX_PENDING)
        self._queued: set[str] = set()
        self._in_flight: set[str] = set()
        # Names removed while queued or being resolved: a late answer must not bring them back.
        self._gone: set[str] = set()
        self._signal = ChangeSignal()
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self.registered = asyncio.Event()
        """Set once this node's advertisement has been announced."""
        self._registered_info: AsyncServiceInfo | None = None
        self.ignored = 0
        """Records refused so far (another swarm, malformed, unreachable...)."""

    @property
    def where(self) -> str:
        return self._interface or "all interfaces"

    # ----- Discovery ------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self._signal.generation

    def records(self) -> list[PeerRecord]:
        return sorted(self._records.values(), key=lambda r: r.txt.node_id)

    async def wait_newer(self, generation: int, timeout_s: float) -> None:
        await self._signal.wait_newer(generation, timeout_s)

    def describe(self) -> str:
        roles = [r.txt.role for r in self._records.values()]
        return (
            f"mDNS on {self.where} ({roles.count('coordinator')} coordinator and "
            f"{roles.count('worker')} worker records of swarm {self._swarm!r}, "
            f"{self.ignored} records ignored)"
        )

    # ----- lifetime -------------------------------------------------------------------------
    async def __aenter__(self) -> MdnsDiscovery:
        interfaces = [self._interface] if self._interface else InterfaceChoice.All
        try:
            aiozc = AsyncZeroconf(interfaces=interfaces)
        except OSError as exc:
            raise StartupError(
                f"cannot start mDNS on {self.where}: {exc.strerror or exc}"
            ) from None
        self._aiozc = aiozc
        self._browser = AsyncServiceBrowser(
            aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_change]
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._aiozc is not None:
            # No await between the two: no query is answered after the queues are emptied.
            _drop_queued_answers(self._aiozc.zeroconf)
            await self._aiozc.async_unregister_all_services()  # goodbyes for our service
            await self._aiozc.async_close()

    async def run(self) -> None:
        """Announce this node and resolve what the browser finds, until cancelled."""
        aiozc = self._aiozc
        if aiozc is None:
            raise RuntimeError("MdnsDiscovery.run() needs `async with` around it")
        slots = asyncio.Semaphore(MAX_RESOLVING)
        async with asyncio.TaskGroup() as tg:
            if self._advertisement is not None:
                tg.create_task(self._register(aiozc, self._advertisement))
            while True:
                name = await self._pending.get()
                await slots.acquire()
                tg.create_task(self._resolve(aiozc, name, slots))

    def _service_info(self, ad: Advertisement) -> AsyncServiceInfo:
        """The service for `ad`; after registration, under the name and host it was given."""
        done = self._registered_info
        return AsyncServiceInfo(
            SERVICE_TYPE,
            done.name if done else f"{ad.txt.node_id[:MAX_LABEL]}.{SERVICE_TYPE}",
            port=ad.port,
            properties=encode_txt(ad.txt),
            server=done.server if done else None,
            parsed_addresses=list(ad.ips),
        )

    async def set_role(self, role: Role, timeout_s: float = REGISTER_WAIT_S) -> None:
        """Advertise this node with another role (an elected coordinator), once its first
        announcement is out (waited for up to `timeout_s`)."""
        ad, aiozc = self._advertisement, self._aiozc
        if ad is None or aiozc is None:
            raise RuntimeError("set_role() needs an advertisement and `async with`")
        self._advertisement = ad = replace(ad, txt=replace(ad.txt, role=role))
        try:
            async with asyncio.timeout(timeout_s):
                await self.registered.wait()
        except TimeoutError:
            log.error("mDNS: this node was not announced within %g s; role not updated", timeout_s)
            return
        try:
            await aiozc.async_update_service(self._service_info(ad))
        except zeroconf.Error as exc:
            log.error("cannot update this node's mDNS record on %s: %r", self.where, exc)
            return
        log.info("advertising %s %s over mDNS from now on", role, ad.txt.node_id)

    async def _register(self, aiozc: AsyncZeroconf, ad: Advertisement) -> None:
        info = self._service_info(ad)
        try:
            # Probing for a unique name takes about 1.2 s; then the announcement goes out.
            announced = await aiozc.async_register_service(info, allow_name_change=True)
            await announced
        except zeroconf.Error as exc:
            log.error("cannot advertise this node over mDNS on %s: %r", self.where, exc)
            return
        log.info(
            "advertising %s %s of swarm %r over mDNS on %s (%s, port %d)",
            ad.txt.role, ad.txt.node_id, ad.txt.swarm, self.where, ", ".join(ad.ips), ad.port,
        )  # fmt: skip
        self._registered_info = info
        self.registered.set()

    # ----- browsing -------------------------------------------------------------------------
    def _on_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        """Zeroconf's handler, on the event loop: queue or forget, never block."""
        log.debug("mDNS: %s %s", state_change.name.lower(), name[:100])
        if state_change is ServiceStateChange.Removed:
            if name in self._queued or name in self._in_flight:
                self._gone.add(name)
            if self._records.pop(name, None) is not None:
                self._signal.bump()
            return
        self._gone.discard(name)
        if name in self._queued:
            return
        try:
            self._pending.put_nowait(name)
        except asyncio.QueueFull:
            self._ignore(name, "too many names waiting to be resolved")
            return
        self._queued.add(name)

    async def _resolve(self, aiozc: AsyncZeroconf, name: str, slots: asyncio.Semaphore) -> None:
        self._queued.discard(name)  # an update from now on queues it again
        self._in_flight.add(name)
        try:
            if name in self._gone:
                return  # removed while it waited
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            answered = await info.async_request(aiozc.zeroconf, RESOLVE_TIMEOUT_MS)
            if name in self._gone:
                return  # removed meanwhile
            if not answered:
                self._ignore(name, "no answer when resolved")
                return
            self._take(name, info)
        except zeroconf.Error as exc:  # e.g. a malformed name
            self._ignore(name, repr(exc))
        finally:
            self._in_flight.discard(name)
            if name not in self._queued:
                self._gone.discard(name)
            slots.release()

    def _take(self, name: str, info: AsyncServiceInfo) -> None:
        txt = parse_txt(info.properties, swarm=self._swarm, protocol=self._protocol)
        if isinstance(txt, Ignored):
            self._ignore(name, txt.reason)
            return
        if txt.node_id == self._own_id:
            return
        addresses = peer_addresses(info.parsed_addresses(), info.port)
        if isinstance(addresses, Ignored):
            self._ignore(name, addresses.reason)
            return
        if name not in self._records and len(self._records) >= MAX_RECORDS:
            self._ignore(name, f"already {MAX_RECORDS} records")
            return
        record = PeerRecord(txt=txt, addresses=addresses)
        if self._records.get(name) != record:
            self._records[name] = record
            log.debug("mDNS: %s %s at %s", txt.role, txt.node_id, ", ".join(addresses))
            self._signal.bump()

    def _ignore(self, name: str, reason: str) -> None:
        self.ignored += 1
        if self._records.pop(name, None) is not None:
            self._signal.bump()
        log.debug("mDNS: ignoring %r: %s", name[:100], reason)
