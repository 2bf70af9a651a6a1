"""The run spec: what every stage of a swarm must agree on to train one model the same way.

The coordinator's `TrainConfig` becomes the `RunSpec` protobuf inside every plan, so workers
need no training flags of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal

import torch

from ravnest_node.averaging.config import DELTA_CODECS
from ravnest_node.compression import ACTIVATION_ONLY, CODECS, GRADIENT_ONLY
from ravnest_node.compression.aq import reference_bytes
from ravnest_node.compression.auto import AUTO
from ravnest_node.devices import resolve_precision
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.lies import LIES
from ravnest_node.proto import control_pb2 as pb

ScheduleName = Literal["gpipe", "sequential"]
_SCHEDULE_TO_PB = {"gpipe": pb.SCHEDULE_GPIPE, "sequential": pb.SCHEDULE_SEQUENTIAL}
_PB_TO_SCHEDULE: dict[int, ScheduleName] = {v: k for k, v in _SCHEDULE_TO_PB.items()}  # type: ignore[misc]
MAX_BATCH_SIZE = 4096
# Room for a frame's prefix and msgpack header next to its payloads.
FRAME_OVERHEAD_BYTES = 1024
MAX_DATASET_SAMPLES = 1 << 24
MAX_STALENESS = 8
MAX_PIPELINES = 64
MAX_STAGES = 1024  # a plan names each stage; no model here has nearly as many blocks
# A frame lists a microbatch's sample ids in its header (FrameLimits.max_samples).
MAX_MICROBATCH_WITH_IDS = 512
# aq-delta keeps a float32 reference per sample at each end of a boundary.
MAX_REFERENCE_BYTES = 16 << 30
FP16_LOSS_SCALE = 2.0**12
"""The loss scale of an fp16 run: fixed, so that every stage of a pipeline agrees on it
without talking (a dynamic scale would have to be agreed on across stages each step). The
last stage multiplies the loss by it, the gradients cross stages scaled, and each stage
divides its parameters' gradients by it before its optimizer step, skipping the step if any
is not finite. 2**12 keeps small gradients off fp16's subnormals while leaving 2**4 of head
room below its largest value (65504) for a loss of order 1-10."""


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    """The training run a coordinator hands to its swarm."""

    model: str = "bench-small"
    """Model preset to train: bench-small (4.9 M parameters), small or tiny (for tests)."""
    steps: int = 200
    """Optimizer steps to train for."""
    batch_size: int = 16
    """Samples per optimizer step."""
    microbatches: int = 4
    """Microbatches each step is split into as it flows through the pipeline."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    seed: int = 0
    """Seed of model initialisation and data order; the same seed gives the same run."""
    dataset_samples: int = 0
    """Train on a fixed set of this many byte windows, revisited every epoch in a new order (a
    multiple of batch_size; 0 = a fresh random window for every sample). aq-delta needs it."""
    codec: str = "auto"
    """Codec of activations and gradients: none, fp16, bf16, int8-block, int4-block, klt or
    auto. auto (the default): each link picks none, bf16, int8-block, int4-block or (towards a
    node that decodes it) klt from its measured bandwidth and the stage's compute time, so a
    fast link sends fp32 and a slow one int4-block or klt, klt's activations at a finer step
    where the link has room and klt at a coarser step where even it sets the pace
    (docs/compression.md); int4-block: 4.5 bits per element, 0.2%
    loss at 40 steps of bench-small; klt (transform coding in a learned basis): 17-22x fewer
    bytes than fp32 on bench-small, for about 6 ms of one core per microbatch to encode and
    decode."""
    activation_codec: str = ""
    """Codec for activations only (default: --codec); also aq-delta, aq-delta2, auto."""
    gradient_codec: str = ""
    """Codec for activation gradients only (default: --codec); also topk-ef, auto."""
    lz4: bool = True
    """lz4-compress a frame's payload when that makes it at least 1.1x smaller; with `auto`
    codecs, deflate it instead on a link that is the bottleneck. Off: no packing at all."""
    schedule: ScheduleName = "gpipe"
    """gpipe: a step's microbatches overlap in the pipeline; sequential: one at a time (naive)."""
    max_staleness: int = 1
    """Updates a stage may apply between a microbatch's forward and backward (0 = synchronous;
    1 lets the first stage feed the next step while gradients of this one flow back)."""
    staleness_warmup_steps: int = 20
    """Steps trained synchronously before max_staleness applies: stale gradients hurt most
    while the loss falls fastest (PipeMare, arXiv 1910.05124, warms up for the same reason)."""
    stale_microbatches: int = 2
    """Of each step's microbatches, how many a stage may run forward before the update they
    follow has landed (with staleness): the step's first ones; the rest wait for the update
    and run with its weights. 0, or as many as the step has: all of them."""
    stale_after_backwards: int = 2
    """A microbatch may run forward ahead of the update it follows only once this many of
    that update's microbatches have run backward on the stage (at most microbatches - 1);
    with weight prediction it then runs on the weights AdamW's step makes from their
    gradients, scaled to the whole step, rather than on the moments' prediction: close to
    the weights the update lands. 0: no wait, the moments alone. With the defaults (2 and 2
    of 4 microbatches) the held-out loss of the pipeline bench came within 0.5% of synchronous
    training's on the home and internet links, against +1.1-3.0% with the whole step ahead
    (0 and 0), at the same speed within the runs' noise (docs/architecture.md, "How many
    microbatches run ahead, and when")."""
    ahead_wait_share: float = 0.1
    """A stage whose wait for the update's gradients (stale_after_backwards) idles it for more
    than this share of its time over its first 5 asynchronous steps tries the next 5 with the
    whole step ahead on the moments' prediction (as with 0 and 0), and keeps that if its
    mean step was at least 20% shorter, else waits again: where a link's latency bounds
    the pipeline (the bench's mobile link) the wait costs time, where compute does it costs
    nothing (pipeline/ahead.py). 0: never tries."""
    weight_prediction: bool = True
    """A microbatch that runs forward s optimizer steps before the step its gradient joins
    (staleness s >= 1) uses the weights AdamW's moments predict s steps ahead, and its backward
    the same ones: the gradient is taken about where it is applied (SpecTrain, arXiv
    1809.02839). Synchronous steps are unchanged."""
    fault_skip_step_stage: int | None = None
    """Test only: the stage with this index skips its optimizer step (to prove tests catch it)."""
    fault_slow_stage: int | None = None
    """Test only: the stage with this index works fault_slow_ms longer per microbatch."""
    fault_slow_ms: int = 0
    """Test only: extra milliseconds per microbatch on fault_slow_stage."""
    fault_slow_link: int | None = None
    """Test only: pace the link from the stage with this index to the next to fault_link_kbps.
    Both directions; senders hold frames and probes as long as a link of that rate would."""
    fault_link_kbps: int = 0
    """Test only: rate of fault_slow_link, in kilobits per second."""
    fault_poison_pipeline: int | None = None
    """Test only: the replicas in the pipeline with this index push deltas 10^4 times their
    size to the others while training honestly themselves (a poisoning member)."""
    fault_lie_stage: int | None = None
    """Test only: the node owning the stage with this index in pipeline 0 sends plausibly wrong
    activations and gradients (fault_lie_kind) from step fault_lie_after on (a dishonest
    member; pipeline/lies.py)."""
    fault_lie_after: int = 0
    """Test only: the step from which fault_lie_stage lies."""
    fault_lie_kind: str = "rotate"
    """Test only: how fault_lie_stage lies: rotate (features shifted by half their width: the
    honest norm, another direction), negate or scale (x2)."""
    audit_share: float = 0.02
    """The share of its neighbours' microbatches each stage audits: one in every round(1 /
    share) activations and gradients it receives, at a place in that window the sender cannot
    know, is recomputed from the sender's record and compared (pipeline/audit.py;
    docs/security.md). 0: no audits."""
    stages: int = 0
    """Stages per pipeline. 0 (the default): the planner chooses from the members' measured
    speeds, memory and links, and may leave members spare where that is clearly faster (one
    node alone rather than a pipeline over a slow link); N: every pipeline has exactly N
    stages, spare members only beyond that (benchmarks compare pipelines of a fixed shape)."""
    pipelines: int = 1
    """Pipelines training side by side, each on its own shard of the data; the swarm's nodes are
    split evenly between them and the owners of a stage average as a replica group."""
    average_every: int = 16
    """Local optimizer steps between two averaging rounds of a replica group (DiLoCo's H)."""
    outer_lr: float = 0.7
    """Learning rate of the outer (Nesterov) step applied to the averaged parameter delta."""
    outer_momentum: float = 0.9
    """Momentum of the outer Nesterov step."""
    average_codec: str = "int4-block"
    """Codec of the parameter deltas replicas exchange, with error feedback: none, bf16,
    int8-block, int4-block or powersgd (rank 4, docs/averaging.md)."""
    average_timeout_s: float = 10.0
    """How long an averaging round waits for the other replicas before leaving them out."""
    checkpoint_every: int = 50
    """Each stage writes a checkpoint (its blocks, AdamW moments and step) to its node's
    --state-dir/checkpoints after every this many steps; also when a plan or the run ends and
    when the node stops. 0: only then. `start --resume` carries on from them."""
    precision: str = "auto"
    """Compute precision: auto, fp32, bf16 or fp16. Each node resolves it for its own device
    (auto: bf16 on a CUDA device that has it, fp32 elsewhere), so a swarm may mix them. bf16
    and fp16 run forwards, the loss and backwards under autocast with float32 weights and
    AdamW state; activations and gradients then travel in that dtype. fp16 multiplies the loss
    by the fixed FP16_LOSS_SCALE (gradients travel scaled) and a stage skips a step whose
    gradients are not finite."""
    eval_every: int = 0
    """Evaluate on the model's held-out data (an hf: model's eval=) every this many steps and
    after the last: pipeline 0's first stage sends eval_batches batches of it forward through
    the pipeline, each stage with the weights it holds then (within max_staleness steps of the
    first stage's), no gradients; the mean loss shows in the progress lines, status, /metrics
    and the page. 0 (the default): no evaluation."""
    eval_batches: int = 2
    """Batches (of batch_size samples) of held-out data one evaluation runs: the same ones each
    time, so that evaluations compare."""
    recompute: bool = False
    """Activation recomputation: a stage keeps only the input of each microbatch in flight and
    runs its forward again in the backward (one more forward for far less memory: the
    activations inside a stage are held by at most one microbatch at a time)."""

    def __post_init__(self) -> None:
        get_model(self.model)  # raises ConfigError naming the known presets
        self._check_batches()
        self._check_optimizer()
        self._check_seed()
        self._check_checkpoints()
        self._check_codecs()
        self._check_dataset()
        self._check_sample_codecs()
        self._check_staleness()
        self._check_replicas()
        self._check_stages()
        self._check_warmup()
        self._check_faults()
        self._check_eval()
        if not 0.0 <= self.audit_share <= 1.0:
            raise ConfigError(f"audit_share={self.audit_share}: must be 0 to 1")
        resolve_precision(self.precision, torch.device("cpu"))  # ConfigError naming the choices

    def _check_batches(self) -> None:
        """Steps, and how a step's batch splits into microbatches."""
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps}: must be at least 1")
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE or self.microbatches < 1:
            raise ConfigError(
                f"batch_size must be 1 to {MAX_BATCH_SIZE} and microbatches at least 1"
            )
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"batch_size={self.batch_size} must be divisible by microbatches="
                f"{self.microbatches}"
            )

    def _check_optimizer(self) -> None:
        if not self.lr > 0 or self.weight_decay < 0:
            raise ConfigError("lr must be > 0 and weight_decay >= 0")

    def _check_seed(self) -> None:
        if self.seed < 0:
            raise ConfigError(f"seed={self.seed}: must not be negative")

    def _check_checkpoints(self) -> None:
        if not 0 <= self.checkpoint_every <= 1_000_000:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every}: must be 0 to 1000000")

    def _check_codecs(self) -> None:
        """Codec names, and each in a direction it can code."""
        for role, name in (
            ("codec", self.codec),
            ("activation_codec", self.activation_codec),
            ("gradient_codec", self.gradient_codec),
        ):
            if name and name != AUTO and name not in CODECS:
                raise ConfigError(f"{role}={name!r}: choose one of {', '.join(CODECS)} or {AUTO}")
        if self.activation in GRADIENT_ONLY:
            raise ConfigError(
                f"{self.activation} is for gradients only: use it as --gradient-codec"
            )
        if self.gradient in ACTIVATION_ONLY:
            raise ConfigError(
                f"{self.gradient} is for activations only: use it as --activation-codec"
            )

    def _check_dataset(self) -> None:
        n = self.dataset_samples
        if not 0 <= n <= MAX_DATASET_SAMPLES:
            raise ConfigError(f"dataset_samples={n}: must be 0 to {MAX_DATASET_SAMPLES}")
        if n % self.batch_size:
            raise ConfigError(
                f"dataset_samples={n} must be a multiple of batch_size={self.batch_size} "
                "(so that no batch holds a sample twice)"
            )
        if n and self.microbatch_size > MAX_MICROBATCH_WITH_IDS:
            raise ConfigError(
                f"with dataset_samples, microbatches may hold at most {MAX_MICROBATCH_WITH_IDS} "
                f"samples (their ids travel in frame headers), not {self.microbatch_size}"
            )

    def _check_sample_codecs(self) -> None:
        """Codecs that code a sample against its previous visit (aq-delta): they need a fixed
        dataset, and memory for a reference per sample."""
        n = self.dataset_samples
        if self.activation in ACTIVATION_ONLY:
            if not n:
                raise ConfigError(
                    f"{self.activation} compresses a sample against its previous visit: set "
                    "dataset_samples to train on a fixed dataset for several epochs"
                )
            need = aq_reference_bytes(self)
            if need > MAX_REFERENCE_BYTES:
                raise ConfigError(
                    f"{self.activation} would keep {need / 2**30:.1f} GiB of references per "
                    f"boundary end (at most {MAX_REFERENCE_BYTES >> 30} GiB): use fewer "
                    "dataset_samples"
                )

    def _check_staleness(self) -> None:
        if not 0 <= self.max_staleness <= MAX_STALENESS:
            raise ConfigError(
                f"max_staleness={self.max_staleness}: must be 0 to {MAX_STALENESS} (each unit "
                "keeps one more step of microbatches and one more weight copy in flight)"
            )
        if self.stale_microbatches < 0:
            raise ConfigError(f"stale_microbatches={self.stale_microbatches}: must not be negative")
        if self.stale_after_backwards < 0:
            raise ConfigError(
                f"stale_after_backwards={self.stale_after_backwards}: must not be negative"
            )
        if not 0 <= self.ahead_wait_share <= 1:
            raise ConfigError(f"ahead_wait_share={self.ahead_wait_share}: must be 0 to 1")

    def _check_replicas(self) -> None:
        """Pipelines side by side, and how their replicas average."""
        if not 1 <= self.pipelines <= MAX_PIPELINES:
            raise ConfigError(f"pipelines={self.pipelines}: must be 1 to {MAX_PIPELINES}")
        if self.average_every < 1 or not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                "average_every must be >= 1, outer_lr > 0 and outer_momentum in [0, 1)"
            )
        if self.average_codec not in DELTA_CODECS:
            raise ConfigError(
                f"average_codec={self.average_codec!r}: choose one of {', '.join(DELTA_CODECS)}"
            )
        if not 0 < self.average_timeout_s <= 3600:
            raise ConfigError(f"average_timeout_s={self.average_timeout_s}: must be in (0, 3600]")

    def _check_stages(self) -> None:
        if not 0 <= self.stages <= MAX_STAGES:
            raise ConfigError(
                f"stages={self.stages}: must be 0 (the planner chooses) to {MAX_STAGES}"
            )

    def _check_warmup(self) -> None:
        if self.staleness_warmup_steps < 0:
            raise ConfigError(
                f"staleness_warmup_steps={self.staleness_warmup_steps}: must not be negative"
            )

    def _check_eval(self) -> None:
        if not 0 <= self.eval_every <= 1_000_000:
            raise ConfigError(f"eval_every={self.eval_every}: must be 0 to 1000000")
        if not 1 <= self.eval_batches <= 64:
            raise ConfigError(f"eval_batches={self.eval_batches}: must be 1 to 64")
        if self.eval_every and not get_model(self.model).held_out:
            raise ConfigError(
                f"eval_every={self.eval_every}: model {self.model!r} has no held-out data; "
                "name some with eval= (an hf: model's share of its data=, or a file)"
            )

    def _check_faults(self) -> None:
        """The test-only fault injections."""
        if self.fault_lie_kind not in LIES or self.fault_lie_after < 0:
            raise ConfigError(
                f"fault_lie_kind={self.fault_lie_kind!r}: choose one of {', '.join(LIES)}; "
                "fault_lie_after must not be negative"
            )
        if not 0 <= self.fault_slow_ms <= 60_000:
            raise ConfigError(f"fault_slow_ms={self.fault_slow_ms}: must be 0 to 60000")
        if (self.fault_slow_link is None) != (self.fault_link_kbps == 0) or not (
            0 <= self.fault_link_kbps <= 10_000_000
        ):
            raise ConfigError(
                f"fault_slow_link={self.fault_slow_link} needs fault_link_kbps in 1..10000000 "
                f"and the other way round (got {self.fault_link_kbps})"
            )

    @property
    def activation(self) -> str:
        """The codec activations travel with."""
        return self.activation_codec or self.codec

    @property
    def gradient(self) -> str:
        """The codec activation gradients travel with."""
        return self.gradient_codec or self.codec

    @property
    def loss_scale(self) -> float:
        """What the loss, and so every gradient crossing a stage, is multiplied by: the fixed
        FP16_LOSS_SCALE in an fp16 run, 1 otherwise (one value for the whole pipeline)."""
        return FP16_LOSS_SCALE if self.precision == "fp16" else 1.0

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    @property
    def ahead_after(self) -> int:
        """Backwards of the current update a stage waits for before it runs a microbatch
        ahead: stale_after_backwards, at most microbatches - 1 (the last one lands the
        update)."""
        return min(self.stale_after_backwards, self.microbatches - 1)

    def staleness_bound(self, step: int) -> int:
        """The most updates microbatches of `step` may see between forward and backward:
        0 during the warm-up, max_staleness after."""
        return 0 if step < self.staleness_warmup_steps else self.max_staleness

    @property
    def eval_microbatches(self) -> int:
        """Microbatches of one evaluation."""
        return self.eval_batches * self.microbatches

    def evaluates_at(self, step: int) -> bool:
        """An evaluation follows `step` (applied): every eval_every steps and the run's last."""
        every = self.eval_every
        return bool(every) and 0 < step <= self.steps and (step % every == 0 or step == self.steps)

    @property
    def window(self) -> int:
        """Most microbatches a stage may hold between forward and backward, and most frames of
        one direction that may wait for it: (max_staleness + 1) steps of microbatches."""
        return (self.max_staleness + 1) * self.microbatches

    def to_proto(self, data_fingerprint: str) -> pb.RunSpec:
        spec = pb.RunSpec(
            model=self.model,
            steps=self.steps,
            batch_size=self.batch_size,
            microbatches=self.microbatches,
            lr=self.lr,
            weight_decay=self.weight_decay,
            seed=self.seed,
            dataset_samples=self.dataset_samples,
            pipelines=self.pipelines,
            stages=self.stages,
            average_every=self.average_every,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            average_codec=self.average_codec,
            average_timeout_s=self.average_timeout_s,
            activation_codec=self.activation,
            gradient_codec=self.gradient,
            lz4=self.lz4,
            max_staleness=self.max_staleness,
            staleness_warmup_steps=self.staleness_warmup_steps,
            weight_prediction=self.weight_prediction,
            stale_microbatches=self.stale_microbatches,
            stale_after_backwards=self.stale_after_backwards,
            ahead_wait_share=self.ahead_wait_share,
            data_fingerprint=data_fingerprint,
            schedule=_SCHEDULE_TO_PB[self.schedule],
            checkpoint_every=self.checkpoint_every,
            recompute=self.recompute,
            precision=self.precision,
            eval_every=self.eval_every,
            eval_batches=self.eval_batches,
            audit_share=self.audit_share,
        )
        if self.fault_skip_step_stage is not None:
            spec.fault_skip_step_stage = self.fault_skip_step_stage
        if self.fault_slow_stage is not None:
            spec.fault_slow_stage = self.fault_slow_stage
            spec.fault_slow_ms = self.fault_slow_ms
        if self.fault_slow_link is not None:
            spec.fault_slow_link = self.fault_slow_link
            spec.fault_link_kbps = self.fault_link_kbps
        if self.fault_poison_pipeline is not None:
            spec.fault_poison_pipeline = self.fault_poison_pipeline
        if self.fault_lie_stage is not None:
            spec.fault_lie_stage = self.fault_lie_stage
            spec.fault_lie_after = self.fault_lie_after
            spec.fault_lie_kind = self.fault_lie_kind
        return spec

    @classmethod
    def from_proto(cls, spec: pb.RunSpec) -> TrainConfig:
        """The run spec of a received plan; ConfigError if it is not one this node can run."""
        schedule = _PB_TO_SCHEDULE.get(spec.schedule)
        if schedule is None:
            raise ConfigError(f"plan names schedule {spec.schedule}, which this node does not know")
        return cls(
            model=spec.model,
            steps=spec.steps,
            batch_size=spec.batch_size,
            microbatches=spec.microbatches,
            lr=spec.lr,
            weight_decay=spec.weight_decay,
            seed=spec.seed,
            dataset_samples=spec.dataset_samples,
            pipelines=spec.pipelines,
            stages=spec.stages,
            average_every=spec.average_every,
            outer_lr=spec.outer_lr,
            outer_momentum=spec.outer_momentum,
            average_codec=spec.average_codec,
            average_timeout_s=spec.average_timeout_s,
            activation_codec=spec.activation_codec,
            gradient_codec=spec.gradient_codec,
            lz4=spec.lz4,
            max_staleness=spec.max_staleness,
            staleness_warmup_steps=spec.staleness_warmup_steps,
            weight_prediction=spec.weight_prediction,
            stale_microbatches=spec.stale_microbatches,
            stale_after_backwards=spec.stale_after_backwards,
            ahead_wait_share=spec.ahead_wait_share,
            schedule=schedule,
            checkpoint_every=spec.checkpoint_every,
            recompute=spec.recompute,
            precision=spec.precision or "auto",
            eval_every=spec.eval_every,
            eval_batches=spec.eval_batches or 2,
            fault_skip_step_stage=(
                spec.fault_skip_step_stage if spec.HasField("fault_skip_step_stage") else None
            ),
            fault_slow_stage=(spec.fault_slow_stage if spec.HasField("fault_slow_stage") else None),
            fault_slow_ms=spec.fault_slow_ms if spec.HasField("fault_slow_stage") else 0,
            fault_slow_link=spec.fault_slow_link if spec.HasField("fault_slow_link") else None,
            fault_link_kbps=spec.fault_link_kbps if spec.HasField("fault_slow_link") else 0,
            fault_poison_pipeline=(
                spec.fault_poison_pipeline if spec.HasField("fault_poison_pipeline") else None
            ),
            fault_lie_stage=spec.fault_lie_stage if spec.HasField("fault_lie_stage") else None,
            fault_lie_after=spec.fault_lie_after if spec.HasField("fault_lie_stage") else 0,
            fault_lie_kind=spec.fault_lie_kind or "rotate",
            audit_share=spec.audit_share if spec.HasField("audit_share") else 0.0,
        )

    def link_pace_bps(self, from_stage: int) -> float:
        """Test only: the rate (bits/s) at which the link from stage `from_stage` to the next
        is paced, in either direction; 0 for an unpaced link."""
        return self.fault_link_kbps * 1000.0 if self.fault_slow_link == from_stage else 0.0


def aq_reference_bytes(run: TrainConfig) -> int:
    """Memory aq-delta's references take at one end of the largest stage boundary."""
    model = get_model(run.model)
    per_sample = max(
        (model.output_spec(b, 1).shape for b in range(model.num_blocks() - 1)),
        key=lambda shape: prod(shape),
        default=(1,),
    )
    return reference_bytes(run.dataset_samples, per_sample[1:])


def largest_frame_bytes(run: TrainConfig) -> int:
    """Upper bound of one data-plane message of this run: the largest activation that can cross
    a stage boundary (uncompressed) plus the targets that travel with it."""
    model = get_model(run.model)
    mb = run.microbatch_size
    boundary = max(
        (model.output_spec(b, mb).size_bytes for b in range(model.num_blocks() - 1)), default=0
    )
    return boundary + model.target_spec(mb).size_bytes + FRAME_OVERHEAD_BYTES


def check_frame_limit(run: TrainConfig, max_message_bytes: int) -> None:
    """ConfigError if frames of this run would not fit the transport's message limit."""
    need = largest_frame_bytes(run)
    if need > max_message_bytes:
        raise ConfigError(
            f"max_message_bytes={max_message_bytes} is too small for {run.model} with "
            f"microbatches of {run.microbatch_size}: frames need up to {need} bytes"
        )


def check_swarm_shape(nodes: int, run: TrainConfig) -> None:
    """ConfigError unless `nodes` split into `run.pipelines` equal pipelines of at most as many
    stages as the model has blocks."""
    if nodes % run.pipelines:
        raise ConfigError(
            f"{nodes} nodes cannot form {run.pipelines} equal pipelines: use a multiple"
        )
    num_blocks = get_model(run.model).num_blocks()
    if run.stages > min(num_blocks, nodes // run.pipelines):
        raise ConfigError(
            f"stages={run.stages}: {nodes} nodes in {run.pipelines} pipeline(s) of model "
            f"{run.model} ({num_blocks} blocks) make at most "
            f"{min(num_blocks, nodes // run.pipelines)} stages per pipeline"
        )
    if nodes // run.pipelines > num_blocks:
        raise ConfigError(
            f"nodes={nodes}: model {run.model} has only {num_blocks} blocks, so at most that "
            f"many stages per pipeline ({run.pipelines} pipelines)"
        )
