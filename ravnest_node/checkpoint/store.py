"""Stage checkpoints: a node's blocks, their AdamW moments and the step, kept on its own disk.

A checkpoint is two files in `<state-dir>/checkpoints/`, named by the step they hold:

* `step-00000120-<sha256 prefix>.safetensors`: every tensor of the stage's blocks, float32,
  named `<block>/<role>/<parameter>` (role: param, exp_avg, exp_avg_sq; blocks.py);
* `step-00000120.json`: the manifest. The step (optimizer steps applied, which is also the data
  position: step S trains on the batches of step S next), the blocks and the run they belong to,
  each block's AdamW step count, and the size and sha256 of the tensor file.

**Atomic.** The tensor file is written first, the manifest last, each to a temporary file that
is fsynced and renamed over its name (`state.write_atomic`): a checkpoint exists once its
manifest does, and a manifest only names a tensor file already complete on disk. The tensor
file's name carries its checksum, so writing a step again (a plan ended there, then the node
stopped there with another stage) never replaces the file the old manifest names. A writer
killed at any point leaves the previous checkpoints as they were, plus at most a temporary or
an orphaned tensor file, which the next save removes.

**Verified.** Loading checks the manifest, then the tensor file's size and sha256, then every
tensor against the blocks the manifest names (`blocks.check_block`: names, shapes, float32,
finite values). Anything wrong raises CheckpointError naming the file and the fault, and
`latest` falls back to the next older checkpoint. Nothing is unpickled: safetensors holds raw
tensors and a JSON header only.

The newest `keep` checkpoints stay; older ones are removed after a new one is complete,
except while a restore is being planned from what the node has said it holds (`Retention`):
then nothing is removed until the node has the plan that follows.

**Copies.** A stage without a replica has its checkpoints copied to the node of the next stage
(`Node.FetchCheckpoint`), into `<state-dir>/checkpoint-copies/blocks-FFFF-SSSS/`, in the same
two-file form (`CheckpointCopies`): the copy is checked against the manifest's size and sha256
before it reaches the disk, and loads like a checkpoint of the node's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ravnest_node.blocks import BlockWeights, block_shapes, check_block
from ravnest_node.errors import RavnestError
from ravnest_node.models import BlockModel, get_model
from ravnest_node.models.base import shapes_only
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.state import write_atomic

log = logging.getLogger(__name__)

FORMAT = "ravnest-checkpoint/1"
DIR_NAME = "checkpoints"
COPIES_DIR_NAME = "checkpoint-copies"
COPIES_KEEP = 2
SET_ASIDE_DIR = "checkpoints.previous"
MAX_MANIFEST_BYTES = 1 << 20
_NAME = re.compile(r"^step-(\d{8})\.json$")
_TENSOR_FILE = re.compile(r"^step-(\d{8})-[0-9a-f]{16}\.safetensors$")
_COPY_DIR = re.compile(r"^blocks-(\d{4})-(\d{4})$")


class CheckpointError(RavnestError):
    """A checkpoint is missing, corrupt, truncated or not of this run; the message says which
    file and what is wrong."""


def run_key(spec: pb.RunSpec) -> str:
    """What a checkpoint must share with a run to resume it: the model and the data (its seed,
    batch layout and content). The step count, learning rate or swarm shape may change."""
    text = "|".join(
        str(v)
        for v in (spec.model, spec.seed, spec.batch_size, spec.microbatches,
                  spec.dataset_samples, spec.data_fingerprint)
    )  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a checkpoint holds (its `.json` file)."""

    step: int
    """Optimizer steps applied: the run resumes at this step."""
    run_key: str
    model: str
    first_block: int
    stop_block: int
    pipeline: int
    stage: int
    plan_epoch: int
    samples_seen: int
    """Samples this stage's pipeline had trained on (its data position)."""
    optimizer_steps: dict[int, float]
    """Block -> AdamW's step count (0: the block has taken no step yet)."""
    file: str
    bytes: int
    sha256: str
    written_unix: float
    format: str = FORMAT

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.stop_block)

    def offer(self) -> pb.CheckpointOffer:
        """What a resuming node tells the coordinator about this checkpoint."""
        return pb.CheckpointOffer(
            step=self.step,
            first_block=self.first_block,
            stop_block=self.stop_block,
            run_key=self.run_key,
            pipeline=self.pipeline,
            stage=self.stage,
            plan_epoch=self.plan_epoch,
        )


def _stem(step: int) -> str:
    return f"step-{step:08d}"


def _tensor_name(block: int, role: str, name: str) -> str:
    return f"{block}/{role}/{name}"


def bytes_bound(model: BlockModel, first_block: int, stop_block: int) -> int:
    """The most bytes a checkpoint of blocks [first_block, stop_block) of `model` can take:
    three float32 tensors (parameter and AdamW's two moments) per parameter, and the
    safetensors header's names and shapes (generously)."""
    with shapes_only():
        built = model.build_stage(0, first_block, stop_block)
    params = [p for block in built for p in block.parameters()]
    return 3 * 4 * sum(p.numel() for p in params) + 1024 * (3 * len(params) + 1)


def parse_manifest(raw: bytes, step: int, where: str = "manifest") -> Manifest:
    """A manifest of the checkpoint at `step` from its JSON (at most MAX_MANIFEST_BYTES),
    checked for form; CheckpointError naming `where` otherwise."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return _parse_manifest(json.loads(raw), step)
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError) as exc:
        raise CheckpointError(f"{where}: not a valid manifest: {exc!s:.200}") from None


class Retention:
    """Whether pruning may remove checkpoints, shared by a node's own checkpoints and its
    copies. The coordinator plans a restore from the checkpoints its members say they hold
    (their heartbeats); a member's next write must not prune one it named before the restore
    plan comes. So the coordinator asks (HeartbeatReply.hold_epoch) and the member holds them
    all until it has a plan newer than that epoch; its heartbeats say so (held_epoch).

    `hold` waits for a prune in progress: once it returns, every checkpoint listed afterwards
    stays until `release`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held_epoch = 0
        """Checkpoints are held until a plan newer than this epoch (0: none held)."""

    def hold(self, epoch: int) -> bool:
        """Hold every checkpoint from now until a plan newer than `epoch`; True if that is new.
        Blocking (waits for a prune in progress)."""
        with self._lock:
            if epoch <= self.held_epoch:
                return False
            self.held_epoch = epoch
            return True

    def release(self, plan_epoch: int) -> None:
        """The node has plan `plan_epoch`: a hold for an older plan ends."""
        with self._lock:
            if self.held_epoch < plan_epoch:
                self.held_epoch = 0

    @contextlib.contextmanager
    def pruning(self) -> Iterator[bool]:
        """Within it, whether checkpoints may be removed (no hold can start meanwhile)."""
        with self._lock:
            yield self.held_epoch == 0


class CheckpointDir:
    """The checkpoints of one node: save (from a worker thread), list, load verified."""

    def __init__(
        self,
        state_dir: Path,
        keep: int = 3,
        *,
        path: Path | None = None,
        retention: Retention | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        self.path = state_dir / DIR_NAME if path is None else path
        self.keep = keep
        self.hold: int | None = None
        """A step pruning never removes (a restore is about to load it)."""
        self.retention = Retention() if retention is None else retention

    # ----- writing ----------------------------------------------------------------------------
    def save(
        self,
        blocks: Mapping[int, BlockWeights],
        *,
        step: int,
        run: pb.RunSpec,
        pipeline: int,
        stage: int,
        plan_epoch: int,
    ) -> Manifest:
        """Write the checkpoint of `blocks` (contiguous, all at `step`) and drop the oldest
        beyond `keep`. Blocking: call it from a worker thread."""
        indices = sorted(blocks)
        if not indices or indices != list(range(indices[0], indices[-1] + 1)):
            raise ValueError(f"blocks {indices} are not a contiguous range")
        if any(w.version != step for w in blocks.values()):
            raise ValueError(f"blocks are not all at step {step}")
        tensors = {
            _tensor_name(b, role, name): t.contiguous()
            for b in indices
            for (role, name), t in blocks[b].tensors.items()
        }
        data = st_save(tensors)
        stem = _stem(step)
        digest = hashlib.sha256(data).hexdigest()
        manifest = Manifest(
            step=step,
            run_key=run_key(run),
            model=run.model,
            first_block=indices[0],
            stop_block=indices[-1] + 1,
            pipeline=pipeline,
            stage=stage,
            plan_epoch=plan_epoch,
            samples_seen=step * run.batch_size,
            optimizer_steps={b: blocks[b].optimizer_step for b in indices},
            file=f"{stem}-{digest[:16]}.safetensors",
            bytes=len(data),
            sha256=digest,
            written_unix=time.time(),
        )
        self._write(manifest, data)
        return manifest

    def save_copy(self, manifest: Manifest, data: bytes, model: BlockModel) -> None:
        """Keep a copy of another node's checkpoint: `data` is its tensor file, checked as a
        load checks it first (size, sha256, every tensor against `model`'s blocks; a
        CheckpointError, and nothing written)."""
        _verify(manifest, data, model, f"copy of step {manifest.step}")
        self._write(manifest, data)

    def _write(self, manifest: Manifest, data: bytes) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._prune()  # what a killed or failed writer left: room for this one
        write_atomic(self.path / manifest.file, data)
        write_atomic(self.path / f"{_stem(manifest.step)}.json",
                     json.dumps(asdict(manifest)).encode())  # fmt: skip
        self._prune()

    def drop_after(self, step: int) -> list[int]:
        """Remove checkpoints newer than `step` (the manifest first: never half of one)."""
        newer = sorted((s, p) for s, p in self._manifest_paths() if s > step)
        for _, path in newer:
            tensors = self._named_file(path)
            path.unlink(missing_ok=True)
            if tensors is not None:
                (self.path / tensors).unlink(missing_ok=True)
        return [s for s, _ in newer]

    def _named_file(self, manifest_path: Path) -> str | None:
        """The tensor file a manifest names (None if it names none we would write)."""
        try:
            with open(manifest_path, "rb") as f:
                name = json.loads(f.read(MAX_MANIFEST_BYTES)).get("file")
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        return name if isinstance(name, str) and _TENSOR_FILE.match(name) else None

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints; remove older ones, temporaries left by a killed
        writer, and tensor files no kept manifest names. While the retention holds them,
        only the temporaries and orphans."""
        with self.retention.pruning() as may_remove:
            manifests = sorted(self._manifest_paths(), reverse=True)
            keep = self.keep if may_remove else len(manifests)
            kept = manifests[:keep] + [(s, p) for s, p in manifests[keep:]
                                       if s == self.hold]  # fmt: skip
            for step, path in manifests[keep:]:
                if step != self.hold:
                    path.unlink(missing_ok=True)
            named = {self._named_file(path) for _, path in kept}
            for path in self.path.iterdir():
                temporary = path.name.startswith(".") and path.name.endswith(".tmp")
                orphan = path.suffix == ".safetensors" and path.name not in named
                if temporary or orphan:
                    path.unlink(missing_ok=True)

    def set_aside_after(self, step: int) -> tuple[list[int], Path | None]:
        """Move checkpoints newer than `step` to a new folder under `checkpoints.previous/`: a
        run that starts at `step` must never later resume from another timeline. Nothing is
        deleted (remove set-aside folders by hand). Returns their steps and the folder."""
        newer = sorted((s, p) for s, p in self._manifest_paths() if s > step)
        if not newer:
            return [], None
        aside = self.path.parent / SET_ASIDE_DIR / time.strftime("%Y%m%d-%H%M%S")
        suffix = 0
        while aside.exists():
            suffix += 1
            aside = aside.with_name(f"{aside.name.split('.')[0]}.{suffix}")
        aside.mkdir(parents=True)
        for _, path in newer:
            tensors = self._named_file(path)
            path.rename(aside / path.name)  # the manifest first: no checkpoint is ever half here
            if tensors is not None and (self.path / tensors).exists():
                (self.path / tensors).rename(aside / tensors)
        return [s for s, _ in newer], aside

    # ----- reading ----------------------------------------------------------------------------
    def _manifest_paths(self) -> Iterator[tuple[int, Path]]:
        if not self.path.is_dir():
            return
        for path in self.path.iterdir():
            match = _NAME.match(path.name)
            if match:
                yield int(match.group(1)), path

    def steps(self) -> list[int]:
        """Steps that have a manifest, newest first (not verified)."""
        return sorted((s for s, _ in self._manifest_paths()), reverse=True)

    def manifest(self, step: int) -> Manifest:
        """The manifest of the checkpoint at `step`, checked for form; CheckpointError."""
        path = self.path / f"{_stem(step)}.json"
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it: {exc.strerror}") from None
        return parse_manifest(raw, step, str(path))

    def manifests(self) -> list[Manifest]:
        """The manifest of every checkpoint, newest first, checked for form only (cheap: what
        a node tells the coordinator it holds; loading verifies the rest)."""
        found = []
        for step in self.steps():
            with contextlib.suppress(CheckpointError):
                found.append(self.manifest(step))
        return found

    def open_tensors(self, manifest: Manifest) -> BinaryIO:
        """The tensor file `manifest` names, open for reading; CheckpointError."""
        try:
            return open(self.path / manifest.file, "rb")  # the caller closes it
        except OSError as exc:
            raise CheckpointError(f"{self.path / manifest.file}: cannot read it: "
                                  f"{exc.strerror}") from None  # fmt: skip

    def load(self, step: int, model: BlockModel) -> tuple[Manifest, dict[int, BlockWeights]]:
        """The checkpoint at `step`, every byte verified; CheckpointError otherwise."""
        manifest = self.manifest(step)
        path = self.path / manifest.file
        _check_model(manifest, model, str(path))
        try:
            size = path.stat().st_size
            if size != manifest.bytes:
                raise CheckpointError(f"{path}: {size} bytes, the manifest says "
                                      f"{manifest.bytes} (truncated?)")  # fmt: skip
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it: {exc.strerror}") from None
        return manifest, _verify(manifest, data, model, str(path))

    def verified(self, model: BlockModel | None = None) -> list[Manifest]:
        """The manifest of every checkpoint that loads, newest first (each loaded, checked and
        let go in turn); each refused one is logged with why."""
        good = []
        for step in self.steps():
            try:
                m = model or get_model(self.manifest(step).model)
                good.append(self.load(step, m)[0])
            except RavnestError as exc:
                log.warning("checkpoint refused: %s", exc)
        return good

    def latest(self, model: BlockModel) -> tuple[Manifest, dict[int, BlockWeights]] | None:
        """The newest checkpoint that loads (older ones are tried in turn when a newer one is
        refused, and each refusal is logged); None if there is none."""
        for step in self.steps():
            try:
                return self.load(step, model)
            except CheckpointError as exc:
                log.warning("checkpoint refused, trying an older one: %s", exc)
        return None


class CheckpointCopies:
    """Copies of other nodes' checkpoints, one folder per block range
    (`checkpoint-copies/blocks-FFFF-SSSS/`, each a CheckpointDir keeping `keep`). Copies of a
    range other than the newest one stored are removed once that one has `keep` copies: a node
    keeps copies of the stage upstream of it, which a re-plan may change."""

    def __init__(
        self, state_dir: Path, keep: int = COPIES_KEEP, *, retention: Retention | None = None
    ) -> None:
        self.root = state_dir / COPIES_DIR_NAME
        self.keep = keep
        self.retention = Retention() if retention is None else retention
        self._lock = threading.Lock()
        self.generation = 0
        """Raised by `drop_after`: a copy fetched before is of the dropped timeline."""

    def dir(self, first_block: int, stop_block: int) -> CheckpointDir:
        name = f"blocks-{first_block:04d}-{stop_block:04d}"
        return CheckpointDir(self.root, self.keep, path=self.root / name, retention=self.retention)

    def dirs(self) -> list[CheckpointDir]:
        if not self.root.is_dir():
            return []
        found = []
        for path in sorted(self.root.iterdir()):
            match = _COPY_DIR.match(path.name)
            if match and path.is_dir():
                found.append(self.dir(int(match.group(1)), int(match.group(2))))
        return found

    def store(self, manifest: Manifest, data: bytes, generation: int, model: BlockModel) -> None:
        """Keep a copy (CheckpointDir.save_copy) fetched in `generation`; then drop other
        ranges' copies if this range has `keep` now (unless the retention holds them).
        Blocking: call it from a worker thread. CheckpointError if a `drop_after` came since
        the copy was asked for."""
        with self._lock:
            if generation != self.generation:
                raise CheckpointError(f"copy of step {manifest.step}: asked for before the "
                                      "run went back to an earlier step")  # fmt: skip
            here = self.dir(manifest.first_block, manifest.stop_block)
            here.save_copy(manifest, data, model)
            with self.retention.pruning() as may_remove:
                if may_remove and len(here.steps()) >= self.keep:
                    for other in self.dirs():
                        if other.path != here.path:
                            shutil.rmtree(other.path, ignore_errors=True)

    def manifests(self) -> list[Manifest]:
        """Every copy's manifest (checked for form), newest first."""
        found = [m for d in self.dirs() for m in d.manifests()]
        return sorted(found, key=lambda m: m.step, reverse=True)

    def drop_after(self, step: int) -> list[int]:
        """Remove copies newer than `step` (another timeline's, after a restore), and refuse
        copies asked for before this call."""
        with self._lock:
            self.generation += 1
            return sorted({s for d in self.dirs() for s in d.drop_after(step)})


def _check_model(manifest: Manifest, model: BlockModel, where: str) -> None:
    if manifest.model != model.name:
        raise CheckpointError(f"{where}: it is of model {manifest.model!r}, not {model.name!r}")
    if not 0 <= manifest.first_block < manifest.stop_block <= model.num_blocks():
        raise CheckpointError(f"{where}: blocks [{manifest.first_block}, {manifest.stop_block}) "
                              f"are not blocks of {model.name}")  # fmt: skip


def _verify(
    manifest: Manifest, data: bytes, model: BlockModel, where: str
) -> dict[int, BlockWeights]:
    """The blocks in a checkpoint's tensor file `data`, every byte checked against `manifest`
    and `model`; CheckpointError naming `where` otherwise."""

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}")

    _check_model(manifest, model, where)
    if len(data) != manifest.bytes:
        raise refuse(f"{len(data)} bytes, the manifest says {manifest.bytes} (truncated?)")
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        raise refuse("its sha256 does not match the manifest (corrupt)")
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise refuse(f"not a safetensors file: {exc}") from None
    by_block: dict[int, dict[tuple[str, str], torch.Tensor]] = {b: {} for b in manifest.blocks}
    for key, t in tensors.items():
        parts = key.split("/", 2)
        if len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) not in by_block:
            raise refuse(f"unexpected tensor {key[:80]!r}")
        by_block[int(parts[0])][(parts[1], parts[2])] = t
    with shapes_only():
        built = model.build_stage(0, manifest.first_block, manifest.stop_block)
    out: dict[int, BlockWeights] = {}
    for block, module in zip(manifest.blocks, built, strict=True):

        def refuse_block(what: str, block: int = block) -> CheckpointError:
            return refuse(f"block {block}: {what}")

        out[block] = check_block(
            by_block[block],
            shapes=block_shapes(module),
            index=block,
            version=manifest.step,
            optimizer_step=manifest.optimizer_steps.get(block, 0.0),
            refuse=refuse_block,
        )
    return out


def _parse_manifest(obj: Any, step: int) -> Manifest:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    if obj.get("format") != FORMAT:
        raise ValueError(f"format {str(obj.get('format'))[:40]!r} is not {FORMAT!r}")

    def integer(key: str, low: int = 0) -> int:
        v = obj[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{key} must be an integer >= {low}")
        return v

    def text(key: str, limit: int = 256) -> str:
        v = obj[key]
        if not isinstance(v, str) or len(v) > limit:
            raise ValueError(f"{key} must be a string of at most {limit} characters")
        return v

    steps = obj["optimizer_steps"]
    if not isinstance(steps, dict) or len(steps) > 4096:
        raise ValueError("optimizer_steps must be an object")
    optimizer_steps = {int(k): float(v) for k, v in steps.items()}
    written = obj["written_unix"]
    if not isinstance(written, (int, float)):
        raise ValueError("written_unix must be a number")
    manifest = Manifest(
        step=integer("step"),
        run_key=text("run_key", 64),
        model=text("model", 1024),  # hf:DIR,... names carry a path
        first_block=integer("first_block"),
        stop_block=integer("stop_block", 1),
        pipeline=integer("pipeline"),
        stage=integer("stage"),
        plan_epoch=integer("plan_epoch"),
        samples_seen=integer("samples_seen"),
        optimizer_steps=optimizer_steps,
        file=text("file"),
        bytes=integer("bytes"),
        sha256=text("sha256", 64),
        written_unix=float(written),
    )
    if manifest.step != step:
        raise ValueError(f"it says step {manifest.step}, its name says {step}")
    if manifest.file != f"{_stem(step)}-{manifest.sha256[:16]}.safetensors":
        raise ValueError(f"file {manifest.file[:80]!r} is not {_stem(step)}-<its sha256 "
                         "prefix>.safetensors")  # fmt: skip
    if set(optimizer_steps) - set(manifest.blocks):
        raise ValueError("optimizer_steps names blocks it does not hold")
    return manifest
