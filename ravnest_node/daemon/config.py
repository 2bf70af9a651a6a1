"""A node's configuration: what `ravnest-node start` takes from flags, environment and TOML
(settings.py maps all three onto these fields), checked before anything starts.

`NodeConfig` is a tree of sections, one concern each, each checked by itself; `NodeConfig`
checks only what spans sections. The node's own sections are flat (settings.py): their fields
keep the top-level TOML keys, RAVNEST_* names and flags they had before they were grouped.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from pathlib import Path

from ravnest_node.devices import resolve_device
from ravnest_node.discovery import valid_swarm_name
from ravnest_node.errors import ConfigError
from ravnest_node.logs import LogFormat, LogLevel
from ravnest_node.pipeline.run import TrainConfig, check_frame_limit, check_swarm_shape
from ravnest_node.protocol import DEFAULT_LEASE_S
from ravnest_node.transport.options import TransportConfig, split_host_port

JOIN_AUTO = "auto"
JOIN_ELECT = "elect"
MAX_PEERS = 64
DEFAULT_SWARM = "default"
"""The swarm name when none is given (a protected swarm's name comes from its credentials)."""
FLAT = {"flat": True}
"""Field metadata of a flat section (settings.py)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class DiscoveryConfig:
    """How this node finds its swarm's coordinator: given, looked for, or elected."""

    join: str | None = field(default=None, metadata={"flag": "--join"})
    """Coordinator to join: HOST:PORT, `auto` to find it over mDNS or through --peer, or `elect`.

    Without --join and --peer this node is the coordinator. With `elect` (and --mdns) the nodes
    of a LAN swarm, all started alike with the same --swarm-size, choose one among themselves."""
    peers: tuple[str, ...] = field(default=(), metadata={"flag": "--peer"})
    """Bootstrap HOST:PORT of any node of the swarm (repeatable); a node given one is a worker.

    Without --join it asks them for the coordinator's address."""
    mdns: bool = False
    """Advertise this node and look for its swarm's coordinator over mDNS (multicast DNS)."""
    mdns_interface: str | None = None
    """Interface IP for mDNS, e.g. 127.0.0.1 for a one-machine swarm (default: all interfaces)."""

    def __post_init__(self) -> None:
        if self.join is not None and self.join not in (JOIN_AUTO, JOIN_ELECT):
            split_host_port(self.join)
        if self.join == JOIN_ELECT and not self.mdns:
            raise ConfigError(
                "join='elect' chooses a coordinator among the nodes found over mDNS: add --mdns"
            )
        if len(self.peers) > MAX_PEERS:
            raise ConfigError(f"peers: {len(self.peers)} given, at most {MAX_PEERS}")
        for peer in self.peers:
            if split_host_port(peer)[1] == 0:
                raise ConfigError(f"peer {peer!r}: needs a real port, not 0")
        if self.join == JOIN_AUTO and not (self.mdns or self.peers):
            raise ConfigError(
                "join='auto' finds the coordinator over mDNS or through bootstrap peers: "
                "add --mdns (on a LAN) or --peer HOST:PORT"
            )
        if self.mdns_interface is not None:
            try:
                ipaddress.ip_address(self.mdns_interface)
            except ValueError:
                raise ConfigError(
                    f"mdns_interface={self.mdns_interface!r}: must be an IP address of this "
                    "machine, e.g. 127.0.0.1 or 192.168.1.10"
                ) from None

    @property
    def is_coordinator(self) -> bool:
        """No --join and no --peer: this node is the coordinator."""
        return self.join is None and not self.peers

    @property
    def elects(self) -> bool:
        """--join elect: this node may become the coordinator by election."""
        return self.join == JOIN_ELECT

    @property
    def finds_coordinator(self) -> bool:
        """A worker without a coordinator address: it looks over mDNS and asks its peers."""
        return self.join == JOIN_AUTO or (self.join is None and bool(self.peers))

    @property
    def join_address(self) -> str | None:
        """--join HOST:PORT: the coordinator's address as given (None for auto, elect, none)."""
        return None if self.join in (None, JOIN_AUTO, JOIN_ELECT) else self.join


@dataclass(kw_only=True, frozen=True, slots=True)
class MembershipConfig:
    """The swarm's membership: its size, this node's role in it, the coordinator's lease, and
    how long a member waits for the coordinator when it is silent or when leaving."""

    swarm_size: int = 1
    """Coordinator only: nodes to wait for before handing out the plan (itself included,
    unless it is a --coordinator-only lab coordinator)."""
    coordinator_only: bool = False
    """Only coordinate, hold no stage: what `ravnest-node coordinator` runs for a lab. It keeps
    membership, the plan and progress in --state-dir (SQLite) and, restarted, carries on."""
    coordinator_grace_s: float = 600.0
    """Worker: seconds to keep training and retrying reports while the coordinator does not
    answer (a lab coordinator being restarted); after that the run fails."""
    lease_s: float = DEFAULT_LEASE_S
    """On the coordinator: seconds a member stays a member without a heartbeat (members send
    one every third of it); before the plan, a member silent longer loses its place."""
    leave_timeout_s: float = 120.0
    """Worker with a stage: on SIGINT/SIGTERM it first leaves the swarm and stays (at most this
    long) until a plan without it has taken its blocks over; a second signal stops it at once."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coordinator_grace_s) and self.coordinator_grace_s >= 0):
            raise ConfigError(f"coordinator_grace_s={self.coordinator_grace_s}: must be >= 0")
        if not (math.isfinite(self.leave_timeout_s) and 0 <= self.leave_timeout_s <= 3600):
            raise ConfigError(f"leave_timeout_s={self.leave_timeout_s}: must be 0 to 3600")
        if not (math.isfinite(self.lease_s) and 0.3 <= self.lease_s <= 3600):
            raise ConfigError(f"lease_s={self.lease_s}: must be between 0.3 and 3600 seconds")
        if not 1 <= self.swarm_size <= 1024:
            raise ConfigError(f"swarm_size={self.swarm_size}: must be between 1 and 1024")


@dataclass(kw_only=True, frozen=True, slots=True)
class ComputeConfig:
    """What this node's compute may use: its device, threads, and the model files it may
    read."""

    device: str = "auto"
    """The device this node's stage computes on: auto (the first CUDA device, else MPS, else
    the CPU), cpu, cuda, cuda:N or mps. A device this machine lacks stops the node at start-up."""

    compute_threads: int = field(default=0, metadata={"flag": "--threads"})
    """Threads torch may use for this node's compute (0 = torch's default)."""
    model_dirs: tuple[str, ...] = field(default=(), metadata={"flag": "--model-dir"})
    """A directory of pretrained models and data this node may read (repeatable): a run whose
    model is `hf:DIR,...` is trained only if DIR and its data file lie inside one of these or
    inside the node's own --model (docs/fine-tuning.md). A coordinator cannot make a node read
    any other file."""

    def __post_init__(self) -> None:
        if self.compute_threads < 0:
            raise ConfigError(f"compute_threads={self.compute_threads}: must be >= 0")
        resolve_device(self.device)  # ConfigError naming the choices, before any network


@dataclass(kw_only=True, frozen=True, slots=True)
class LogConfig:
    """What the node logs, and how."""

    log_level: LogLevel = "info"
    """How much the node logs (to standard error)."""
    log_format: LogFormat = "text"
    """text: one line per event for people; json: one JSON object per line (time, level,
    logger, message, node_id), for a log collector."""


@dataclass(kw_only=True, frozen=True, slots=True)
class CheckpointConfig:
    """This node's checkpoints in --state-dir: whether it resumes from them, how many it keeps."""

    resume: bool = False
    """Carry on from this node's checkpoints in --state-dir: it offers them to the coordinator,
    which resumes the run at the newest step every block has a checkpoint of. Without it, a new
    run starts and checkpoints newer than its start are moved to checkpoints.previous/."""
    checkpoint_keep: int = 3
    """Checkpoints a node keeps in --state-dir/checkpoints (the newest; older ones are removed
    once a newer one is complete)."""

    def __post_init__(self) -> None:
        if not 1 <= self.checkpoint_keep <= 1000:
            raise ConfigError(f"checkpoint_keep={self.checkpoint_keep}: must be 1 to 1000")


@dataclass(kw_only=True, frozen=True, slots=True)
class RelayConfig:
    """Relays: the one this node is reached through (behind NAT), and the one it serves."""

    relay: str | None = None
    """Reach this node through a relay, HOST:PORT of a node started with --relay-listen: for a
    node behind NAT, which cannot accept connections. It opens every connection itself, and its
    address for the others is the port the relay opens for it (--advertise is not used)."""
    no_inbound: bool = False
    """This node cannot accept connections (behind NAT): it is reached through a relay, --relay
    or, without it, the one it chooses from the coordinator's offers (the lowest round trip). A
    coordinator refuses a node it cannot reach, with that advice."""
    relay_listen: str | None = None
    """Serve as a relay on HOST:PORT for nodes that cannot accept connections (--relay). The
    ports it opens for them are on this node's advertised (or listen) host, and their traffic
    crosses this node's link twice."""
    relay_ports: str | None = None
    """With --relay-listen: LOW-HIGH, the ports the relay opens for its nodes (one each), for a
    firewall that lets only those through (default: any port the system picks)."""

    def __post_init__(self) -> None:
        if self.relay is not None:
            split_host_port(self.relay)
        if self.relayed and self.relay_listen is not None:
            raise ConfigError(f"{self.relayed}: a node reached through a relay cannot be one")
        if self.relay_ports is not None:
            if self.relay_listen is None:
                raise ConfigError("relay_ports: only a relay opens ports: add --relay-listen")
            parse_port_range(self.relay_ports)
        if self.relay_listen is not None:
            split_host_port(self.relay_listen)

    @property
    def relayed(self) -> str:
        """The setting that makes this node reached through a relay ("relay" or "no_inbound"),
        or "" if it is reached at its own address."""
        return "relay" if self.relay is not None else "no_inbound" if self.no_inbound else ""


@dataclass(kw_only=True, frozen=True, slots=True)
class WebConfig:
    """The node's HTTP endpoint: Prometheus metrics and the swarm's live page."""

    metrics_port: int | None = None
    """Serve Prometheus metrics (/metrics) and a live page of the swarm (/) over HTTP on this
    port (0: any free one, written to ready.json as "metrics")."""
    metrics_host: str = "127.0.0.1"
    """Host the --metrics-port endpoint listens on; 0.0.0.0 lets other machines scrape it and
    open the page (plain HTTP without credentials: it shows what `status` shows)."""

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port={self.metrics_port}: must be 0 to 65535")


@dataclass(kw_only=True, frozen=True, slots=True)
class FaultConfig:
    """Test only: faults this node injects into itself."""

    fault_compute_scale: float = 1.0
    """Test only: multiply the compute time this node measures and reports to the planner."""
    fault_block_ms: float = 0.0
    """Test only: this node works this many ms longer per block of its stage and microbatch,
    as a slower machine would (a sleep: it costs no CPU), and its measurement includes it."""
    fault_fuzz_upstream: str = ""
    """Test only: a node id whose boundary streams this node checks frame by frame as its
    upstream's, against its stage as it trains, and never admits (tests/test_fuzz_live.py)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fault_block_ms) and 0 <= self.fault_block_ms <= 60_000):
            raise ConfigError(f"fault_block_ms={self.fault_block_ms}: must be 0 to 60000")
        if not (math.isfinite(self.fault_compute_scale) and self.fault_compute_scale > 0):
            raise ConfigError(f"fault_compute_scale={self.fault_compute_scale}: must be > 0")


@dataclass(kw_only=True, frozen=True, slots=True)
class NodeConfig:
    """One ravnest-node daemon."""

    listen: str = "127.0.0.1:0"
    """Address of this node's gRPC server, HOST:PORT; port 0 picks a free port."""
    advertise: str | None = None
    """Address other nodes use to reach this one (default: the listen address)."""
    state_dir: Path | None = None
    """Directory for this node's id and state files (default: none kept, a new id each start)."""
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig, metadata=FLAT)
    """How this node finds its swarm's coordinator."""
    membership: MembershipConfig = field(default_factory=MembershipConfig, metadata=FLAT)
    """The swarm's size, this node's role in it, leases and waits for the coordinator."""
    swarm_name: str = DEFAULT_SWARM
    """Name of the swarm: part of its id; over mDNS a node sees only nodes of the same name."""
    compute: ComputeConfig = field(default_factory=ComputeConfig, metadata=FLAT)
    """Threads and model files of this node's compute."""
    logs: LogConfig = field(default_factory=LogConfig, metadata=FLAT)
    """What the node logs, and how."""
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=FLAT)
    """This node's checkpoints."""
    relays: RelayConfig = field(default_factory=RelayConfig, metadata=FLAT)
    """Relays, for nodes behind NAT."""
    web: WebConfig = field(default_factory=WebConfig, metadata=FLAT)
    """The HTTP endpoint: metrics and the live page."""
    faults: FaultConfig = field(default_factory=FaultConfig, metadata=FLAT)
    """Test only: injected faults."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training run (used by the coordinator, which hands it to every node)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Limits and timeouts of the gRPC transport."""

    def __post_init__(self) -> None:
        split_host_port(self.listen)
        if self.advertise is not None:
            _, port = split_host_port(self.advertise)
            if port == 0:
                raise ConfigError(f"advertise={self.advertise!r}: needs a real port, not 0")
        if not valid_swarm_name(self.swarm_name):
            raise ConfigError(
                f"swarm_name={self.swarm_name[:80]!r}: must be 1 to 64 printable characters "
                "without '='"
            )
        self._check_lab_coordinator()
        self._check_relays()
        creds = self.transport.credentials
        if creds is not None and self.swarm_name != creds.swarm:
            if self.swarm_name != DEFAULT_SWARM:
                raise ConfigError(
                    f"swarm_name={self.swarm_name!r}, but the credentials are swarm "
                    f"{creds.swarm!r}'s: drop --swarm-name, or give that swarm's credentials"
                )
            object.__setattr__(self, "swarm_name", creds.swarm)  # frozen: set once, here
        if self.discovery.is_coordinator or self.discovery.elects:
            check_frame_limit(self.train, self.transport.max_message_bytes)
            check_swarm_shape(self.membership.swarm_size, self.train)

    def _check_lab_coordinator(self) -> None:
        """A lab coordinator (--coordinator-only), and what needs --state-dir."""
        lab = self.membership.coordinator_only
        if lab and (self.discovery.join is not None or self.discovery.peers):
            raise ConfigError(
                "coordinator_only: a lab coordinator joins nobody: drop --join/--peer"
            )
        if lab and self.state_dir is None:
            raise ConfigError(
                "coordinator_only: a lab coordinator keeps its state in --state-dir: give one"
            )
        if self.checkpoints.resume and self.state_dir is None:
            raise ConfigError("resume: checkpoints live in --state-dir: give the one used before")
        if self.checkpoints.resume and lab:
            raise ConfigError(
                "resume: a lab coordinator carries on from its --state-dir by itself; --resume "
                "is for nodes that train a stage"
            )

    def _check_relays(self) -> None:
        """Relays and the other sections: who may be reached through one, or serve one."""
        relays, discovery = self.relays, self.discovery
        if (
            relays.no_inbound
            and relays.relay is None
            and not (discovery.peers or discovery.join_address)
        ):
            raise ConfigError(
                "no_inbound: a node that cannot accept connections is reached through a relay; "
                "it asks the coordinator for one, so give --join HOST:PORT or --peer, or name "
                "one: --relay HOST:PORT (a reachable node started with --relay-listen)"
            )
        what = relays.relayed
        if what:
            if self.advertise is not None:
                raise ConfigError(
                    f"{what}: the relay gives this node its address: drop --advertise"
                )
            if discovery.is_coordinator or discovery.elects or self.membership.coordinator_only:
                raise ConfigError(
                    f"{what}: a coordinator must accept connections: start it on a reachable node "
                    "(a worker may use a relay)"
                )
            if discovery.mdns:
                raise ConfigError(f"{what}: mDNS would advertise this node's own address: drop "
                                  "--mdns (a LAN needs no relay)")  # fmt: skip
        if relays.relay_listen is not None:
            host, _ = split_host_port(relays.relay_listen)
            public = split_host_port(self.advertise)[0] if self.advertise else host
            if ipaddress_is_wildcard(public):
                raise ConfigError(
                    f"relay_listen={relays.relay_listen!r}: on a wildcard address, give "
                    "--advertise so the relay knows the host its ports are reached at"
                )


def parse_port_range(text: str) -> range:
    """The ports of "LOW-HIGH" (both included, 1 to 65535); ConfigError if it is not one."""
    low, sep, high = text.partition("-")
    if not (sep and low.isascii() and low.isdigit() and high.isascii() and high.isdigit()):
        raise ConfigError(f"relay_ports={text!r}: give LOW-HIGH, e.g. 7100-7115")
    if not 1 <= int(low) <= int(high) <= 65535:
        raise ConfigError(f"relay_ports={text!r}: need 1 <= LOW <= HIGH <= 65535")
    return range(int(low), int(high) + 1)


def is_address(text: str) -> bool:
    try:
        split_host_port(text)
    except ConfigError:
        return False
    return True


def ipaddress_is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")
