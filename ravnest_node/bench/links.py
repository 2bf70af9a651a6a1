"""Emulated home links: network namespaces on one bridge, each host's link capped with `tbf`.

Layout of one `NetnsSwarm` (k picks a free /24 of 10.213.0.0/16; `name` is a short prefix)::

    root namespace             hub namespace "<name><k>-<pid>-hub"     host namespaces
    <name><k>c 10.213.k.254 -- ctl -+- br0
      (control veth, uncapped)      +- p0 (tbf) ------------------ eth0 (tbf) 10.213.k.1  "...-h0"
                                    +- p1 (tbf) ------------------ eth0 (tbf) 10.213.k.2  "...-h1"

Bandwidth comes from `tbf` in the kernel, on both ends of each host's veth, so a host's link is
capped in both directions (on links under 5 Mbit/s the veths send one MTU per packet, so the
bucket is a few frames rather than a 64 KiB GSO packet). This kernel has no `netem`, so
propagation delay is not added here: `relay.py` adds it in user space. The root namespace only
gains the control veth, which the harness uses to reach hosts for control traffic; benchmark
data should flow host to host.

Names carry the owner's pid, so `remove_leftovers` can tell a killed run's namespaces from those
of a run that is still alive. All commands run `ip`/`tc` and block for a few milliseconds each;
a swarm of n hosts takes about 10 + 8n of them to build.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

# The /16 our namespaces take addresses from; each swarm takes one free /24 of it.
NET_PREFIX = "10.213"
# Address of the root namespace's control veth inside a swarm's /24.
CONTROL_HOST_OCTET = 254
# Queue a tbf may hold before it drops, as time at the link rate (a home router's buffer).
TBF_LATENCY_MS = 100
# tbf's bucket must hold at least one packet of the largest size the interface sends (GSO/TSO
# make veth packets up to 64 KiB), else the link stalls; faster links need a deeper bucket so the
# kernel's timer granularity does not cap the rate.
TBF_MIN_BURST_BYTES = 64 * 1024
TBF_BURST_S = 0.002
# Below this rate a 64 KiB bucket is over 0.1 s of the link: a burst that size would pass idle
# gaps' worth of traffic (and a link probe) at wire speed. There the veths send packets of one
# MTU (no GSO) and the bucket holds a few of them.
SEGMENT_BELOW_MBIT = 5.0
FRAME_BYTES = 1514
"""A full Ethernet frame on the veth: 1500 bytes of IP packet and a 14-byte header."""
TBF_SEGMENTED_BURST_FRAMES = 4
# However slow the link, its queue holds this many full frames (at 0.2 Mbit/s one frame is 61 ms
# of link time, and a 100 ms queue would hold a single one).
TBF_MIN_QUEUE_FRAMES = 16
HOST_IFNAME = "eth0"
BRIDGE_IFNAME = "br0"
HUB_CONTROL_IFNAME = "ctl"
MAX_HOSTS = CONTROL_HOST_OCTET - 1
IFNAMSIZ = 15
_NAME_RE = re.compile(r"[a-z]{1,8}")
_LOCK_PATH = Path(tempfile.gettempdir()) / "ravnest-netns.lock"
_CMD_TIMEOUT_S = 10.0
# `netns_available` builds its throwaway namespace under this name; any prefix's cleanup removes
# it if the probing process died.
_PROBE_NAME = "rvprobe"


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One emulated link: what a host's connection to the others looks like."""

    rate_mbit: float
    """Bandwidth in Mbit/s (10^6 bit/s), per direction, of each host's link."""
    delay_ms: float
    """One-way propagation delay in ms; added by the relay (`relay.py`), not by the kernel."""

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"LinkSpec.rate_mbit must be > 0 Mbit/s, got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"LinkSpec.delay_ms must be >= 0 ms, got {self.delay_ms}")

    @property
    def rate_bps(self) -> float:
        """The rate in bit/s."""
        return self.rate_mbit * 1e6

    @property
    def delay_s(self) -> float:
        """The one-way delay in seconds."""
        return self.delay_ms / 1e3


SCENARIOS: dict[str, LinkSpec] = {
    "lan": LinkSpec(1000, 1),
    "home": LinkSpec(50, 20),
    "internet": LinkSpec(10, 50),
    "mobile": LinkSpec(2, 80),
}


def dilate(link: LinkSpec, factor: float) -> LinkSpec:
    """`link` with every transfer time stretched by `factor`: rate / factor, delay x factor.

    What `bench --gpu-like F` emulates: compute F times faster relative to the link is, on this
    machine, the link F times slower with compute as it is; the ratios to compute-bound then
    are those of a node F times faster than this one on `link`."""
    if not factor >= 1:
        raise ValueError(f"a time dilation factor must be >= 1, got {factor}")
    return LinkSpec(link.rate_mbit / factor, link.delay_ms * factor)


@dataclass(frozen=True, slots=True)
class Host:
    """One emulated machine: a network namespace with one capped link to the bridge."""

    ns: str
    """Name of its network namespace (`ip netns exec <ns> ...`)."""
    address: str
    """Its IPv4 address on the swarm's /24, without prefix length."""
    ifname: str
    """Name of its end of the link inside `ns` (for interface counters, GLOO_SOCKET_IFNAME)."""


class CommandFailed(RuntimeError):
    """An `ip`/`tc` command failed; the message has the command and what it printed."""


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise CommandFailed(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def segmented(rate_mbit: float) -> bool:
    """Whether a link of `rate_mbit` sends packets of one MTU (GSO off on its veths), so that
    its tbf bucket can be a few frames rather than 64 KiB."""
    return rate_mbit < SEGMENT_BELOW_MBIT


def tbf_args(rate_mbit: float) -> list[str]:
    """The `tc qdisc ... tbf` parameters for a cap of `rate_mbit` (burst and queue included).

    The bucket always holds the largest packet the veth sends (64 KiB, or one frame where
    `segmented`), and tbf's queue limit is the bucket plus `latency` at the rate, so no packet
    is too large to pass; the latency is at least TBF_MIN_QUEUE_FRAMES frames' time."""
    rate_bytes_per_s = rate_mbit * 1e6 / 8
    least = (
        TBF_SEGMENTED_BURST_FRAMES * FRAME_BYTES if segmented(rate_mbit) else TBF_MIN_BURST_BYTES
    )
    burst = max(least, int(rate_bytes_per_s * TBF_BURST_S))
    latency_ms = max(
        TBF_LATENCY_MS, math.ceil(TBF_MIN_QUEUE_FRAMES * FRAME_BYTES / rate_bytes_per_s * 1e3)
    )
    rate = f"{round(rate_mbit * 1000)}kbit"
    return ["tbf", "rate", rate, "burst", str(burst), "latency", f"{latency_ms}ms"]


def netns_available() -> tuple[bool, str]:
    """(True, "") if namespaces, veth pairs and tbf can be used here, else (False, why not).

    Builds and deletes a throwaway namespace; takes some tens of milliseconds.
    """
    if os.geteuid() != 0:
        return False, "network namespaces need root (this process is not running as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed or not on PATH"
    ns = f"{_PROBE_NAME}0-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", ns])
    except (CommandFailed, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "-n", ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "probe0", "root", *tbf_args(50)])
    except (CommandFailed, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot cap a veth link with tbf: {exc}"
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    return True, ""


def iptables_available() -> tuple[bool, str]:
    """(True, "") if `NetnsSwarm.lossy` can drop packets here (namespaces usable, iptables
    installed with its statistic match), else (False, why not). Takes tens of milliseconds."""
    ok, why = netns_available()
    if not ok:
        return ok, why
    if shutil.which("iptables") is None:
        return False, "`iptables` is not installed or not on PATH (apt-get install iptables)"
    ns = f"{_PROBE_NAME}0-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "netns", "exec", ns, "iptables", "-A", "OUTPUT", *_loss_rule(0.5)])
    except (CommandFailed, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot drop packets with iptables' statistic match: {exc}"
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    return True, ""


def _loss_rule(share: float) -> list[str]:
    return ["-m", "statistic", "--mode", "random", "--probability", f"{share:.6f}", "-j", "DROP"]


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_link_names() -> list[str]:
    out = _run(["ip", "-o", "link", "show"]).stdout
    names = []
    for line in out.splitlines():
        # "12: rvb3c@if11: <...>" -> "rvb3c"
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _owner(name: str, ns: str) -> tuple[str, int] | None:
    """(k, owner pid) if `ns` is a namespace a swarm named `name` (or a probe) creates."""
    m = re.fullmatch(rf"{re.escape(name)}(\d+)-(\d+)-(?:hub|h\d+)", ns) or re.fullmatch(
        rf"{_PROBE_NAME}(0)-(\d+)-probe", ns
    )
    return None if m is None else (m.group(1), int(m.group(2)))


def _control_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(name)}(\d+)c")


def _check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"name must be 1-8 lowercase letters (it prefixes interface names), got {name!r}"
        )


def remove_leftovers(name: str = "rvb") -> list[str]:
    """Delete the namespaces and root-namespace links that runs named `name` left behind.

    Only removes what belongs to runs whose process is gone (a run killed before its teardown);
    swarms of live processes, this one's included, are left alone. Returns what was removed,
    namespaces as their names and links as "link:<name>".
    """
    _check_name(name)
    ctl_re = _control_re(name)
    removed: list[str] = []
    live_k: set[str] = set()
    dead_ns: list[str] = []
    for ns in _netns_names():
        owner = _owner(name, ns)
        if owner is None:
            continue
        if _pid_alive(owner[1]):
            live_k.add(owner[0])
        else:
            dead_ns.append(ns)
    # Control links first: deleting one end of a veth deletes its peer at once, while a deleted
    # namespace's veths go away asynchronously.
    for link in _root_link_names():
        m = ctl_re.fullmatch(link)
        if m is None or m.group(1) in live_k:
            continue
        proc = _run(["ip", "link", "del", link], check=False)
        if proc.returncode == 0:
            removed.append(f"link:{link}")
        else:
            log.warning("could not delete link %s: %s", link, proc.stderr.strip())
    # Host namespaces first, the hub (which holds the other veth ends) last.
    for ns in sorted(dead_ns, key=lambda n: n.endswith("-hub")):
        proc = _run(["ip", "netns", "del", ns], check=False)
        if proc.returncode == 0:
            removed.append(ns)
        else:
            log.warning("could not delete namespace %s: %s", ns, proc.stderr.strip())
    return removed


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Serialises subnet choice between processes (flock; released if the process dies)."""
    with open(_LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _used_subnets() -> set[int]:
    """Third octets of 10.213.x.0/24 subnets in use: root addresses and swarm namespaces."""
    used: set[int] = set()
    addr_re = re.compile(rf"inet {re.escape(NET_PREFIX)}\.(\d+)\.")
    for m in addr_re.finditer(_run(["ip", "-o", "-4", "addr", "show"]).stdout):
        used.add(int(m.group(1)))
    any_ns = re.compile(r"[a-z]+(\d+)-\d+-(?:hub|h\d+)")
    for ns in _netns_names():
        if m2 := any_ns.fullmatch(ns):
            used.add(int(m2.group(1)))
    return used


class NetnsSwarm:
    """`hosts` network namespaces on one bridge, each host's link capped at `link.rate_mbit`.

    The bridge lives in its own hub namespace, so the root namespace's networking is untouched
    except for one uncapped control veth with address `control_address`, through which a process
    in the root namespace reaches every host (for control traffic only). Each host's link is
    capped with tbf in both directions: host egress on the host-side veth, host ingress on the
    hub-side veth. Host i has address 10.213.<k>.<i+1>/24, k picked so that concurrent swarms do
    not collide. Loopback is up in every namespace. `link.delay_ms` is not applied here (no
    netem on this kernel); put a `relay.Relay` on the path for delay.

    Use as a context manager: `__enter__` builds everything (raising `CommandFailed` or
    `RuntimeError` after removing what it built), `__exit__` always tears down and logs, rather
    than raises, errors of the teardown. Needs root; see `netns_available`.
    """

    def __init__(
        self,
        hosts: int,
        link: LinkSpec,
        *,
        name: str = "rvb",
        rates_mbit: Sequence[float] | None = None,
    ) -> None:
        """`rates_mbit`, if given, caps host i's link at `rates_mbit[i]` instead."""
        _check_name(name)
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
        rates = list(rates_mbit) if rates_mbit is not None else [link.rate_mbit] * hosts
        if len(rates) != hosts:
            raise ValueError(f"rates_mbit gives {len(rates)} rates for {hosts} hosts")
        self._rates = [LinkSpec(rate, link.delay_ms).rate_mbit for rate in rates]  # checked
        self._n = hosts
        self._link = link
        self._name = name
        self._k: int | None = None
        self._hosts: list[Host] = []
        self._hub = ""
        self._control_if = ""
        self._created_ns: list[str] = []
        self._loss: dict[int, float] = {}
        """Host -> the share of packets `lossy` drops there."""

    @property
    def link(self) -> LinkSpec:
        return self._link

    @property
    def hosts(self) -> list[Host]:
        """The hosts, in index order (only valid inside the `with` block)."""
        self._require_up()
        return list(self._hosts)

    @property
    def control_address(self) -> str:
        """The root namespace's address on the swarm's /24 (uncapped; for control traffic)."""
        self._require_up()
        return f"{NET_PREFIX}.{self._k}.{CONTROL_HOST_OCTET}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this swarm created, the hub included."""
        return list(self._created_ns)

    @property
    def control_ifname(self) -> str:
        """Name of the control veth in the root namespace."""
        self._require_up()
        return self._control_if

    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside host i's namespace."""
        return ["ip", "netns", "exec", self.hosts[i].ns]

    def tx_bytes(self, i: int) -> int:
        """Bytes host i has sent on its link so far (its veth counter: headers included)."""
        host = self.hosts[i]
        out = _run(["ip", "-n", host.ns, "-s", "-j", "link", "show", "dev", host.ifname]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    # ----- faults (tests and the bench: issue #34, "Home networks flap") ---------------------
    def link_down(self, i: int) -> None:
        """Cut host i off: its link goes down (`ip link set eth0 down` in its namespace), as a
        home router's does. Its connected route goes with it: connects fail at once with
        "Network is unreachable", sockets in flight see silence."""
        host = self.hosts[i]
        _run(["ip", "-n", host.ns, "link", "set", host.ifname, "down"])

    def link_up(self, i: int) -> None:
        """Host i's link comes back (its address and route with it)."""
        host = self.hosts[i]
        _run(["ip", "-n", host.ns, "link", "set", host.ifname, "up"])

    def flap(self, i: int, seconds: float) -> None:
        """Host i's link down for `seconds`, then up again (blocking; up even if interrupted)."""
        self.link_down(i)
        try:
            time.sleep(seconds)  # the outage itself: nothing to wait for
        finally:
            self.link_up(i)

    def lossy(self, i: int, share: float) -> None:
        """Host i drops `share` (0 to 1) of its packets each way, at random (iptables'
        statistic match on OUTPUT and INPUT in its namespace; this kernel has no netem). Needs
        `iptables_available`; `clear_loss` ends it, and the namespace's teardown would too."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        for chain in ("OUTPUT", "INPUT"):
            _run([*self.exec_prefix(i), "iptables", "-A", chain, *_loss_rule(share)])
        self._loss[i] = share

    def clear_loss(self, i: int) -> None:
        """Host i loses no packets any more (the rules `lossy` added are deleted)."""
        share = self._loss.pop(i, None)
        if share is None:
            return
        for chain in ("OUTPUT", "INPUT"):
            _run([*self.exec_prefix(i), "iptables", "-D", chain, *_loss_rule(share)])

    def _require_up(self) -> None:
        if self._k is None:
            raise RuntimeError("NetnsSwarm is not set up: use it in a `with` block")

    def __enter__(self) -> NetnsSwarm:
        try:
            self._build()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._teardown()

    def _build(self) -> None:
        if self._k is not None:
            raise RuntimeError("NetnsSwarm is already set up; it cannot be entered twice")
        pid = os.getpid()
        with _subnet_lock():
            used = _used_subnets()
            free = [k for k in range(1, 255) if k not in used]
            if not free:
                raise RuntimeError(f"no free /24 left in {NET_PREFIX}.0.0/16")
            k = free[0]
            base = f"{self._name}{k}-{pid}"
            self._hub = f"{base}-hub"
            self._control_if = f"{self._name}{k}c"
            assert len(self._control_if) <= IFNAMSIZ
            self._add_ns(self._hub)
            # Claim k under the lock: the control address is what `_used_subnets` finds.
            _run(["ip", "link", "add", self._control_if, "type", "veth",
                  "peer", "name", HUB_CONTROL_IFNAME, "netns", self._hub])  # fmt: skip
            self._k = k
            _run(["ip", "addr", "add", f"{self.control_address}/24", "dev", self._control_if])
        hub = ["ip", "-n", self._hub]
        _run([*hub, "link", "set", "lo", "up"])
        _run([*hub, "link", "add", BRIDGE_IFNAME, "type", "bridge"])
        _run([*hub, "link", "set", BRIDGE_IFNAME, "up"])
        _run([*hub, "link", "set", HUB_CONTROL_IFNAME, "master", BRIDGE_IFNAME, "up"])
        _run(["ip", "link", "set", self._control_if, "up"])
        for i in range(self._n):
            tbf = tbf_args(self._rates[i])
            ns = f"{base}-h{i}"
            port = f"p{i}"
            address = f"{NET_PREFIX}.{k}.{i + 1}"
            self._add_ns(ns)
            host = ["ip", "-n", ns]
            _run([*hub, "link", "add", port, "type", "veth",
                  "peer", "name", HOST_IFNAME, "netns", ns])  # fmt: skip
            _run([*hub, "link", "set", port, "master", BRIDGE_IFNAME, "up"])
            if segmented(self._rates[i]):  # packets of one MTU, for the bucket of a few frames
                _run([*hub, "link", "set", port, "gso_max_segs", "1"])
            _run(["tc", "-n", self._hub, "qdisc", "add", "dev", port, "root", *tbf])
            _run([*host, "link", "set", "lo", "up"])
            _run([*host, "addr", "add", f"{address}/24", "dev", HOST_IFNAME])
            if segmented(self._rates[i]):
                _run([*host, "link", "set", HOST_IFNAME, "gso_max_segs", "1"])
            _run([*host, "link", "set", HOST_IFNAME, "up"])
            _run(["tc", "-n", ns, "qdisc", "add", "dev", HOST_IFNAME, "root", *tbf])
            self._hosts.append(Host(ns=ns, address=address, ifname=HOST_IFNAME))
        log.info("netns swarm %s: %d hosts on %s.%d.0/24 at %s Mbit/s", base, self._n,
                 NET_PREFIX, k, self._rates)  # fmt: skip

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created_ns.append(ns)
        # No IPv6 in our namespaces: router solicitations and MLD reports would add stray bytes
        # to the link counters.
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
              "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
             check=False)  # fmt: skip

    def _teardown(self) -> None:
        # The control veth first: deleting one end of a veth pair deletes both at once, while the
        # veths of a deleted namespace go away asynchronously.
        if self._control_if:
            try:
                if self._control_if in _root_link_names():
                    _run(["ip", "link", "del", self._control_if])
            except Exception as exc:  # teardown must go on: log, do not raise
                log.error("could not delete link %s: %s", self._control_if, exc)
        # Hosts, then the hub.
        for ns in sorted(self._created_ns, key=lambda n: n.endswith("-hub")):
            try:
                pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
                if pids:
                    log.warning(
                        "processes %s still run in namespace %s: it lives on until they exit",
                        " ".join(pids),
                        ns,
                    )
                _run(["ip", "netns", "del", ns])
            except Exception as exc:  # teardown must go on: log, do not raise
                log.error("could not delete namespace %s: %s", ns, exc)
        self._created_ns.clear()
        self._loss.clear()
        self._hosts.clear()
        self._k = None
