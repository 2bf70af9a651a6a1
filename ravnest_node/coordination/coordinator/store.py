"""The lab coordinator's SQLite store: membership, the plan and progress survive a restart.

`ravnest-node coordinator --state-dir DIR` keeps everything it decided or was told in
`DIR/coordinator.sqlite3`, one transaction per change, so that a coordinator killed at any
moment restarts with the state of its last answered call: the members and what they measured,
the plan, every step's loss, each stage's final report, the progress events, and its record of
faults (members lost, steps dropped, restores, members banned). Nodes notice nothing but a
gap: their reports wait and are retried until it answers again
(daemon/worker/coordinator_client.py).

The file is ours, not the network's; still, a file that does not parse is refused with a
clear error rather than half-loaded. Journal mode WAL with synchronous=NORMAL: a killed
process loses nothing it committed, and a power cut loses at most the last commits but never
leaves the file inconsistent (https://www.sqlite.org/wal.html).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from ravnest_node.coordination.coordinator.faults import (
    Ban,
    Crash,
    Restore,
    Revoked,
    as_count,
    as_text,
    ban_from_dict,
)
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.errors import ConfigError
from ravnest_node.proto import control_pb2 as pb

STORE_FILE = "coordinator.sqlite3"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    position INTEGER PRIMARY KEY, node_id TEXT UNIQUE NOT NULL, address TEXT NOT NULL,
    capabilities BLOB);
CREATE TABLE IF NOT EXISTS losses (
    pipeline INTEGER NOT NULL, step INTEGER NOT NULL, loss REAL NOT NULL,
    PRIMARY KEY (pipeline, step));
CREATE TABLE IF NOT EXISTS bytes_sent (node_id TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS finals (
    pipeline INTEGER NOT NULL, stage INTEGER NOT NULL, report BLOB NOT NULL,
    PRIMARY KEY (pipeline, stage));
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, event BLOB NOT NULL);
"""


@dataclass(slots=True)
class Saved:
    """What a store held when it was opened (empty for a new store)."""

    run: pb.RunSpec | None = None
    """The run the store was created for; None for a new store."""
    swarm_id: str = ""
    swarm_size: int = 0
    members: list[Member] = field(default_factory=list)
    capabilities: dict[str, pb.Capabilities] = field(default_factory=dict)
    plan: pb.Plan | None = None
    started_unix: float = 0.0
    """Wall-clock time (time.time()) the plan was published."""
    pipeline_losses: dict[int, dict[int, float]] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    finals: dict[tuple[int, int], pb.StageReport] = field(default_factory=dict)
    events: list[pb.Progress] = field(default_factory=list)
    faults: Faults = field(default_factory=lambda: Faults())
    """Who was lost, what was dropped or restored."""


@dataclass(slots=True)
class Faults:
    """The coordinator's record of faults: members lost (crashes: who, where, when), steps of
    broken pipelines dropped, restores from checkpoints and the microbatches they redo, and
    the members banned. Stored as one JSON object, crashes, restores and bans as the objects
    of their `to_dict`."""

    crashes: list[Crash] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """Members counted lost and not back since."""
    dropped: int = 0
    dropped_steps: dict[int, list[int]] = field(default_factory=dict)
    """Pipeline -> steps it never trained (NaN in its losses)."""
    restores: list[Restore] = field(default_factory=list)
    redone: int = 0
    banned: list[Ban | Revoked] = field(default_factory=list)
    """Members banned for failing audits or revoked (bans.py): refused after a restart too."""

    def to_json(self) -> str:
        return json.dumps({
            "crashes": [c.to_dict() for c in self.crashes], "lost": self.lost,
            "dropped": self.dropped,
            "dropped_steps": {str(p): steps for p, steps in self.dropped_steps.items()},
            "restores": [r.to_dict() for r in self.restores], "redone": self.redone,
            "banned": [b.to_dict() for b in self.banned],
        })  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> Faults:
        """ValueError / TypeError / KeyError if `text` is not what `to_json` writes."""
        data = json.loads(text)
        return cls(
            crashes=[Crash.from_dict(c) for c in _objects(data["crashes"])],
            lost=[as_text(n) for n in data["lost"]],
            dropped=as_count(data["dropped"]),
            dropped_steps={
                int(p): [as_count(s) for s in steps]
                for p, steps in dict(data["dropped_steps"]).items()
            },
            restores=[Restore.from_dict(r) for r in _objects(data["restores"])],
            redone=as_count(data["redone"]),
            # (A store written before bans were kept has none.)
            banned=[ban_from_dict(b) for b in _objects(data.get("banned", []))],
        )


def _objects(value: object) -> list[dict[str, object]]:
    """A list of JSON objects; TypeError otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise TypeError("expected a list of objects")
    return value


class CoordinatorStore:
    """One coordinator's SQLite file. Methods run on the event loop: each is one short
    transaction (no fsync per commit in WAL/NORMAL mode), far below a millisecond."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / STORE_FILE
        state_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)  # each CREATE ... IF NOT EXISTS is atomic
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path}: not a coordinator store ({exc})") from None
        self._members: list[tuple[int, str, str, bytes | None]] | None = None
        """The member rows as this store last wrote them (None: not since it was opened)."""

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        with closing(self._db.cursor()) as cur:
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    # ----- reading ----------------------------------------------------------------------------
    def load(self) -> Saved:
        """Everything the store holds; ConfigError naming the file if any of it is corrupt."""
        try:
            return self._load()
        except (sqlite3.DatabaseError, DecodeError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{self.path}: corrupt coordinator store ({exc})") from None

    def _load(self) -> Saved:
        db = self._db
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        saved = Saved()
        if not meta:
            return saved
        if int(meta.get("schema", 0)) != SCHEMA_VERSION:
            raise ValueError(f"schema {meta.get('schema')!r}, this version reads {SCHEMA_VERSION}")
        saved.run = pb.RunSpec.FromString(meta["run"])
        saved.swarm_id = str(meta["swarm_id"])
        saved.swarm_size = int(meta["swarm_size"])
        if "plan" in meta:
            saved.plan = pb.Plan.FromString(meta["plan"])
            saved.started_unix = float(meta["started_unix"])
        for node_id, address, caps in db.execute(
            "SELECT node_id, address, capabilities FROM members ORDER BY position"
        ):
            saved.members.append(Member(node_id=str(node_id), address=str(address)))
            if caps is not None:
                saved.capabilities[node_id] = pb.Capabilities.FromString(caps)
        for pipeline, step, loss in db.execute("SELECT pipeline, step, loss FROM losses"):
            saved.pipeline_losses.setdefault(int(pipeline), {})[int(step)] = float(loss)
        for node_id, nbytes in db.execute("SELECT node_id, bytes FROM bytes_sent"):
            saved.bytes_sent[str(node_id)] = int(nbytes)
        for pipeline, stage, report in db.execute("SELECT pipeline, stage, report FROM finals"):
            saved.finals[(int(pipeline), int(stage))] = pb.StageReport.FromString(report)
        for (event,) in db.execute("SELECT event FROM events ORDER BY seq"):
            saved.events.append(pb.Progress.FromString(event))
        if "faults" in meta:
            saved.faults = Faults.from_json(str(meta["faults"]))
        return saved

    # ----- writing ----------------------------------------------------------------------------
    def create(self, *, run: pb.RunSpec, swarm_id: str, swarm_size: int) -> None:
        """Mark a new store as this run's."""
        rows = [
            ("schema", SCHEMA_VERSION),
            ("run", run.SerializeToString(deterministic=True)),
            ("swarm_id", swarm_id),
            ("swarm_size", swarm_size),
        ]
        with self._transaction() as cur:
            cur.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", rows)

    def save_members(
        self,
        members: Iterable[Member],
        capabilities: dict[str, pb.Capabilities],
    ) -> None:
        """Replace the member list (joins, and evictions before the plan)."""
        rows = [
            (
                i,
                m.node_id,
                m.address,
                capabilities[m.node_id].SerializeToString() if m.node_id in capabilities else None,
            )
            for i, m in enumerate(members)
        ]
        # Only the rows that changed since the last write (a join adds one, capabilities change
        # one): rewriting all of them at each of 1,000 joins took seconds (bench/swarm_size.py).
        old = self._members
        with self._transaction() as cur:
            if old is None:
                cur.execute("DELETE FROM members")
                changed = rows
            else:
                if len(rows) < len(old):
                    cur.execute("DELETE FROM members WHERE position >= ?", (len(rows),))
                changed = [r for r in rows if r[0] >= len(old) or old[r[0]] != r]
            cur.executemany("INSERT OR REPLACE INTO members VALUES (?, ?, ?, ?)", changed)
        self._members = rows

    def save_plan(self, plan: pb.Plan, started_unix: float) -> None:
        rows = [("plan", plan.SerializeToString()), ("started_unix", started_unix)]
        with self._transaction() as cur:
            cur.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", rows)

    def forget_losses(self, pipeline: int, *, after: int) -> None:
        """A broken pipeline's losses past the step its plan ended at are of steps dropped."""
        with self._transaction() as cur:
            cur.execute("DELETE FROM losses WHERE pipeline = ? AND step > ?", (pipeline, after))

    def save_faults(self, faults: Faults) -> None:
        """Replace the record of faults (a member lost, steps dropped, a restore)."""
        with self._transaction() as cur:
            cur.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", ("faults", faults.to_json()))

    def roll_back(self, step: int, plan: pb.Plan, started_unix: float) -> None:
        """A restore from checkpoints (recovery.py): the losses after `step` and every final
        report are of a timeline that no longer happened; `plan` is the plan now. One
        transaction. (Progress events stay: they are what watchers were shown.)"""
        rows = [("plan", plan.SerializeToString()), ("started_unix", started_unix)]
        with self._transaction() as cur:
            cur.execute("DELETE FROM losses WHERE step > ?", (step,))
            cur.execute("DELETE FROM finals")
            cur.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", rows)

    def save_report(
        self,
        *,
        node_id: str,
        bytes_sent: int,
        loss: tuple[int, int, float] | None = None,
        final: tuple[int, int, pb.StageReport] | None = None,
        events: Iterable[tuple[int, pb.Progress]] = (),
    ) -> None:
        """One report's effects, all or nothing: the sender's byte counter, its loss
        (pipeline, step, loss) or final report (pipeline, stage, report), and the new
        progress events (seq, event)."""
        with self._transaction() as cur:
            cur.execute("INSERT OR REPLACE INTO bytes_sent VALUES (?, ?)", (node_id, bytes_sent))
            if loss is not None:
                cur.execute("INSERT INTO losses VALUES (?, ?, ?)", loss)
            if final is not None:
                pipeline, stage, report = final
                cur.execute(
                    "INSERT INTO finals VALUES (?, ?, ?)",
                    (pipeline, stage, report.SerializeToString()),
                )
            cur.executemany(
                "INSERT INTO events VALUES (?, ?)",
                [(seq, event.SerializeToString()) for seq, event in events],
            )
