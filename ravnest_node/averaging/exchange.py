"""The averaging exchange: members of a replica group push compressed deltas to each other.

Each push (wire.py) is one tensor frame of kind DELTA: `seq` = the round, `version` = the
sender's optimizer step, one float32 tensor named after the part of the round it is (inbox.py).
A sender that is not a member of the group is refused with PERMISSION_DENIED, a frame that does
not parse or does not fit (shape, dtype, name, non-finite values) with INVALID_ARGUMENT, a round
further ahead than the next one with OUT_OF_RANGE and a second copy of a part with
ALREADY_EXISTS; frames of finished rounds are dropped quietly (inbox.py).

`ReplicaAverager.average` runs one round: all-to-all for groups of up to 4 members, a ring
all-reduce for larger ones (topology.py). A round waits at most `timeout_s` for the others and
then completes with the members it heard from. A ring that breaks (a push fails, a part does not
arrive within half of `timeout_s`, a member sends its whole delta) falls back, for that round,
to exchanging whole deltas all-to-all in the time left; members then average with those they
heard from, as in a small group. The poisoning guard (robust.py) applies to whole deltas.

With powersgd a whole delta travels in an envelope: the frame's one tensor `delta` is the codec's
payload as uint8 (codec `none`), which the receiver decodes with its own PowerSGD codec, built
from the same layout and rank (the group's codec name fixes the rank, so its params need not
travel; a payload of another rank or layout has another size and is refused). The frame layer
cannot decode it itself: it looks codecs up by name, and this one needs the layout. powersgd
always runs all-to-all, whatever the group size: a ring would cut the flat vector into chunks
that split matrices, and its partial sums would be sums of factors, not of deltas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from ravnest_node.averaging.config import AveragingConfig, delta_codec, payload_nbytes
from ravnest_node.averaging.inbox import (
    GATHER,
    SCATTER,
    WHOLE,
    Admission,
    RoundInbox,
    admit_round,
    part_name,
    part_of,
)
from ravnest_node.averaging.robust import BanList, Screening, screen_norms, stable_norm
from ravnest_node.averaging.topology import (
    Topology,
    choose_topology,
    gather_chunk,
    owned_chunk,
    ring_chunks,
    scatter_chunk,
)
from ravnest_node.averaging.wire import (
    ChannelFactory,
    Member,
    PeerBehind,
    PeerExcludes,
    Pusher,
    push_handler,
)
from ravnest_node.compression import CODECS
from ravnest_node.compression.powersgd import PowerSGD
from ravnest_node.errors import ConfigError, FrameError, PeerError, PeerRefused, PeerUnavailable
from ravnest_node.transport.boundary import LinkCounters
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.frames import (
    Expected,
    Frame,
    FrameKind,
    FrameLimits,
    Outgoing,
    check_tensors,
    encode_frame,
    parse_frame,
)
from ravnest_node.transport.options import TransportConfig, same_host, split_host_port

log = logging.getLogger(__name__)

RING_SHARE = 0.5
"""Share of `timeout_s` a ring may take before the round falls back to whole deltas."""
HEADER_RESERVE = 4096 + 8
"""Bytes a frame may need beyond its payload (the largest accepted header and the prefix)."""

BEHIND_RETRY_S = 0.05
"""Pause before pushing again to a member that has not reached the round yet."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RoundResult:
    """The outcome of one averaging round, as this member saw it."""

    round: int
    """The round number."""
    mean: torch.Tensor
    """Mean of the accepted deltas (flat float32, CPU), as every member decodes them: members
    that heard from the same set hold bit-identical means."""
    participants: tuple[str, ...]
    """Members whose deltas are in the mean (this one included unless rejected), sorted."""
    missing: tuple[str, ...]
    """Members not heard from within `timeout_s`, sorted."""
    rejected: tuple[str, ...]
    """Members whose delta was refused (not finite, undecodable) or failed the norm guard."""
    bytes_sent: int
    """Bytes of the messages this member pushed and that were delivered this round."""
    wait_s: float
    """Seconds the round took, from `average` to its result."""
    topology: Topology
    """The topology the group runs."""
    fell_back: bool = False
    """The ring broke and this round exchanged whole deltas instead."""
    clipped: tuple[str, ...] = ()
    """Members whose delta entered the mean scaled down to the guard's bound (robust.py)."""
    banned: tuple[str, ...] = ()
    """Members banned for the run (robust.py), left out without being waited for."""


@dataclass(slots=True)
class _Traffic:
    bytes_sent: int = 0


class ReplicaAverager:
    """This member's side of a replica group's averaging: the server handler and the rounds.

    Call `average` from the event loop that serves `handler()`, one round at a time, with
    strictly increasing round numbers; torch work (encoding, decoding, sums) runs in `executor`
    (the loop's default executor when None). `close()` closes the channels it opened."""

    def __init__(
        self,
        *,
        node_id: str,
        members: Sequence[Member],
        config: AveragingConfig,
        numel: int,
        max_message_bytes: int,
        channel_factory: ChannelFactory | None = None,
        executor: Executor | None = None,
        counters: LinkCounters | None = None,
        first_round: int = 0,
        layout: Sequence[Sequence[int]] | None = None,
        transport: TransportConfig | None = None,
        bans: BanList | None = None,
        fault_push_scale: float = 1.0,
    ) -> None:
        """A member `node_id` of the group `members` (itself included) averaging deltas of
        `numel` elements in messages of at most `max_message_bytes` (use the node's
        TransportConfig.max_message_bytes: its server accepts nothing larger), starting with
        round `first_round` (a member that joins late starts with the group's next round).
        `channel_factory` makes a channel to an address (default: a grpc.aio channel with the
        options and credentials of `transport`, the node's: mutual TLS in a protected swarm);
        `counters` also counts the bytes pushed per peer.
        `layout` (the shapes of the stage's parameters, in the order of the flat delta) is
        needed by the powersgd codec only. `bans` is the node's record of rejected deltas and
        banned members (robust.py), kept across groups (default: this averager's own).
        `fault_push_scale` (test only, != 1): whole deltas are pushed that many times their
        size while this member averages its own as it is (a poisoning member).
        ConfigError for a group without this node, duplicate ids, a delta that cannot fit one
        message, or powersgd without a layout of `numel` elements."""
        ids = [m.node_id for m in members]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"replica group lists a node id twice: {sorted(ids)}")
        if node_id not in ids:
            raise ConfigError(f"node {node_id!r} is not a member of its replica group {ids}")
        if numel < 1:
            raise ConfigError(f"numel={numel}: a stage averages at least one parameter")
        self.node_id = node_id
        self.config = config
        self.numel = numel
        self.members = tuple(sorted(members, key=lambda m: m.node_id))
        self.rank = [m.node_id for m in self.members].index(node_id)
        n = len(self.members)
        self._codec = delta_codec(config.codec, layout)
        # powersgd payloads travel in an envelope (module doc) and only whole: a ring chunk would
        # cut through matrices.
        self._envelope = self._codec if isinstance(self._codec, PowerSGD) else None
        if self._envelope is not None and self._envelope.numel != numel:
            raise ConfigError(
                f"the layout holds {self._envelope.numel} elements, the delta has {numel}"
            )
        # A ring needs a non-empty chunk per member; tiny stages exchange whole deltas.
        ring_ok = numel >= n and self._envelope is None
        self.topology = choose_topology(n) if ring_ok else Topology.ALL_TO_ALL
        self._ids = frozenset(ids)
        self._all_others = tuple(m for m in self.members if m.node_id != node_id)
        self._hosts = {m.node_id: split_host_port(m.address)[0] for m in self.members}
        self.bans = bans if bans is not None else BanList()
        self._fault_push_scale = fault_push_scale
        self._bounds = ring_chunks(numel, n) if self.topology is Topology.RING else []
        self._states: dict[str, object | None] = {}
        transport = dataclasses.replace(
            transport or TransportConfig(), max_message_bytes=max_message_bytes
        )
        # parse_frame bounds what decoding costs: the float32 result plus the payload (for an
        # envelope, its uint8 tensor counts 4 bytes an element, and the payload once more).
        payload = payload_nbytes(self._codec, numel)
        decoded = 4 * payload if self._envelope is not None else 4 * numel
        need = HEADER_RESERVE + decoded + payload
        if need > max_message_bytes:
            raise ConfigError(
                f"a delta of {numel} parameters with codec {config.codec} needs "
                f"max_message_bytes >= {need}, not {max_message_bytes}"
            )
        self._limits = FrameLimits(
            max_message_bytes=max_message_bytes, max_tensors=1, max_samples=0
        )
        self._pusher = Pusher(node_id, transport, channel_factory, counters)
        self._executor = executor
        self._inboxes: dict[int, RoundInbox] = {}
        self._round = first_round - 1
        self._open = False
        self._busy = False
        self._changed = asyncio.Condition()

    @property
    def _others(self) -> tuple[Member, ...]:
        """The other members, less those banned for the run."""
        return tuple(m for m in self._all_others if m.node_id not in self.bans.banned)

    @property
    def banned(self) -> tuple[str, ...]:
        """Members of this group banned for the run, sorted."""
        return tuple(m.node_id for m in self._all_others if m.node_id in self.bans.banned)

    # ---- the server side ----

    def handler(self) -> Any:
        """The gRPC generic handler of the Push method, to add to a grpc.aio server (a node
        whose server starts before it knows its group registers an AveragingService instead
        and attaches this averager to it)."""
        return push_handler(lambda: self)

    async def receive(self, request: bytes, sender: str, source: str = "") -> None:
        """Validate, decode and keep one pushed part from the host `source`; Refusal (with the
        status to answer) if it is not wanted. A refused part changes nothing, except that a
        whole delta which cannot be used counts as that member's rejected delta of the round
        (toward a ban only if it came from the member's host)."""
        if sender not in self._ids or sender == self.node_id:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {sender!r} is not a member of this replica group",
            )
        if sender in self.bans.banned:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {sender!r} is banned from averaging for this run: "
                f"{self.bans.banned[sender]}",
            )
        try:
            frame, part, chunk = self._check(request, sender)
        except FrameError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"delta refused: {exc}") from None
        admission = admit_round(frame.seq, self._round, self._open)
        if admission is Admission.DROP:
            log.debug("dropped %s's %s of finished round %d", sender, part, frame.seq)
            return
        if admission is Admission.REFUSE:
            raise Refusal(
                grpc.StatusCode.OUT_OF_RANGE,
                f"round {frame.seq} is ahead of this member's round {self._round}",
            )
        if self._inbox(frame.seq).has(part, chunk, sender):
            raise Refusal(
                grpc.StatusCode.ALREADY_EXISTS, f"round {frame.seq}: this part arrived already"
            )
        # Whether this delta came from another host than the member's: then neither its
        # rejection nor its acceptance says anything of the member (node ids are claims).
        foreign = part == WHOLE and not same_host(source, self._hosts[sender])
        try:
            value = await self._in_executor(self._decode, frame)
        except FrameError as exc:
            if self._still_wanted(frame.seq, part, chunk, sender):
                if foreign:
                    self._inbox(frame.seq).elsewhere.add(sender)
                await self._record_fault(frame.seq, part, sender, str(exc))
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"delta refused: {exc}") from None
        # The round may have moved on, or a copy arrived, while this one was decoded.
        if not self._still_wanted(frame.seq, part, chunk, sender):
            return
        inbox = self._inbox(frame.seq)
        if part == WHOLE:
            inbox.deltas[sender] = value
            if foreign:
                inbox.elsewhere.add(sender)
            else:
                inbox.elsewhere.discard(sender)
        elif part == SCATTER:
            inbox.partials[chunk] = value
        else:
            inbox.gathered[chunk] = (request, value)
        await self._notify()

    def _check(self, request: bytes, sender: str) -> tuple[Frame, str, int]:
        """The parsed frame and which part of a round it is; FrameError if it does not fit."""
        frame = parse_frame(request, self._limits)
        if frame.kind is not FrameKind.DELTA or len(frame.headers) != 1:
            raise FrameError("an averaging push carries one tensor in a DELTA frame")
        n = len(self.members)
        part, chunk = part_of(frame.headers[0].name, n)
        length = self.numel
        if part != WHOLE:
            predecessor = self.members[(self.rank - 1) % n].node_id
            if self.topology is not Topology.RING:
                raise FrameError(f"this group of {n} does not run a ring")
            if sender != predecessor:
                raise FrameError(f"ring parts come from {predecessor}, not {sender}")
            if chunk == (self.rank if part == SCATTER else owned_chunk(self.rank, n)):
                raise FrameError(f"{part} chunk {chunk} is never sent to rank {self.rank}")
            start, stop = self._bounds[chunk]
            length = stop - start
        name = frame.headers[0].name
        if self._envelope is not None:
            nbytes = payload_nbytes(self._envelope, self.numel)
            check_tensors(frame, [Expected(name, (nbytes,), torch.uint8)])
        else:
            check_tensors(frame, [Expected(name, (length,), torch.float32)])
        return frame, part, chunk

    def _still_wanted(self, seq: int, part: str, chunk: int, sender: str) -> bool:
        """Whether a part of round `seq` is admitted and has not arrived yet."""
        if admit_round(seq, self._round, self._open) is not Admission.ACCEPT:
            return False
        return not self._inbox(seq).has(part, chunk, sender)

    async def _record_fault(self, seq: int, part: str, sender: str, reason: str) -> None:
        inbox = self._inbox(seq)
        if part == WHOLE:
            inbox.rejected[sender] = reason
        elif inbox.ring_fault is None:
            inbox.ring_fault = f"{part} part from {sender}: {reason}"
        await self._notify()

    def _inbox(self, seq: int) -> RoundInbox:
        inbox = self._inboxes.get(seq)
        if inbox is None:
            inbox = self._inboxes[seq] = RoundInbox()
        return inbox

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait_until(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Wait (on the condition, no polling) until `predicate()` or the loop time `deadline`;
        returns `predicate()`."""
        async with self._changed:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._changed.wait_for(predicate)
            except TimeoutError:
                pass
            return predicate()

    # ---- the rounds ----

    async def average(self, round: int, delta: torch.Tensor, *, step: int = 0) -> RoundResult:
        """Average this member's `delta` (P elements) with the group's for round `round`.

        Waits at most about `timeout_s` (plus the torch work) and always completes: members not
        heard from by then are `missing`, and with nobody else the mean is this member's own
        delta as decoded. `step` (the optimizer step) travels as the frames' version. Raises
        RuntimeError if a round is already running, ValueError for a round number not above the
        last one, a delta of the wrong size, or a delta that is not finite (our own fault)."""
        if self._busy:
            raise RuntimeError("an averaging round is already running")
        if round <= self._round:
            raise ValueError(f"round {round}: rounds must increase (the last was {self._round})")
        if delta.numel() != self.numel or step < 0:
            raise ValueError(f"delta of {delta.numel()} elements at step {step}: need {self.numel}")
        flat = delta.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        started = asyncio.get_running_loop().time()
        deadline = started + self.config.timeout_s
        self._busy = True
        self._round, self._open = round, True
        for old in [k for k in self._inboxes if k < round]:
            del self._inboxes[old]
        try:
            traffic = _Traffic()
            if self.topology is Topology.RING and not self.banned:  # a ring needs everyone
                result = await self._ring_round(round, step, flat, started, deadline, traffic)
            else:
                result = await self._whole_round(round, step, flat, started, deadline, traffic)
        finally:
            self._open = False
            self._inboxes.pop(round, None)
            self._busy = False
        log.info(
            "round %d (%s%s): %d of %d members averaged, %d bytes sent, %.3f s",
            round,
            result.topology,
            ", fell back" if result.fell_back else "",
            len(result.participants),
            len(self.members),
            result.bytes_sent,
            result.wait_s,
        )
        return result

    async def _whole_round(
        self,
        round: int,
        step: int,
        flat: torch.Tensor,
        started: float,
        deadline: float,
        traffic: _Traffic,
        fell_back: bool = False,
    ) -> RoundResult:
        """All-to-all: push the whole delta to every other member and collect theirs."""
        message, own = await self._in_executor(self._encode_decoded, round, step, WHOLE, flat)
        if self._fault_push_scale != 1.0:
            poisoned = flat * self._fault_push_scale  # with an error-feedback state of its own
            message = await self._in_executor(
                self._encode, round, step, WHOLE, poisoned, None, "fault"
            )
        inbox = self._inbox(round)
        unreachable: set[str] = set()

        def settled() -> bool:
            return all(
                inbox.heard_from(m.node_id) or m.node_id in unreachable for m in self._others
            )

        async with asyncio.TaskGroup() as tg:
            for member in self._others:
                tg.create_task(self._push_whole(member, message, deadline, traffic, unreachable))
            await self._wait_until(settled, deadline)
            # What the round uses is fixed here; later arrivals change nothing. A member banned
            # since its push arrived (the push raced the round that banned it) is left out.
            banned = self.bans.banned
            deltas = {self.node_id: own}
            deltas.update((k, v) for k, v in inbox.deltas.items() if k not in banned)
            refused = {k: why for k, why in inbox.rejected.items() if k not in banned}
            elsewhere = set(inbox.elsewhere)
        screening, mean = await self._in_executor(self._combine, deltas)
        missing = tuple(
            m.node_id for m in self._others if m.node_id not in deltas and m.node_id not in refused
        )
        if missing:
            log.warning(
                "round %d: no delta from %s within %.1f s; averaged without them",
                round,
                ", ".join(missing),
                self.config.timeout_s,
            )
        median = screening.median_norm or 0.0
        measure = "this member's own delta's norm" if screening.by_own else "the median norm"
        for sender in screening.rejected:
            refused[sender] = (
                f"its norm exceeds {self.config.max_norm_ratio:g} x {measure} {median:.4g}"
            )
        for sender, reason in sorted(refused.items()):
            log.warning("round %d: rejected %s's delta: %s", round, sender, reason)
            if sender == self.node_id:
                continue
            if sender in elsewhere:
                log.warning("round %d: %s's rejected delta came from another host than %s: "
                            "not counted toward a ban", round, sender,
                            self._hosts[sender])  # fmt: skip
            elif self.bans.strike(sender, reason, self.config.ban_after):
                log.error("round %d: banned %s from averaging for the rest of the run (%s)",
                          round, sender, self.bans.banned[sender])  # fmt: skip
        for sender in screening.accepted:
            # A good delta from the member's own host: its strikes were not in a row. (One
            # sent in its name from elsewhere must not wipe the record either.)
            if sender not in screening.scales and sender not in elsewhere:
                self.bans.clear(sender)
        for sender, scale in sorted(screening.scales.items()):
            log.warning("round %d: clipped %s's delta to %g x the median norm %.4g (scaled by "
                        "%.3g)", round, sender, self.config.clip_ratio, median, scale)  # fmt: skip
        return RoundResult(
            round=round,
            mean=mean,
            participants=screening.accepted,
            missing=missing,
            rejected=tuple(sorted(refused)),
            clipped=screening.clipped,
            banned=self.banned,
            bytes_sent=traffic.bytes_sent,
            wait_s=asyncio.get_running_loop().time() - started,
            topology=self.topology,
            fell_back=fell_back,
        )

    def _combine(self, deltas: dict[str, torch.Tensor]) -> tuple[Screening, torch.Tensor]:
        """The guard's decision and the mean of the accepted deltas (runs in the executor)."""
        norms = {k: stable_norm(v) for k, v in deltas.items()}
        screening = screen_norms(
            norms, self.config.max_norm_ratio, self.config.clip_ratio, own=self.node_id
        )
        total = torch.zeros(self.numel, dtype=torch.float32)
        # In sorted order: members that accepted the same deltas compute bit-identical means.
        for k in screening.accepted:
            total.add_(deltas[k], alpha=screening.scales.get(k, 1.0))
        if screening.accepted:  # always: the guard keeps the median
            total.div_(len(screening.accepted))
        return screening, total

    async def _ring_round(
        self,
        round: int,
        step: int,
        flat: torch.Tensor,
        started: float,
        deadline: float,
        traffic: _Traffic,
    ) -> RoundResult:
        """The ring; if it breaks, whole deltas all-to-all until `deadline`."""
        ring_deadline = started + self.config.timeout_s * RING_SHARE
        pushes: list[asyncio.Task[None]] = []
        async with asyncio.TaskGroup() as tg:
            mean = await self._ring(tg, pushes, round, step, flat, ring_deadline, traffic)
            if mean is None:  # the pushes still in flight are of no use any more
                for task in pushes:
                    task.cancel()
        if mean is not None:
            return RoundResult(
                round=round,
                mean=mean,
                participants=tuple(m.node_id for m in self.members),
                missing=(),
                rejected=(),
                bytes_sent=traffic.bytes_sent,
                wait_s=asyncio.get_running_loop().time() - started,
                topology=self.topology,
            )
        log.warning(
            "round %d: the ring broke (%s); exchanging whole deltas instead",
            round,
            self._inbox(round).ring_fault or "a member sent its whole delta",
        )
        return await self._whole_round(round, step, flat, started, deadline, traffic, True)

    async def _ring(
        self,
        tg: asyncio.TaskGroup,
        pushes: list[asyncio.Task[None]],
        round: int,
        step: int,
        flat: torch.Tensor,
        deadline: float,
        traffic: _Traffic,
    ) -> torch.Tensor | None:
        """Reduce-scatter then all-gather (topology.py); the mean, or None if the ring broke."""
        n, rank = len(self.members), self.rank
        successor = self.members[(rank + 1) % n]
        inbox = self._inbox(round)
        bounds = self._bounds

        def piece(chunk: int) -> torch.Tensor:
            start, stop = bounds[chunk]
            return flat[start:stop]

        def push(message: bytes) -> None:
            task = self._push_part(successor, message, deadline, traffic, inbox)
            pushes.append(tg.create_task(task))

        async def arrived(table: dict[int, Any], chunk: int) -> bool:
            ok = await self._wait_until(lambda: chunk in table or inbox.ring_broken(), deadline)
            return ok and not inbox.ring_broken()

        for s in range(n - 1):
            chunk = scatter_chunk(rank, s, n)
            received = inbox.partials.get(chunk)  # None at step 0 only
            name = part_name(SCATTER, chunk)
            message = await self._in_executor(
                self._encode, round, step, name, piece(chunk), received
            )
            push(message)
            if not await arrived(inbox.partials, scatter_chunk(rank - 1, s, n)):
                return None
        owned = owned_chunk(rank, n)
        name = part_name(GATHER, owned)
        message, total = await self._in_executor(
            self._encode_decoded, round, step, name, piece(owned), inbox.partials[owned]
        )
        sums = {owned: total}
        for s in range(n - 1):
            push(message if s == 0 else inbox.gathered[gather_chunk(rank, s, n)][0])
            incoming = gather_chunk(rank - 1, s, n)
            if not await arrived(inbox.gathered, incoming):
                return None
            sums[incoming] = inbox.gathered[incoming][1]
        return await self._in_executor(self._assemble, sums)

    def _assemble(self, sums: dict[int, torch.Tensor]) -> torch.Tensor:
        """The mean from the summed ring chunks (runs in the executor)."""
        mean = torch.empty(self.numel, dtype=torch.float32)
        for chunk, value in sums.items():
            start, stop = self._bounds[chunk]
            mean[start:stop] = value
        return mean.div_(len(self.members))

    def _encode(
        self,
        round: int,
        step: int,
        name: str,
        tensor: torch.Tensor,
        plus: torch.Tensor | None = None,
        state_key: str | None = None,
    ) -> bytes:
        """The frame of `tensor` (+ `plus`) as part `name`, with that part's error-feedback
        state (or the state called `state_key`). ValueError if it is not finite. Runs in the
        executor."""
        if plus is not None:
            tensor = tensor + plus
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"round {round}: this member's {name} is not finite")
        key = state_key or name
        if key not in self._states:
            self._states[key] = self._codec.new_state()
        if self._envelope is not None:
            params, payload = self._envelope.encode(tensor, self._states[key])
            assert params == self._envelope.params  # the receivers assume them (module doc)
            carrier = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            out = Outgoing(name, carrier, CODECS["none"])
        else:
            out = Outgoing(name, tensor.contiguous(), self._codec, self._states[key])
        return encode_frame(FrameKind.DELTA, round, step, [out])

    def _encode_decoded(
        self,
        round: int,
        step: int,
        name: str,
        tensor: torch.Tensor,
        plus: torch.Tensor | None = None,
    ) -> tuple[bytes, torch.Tensor]:
        """`_encode`, and the tensor as the receivers decode it (what this member uses too, so
        that every member computes with the same values)."""
        message = self._encode(round, step, name, tensor, plus)
        return message, self._decode(parse_frame(message, self._limits))

    def _decode(self, frame: Frame) -> torch.Tensor:
        """The frame's delta, flat float32 (from its envelope with powersgd); FrameError if it
        does not decode or holds values that are not finite. Runs in the executor."""
        if self._envelope is None:
            return _decode_finite(frame)
        carrier = next(iter(frame.decode().values()))
        payload = memoryview(carrier.numpy().tobytes())
        value = self._envelope.decode(payload, (self.numel,), torch.float32, self._envelope.params)
        return _decode_finite_tensor(value)

    # ---- the client side ----

    async def _push_whole(
        self,
        member: Member,
        message: bytes,
        deadline: float,
        traffic: _Traffic,
        unreachable: set[str],
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self._push(member, message, deadline, traffic)
            except PeerBehind as exc:
                # A member still on an earlier round (its last one waited for someone, or it
                # started late) takes this round's push once it opens it: try again while the
                # round's time lasts.
                if loop.time() + BEHIND_RETRY_S < deadline:
                    await asyncio.sleep(BEHIND_RETRY_S)  # a back-off, not a wait for an event
                    continue
                log.warning("%s", exc)
            except (PeerUnavailable, PeerExcludes) as exc:
                log.warning("could not push a delta to %s: %s", member.node_id, exc)
                unreachable.add(member.node_id)  # it is not waited for any longer
                await self._notify()
            except PeerRefused as exc:
                log.warning("%s", exc)
            return

    async def _push_part(
        self,
        member: Member,
        message: bytes,
        deadline: float,
        traffic: _Traffic,
        inbox: RoundInbox,
    ) -> None:
        try:
            await self._push(member, message, deadline, traffic)
        except PeerError as exc:
            if inbox.ring_fault is None:
                inbox.ring_fault = f"push to {member.node_id} failed: {exc}"
            await self._notify()

    async def _push(
        self, member: Member, message: bytes, deadline: float, traffic: _Traffic
    ) -> None:
        delivered = await self._pusher.push(member, message, deadline)
        traffic.bytes_sent += delivered  # not `+= await`: that would read the total before

    async def _in_executor(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def close(self) -> None:
        """Close the channels this averager opened (pushes in flight fail)."""
        await self._pusher.close()


def _decode_finite(frame: Frame) -> torch.Tensor:
    """The frame's one tensor, flat; FrameError if it holds values that are not finite."""
    return _decode_finite_tensor(next(iter(frame.decode().values())))


def _decode_finite_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value`, flat; FrameError if it holds values that are not finite."""
    value = value.reshape(-1)
    if not bool(torch.isfinite(value).all()):
        raise FrameError("the delta holds values that are not finite")
    return value
