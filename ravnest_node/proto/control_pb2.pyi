from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Schedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_UNSPECIFIED: _ClassVar[Schedule]
    SCHEDULE_GPIPE: _ClassVar[Schedule]
    SCHEDULE_SEQUENTIAL: _ClassVar[Schedule]

class NodeRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_ROLE_UNSPECIFIED: _ClassVar[NodeRole]
    NODE_ROLE_COORDINATOR: _ClassVar[NodeRole]
    NODE_ROLE_WORKER: _ClassVar[NodeRole]

class FoundVia(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FOUND_VIA_UNSPECIFIED: _ClassVar[FoundVia]
    FOUND_VIA_CONFIG: _ClassVar[FoundVia]
    FOUND_VIA_MDNS: _ClassVar[FoundVia]
    FOUND_VIA_PEER: _ClassVar[FoundVia]
    FOUND_VIA_ELECTION: _ClassVar[FoundVia]
SCHEDULE_UNSPECIFIED: Schedule
SCHEDULE_GPIPE: Schedule
SCHEDULE_SEQUENTIAL: Schedule
NODE_ROLE_UNSPECIFIED: NodeRole
NODE_ROLE_COORDINATOR: NodeRole
NODE_ROLE_WORKER: NodeRole
FOUND_VIA_UNSPECIFIED: FoundVia
FOUND_VIA_CONFIG: FoundVia
FOUND_VIA_MDNS: FoundVia
FOUND_VIA_PEER: FoundVia
FOUND_VIA_ELECTION: FoundVia

class RevokeRequest(_message.Message):
    __slots__ = ("revocations",)
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    revocations: bytes
    def __init__(self, revocations: _Optional[bytes] = ...) -> None: ...

class RevokeReply(_message.Message):
    __slots__ = ("serial", "plan_epoch", "banned")
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    serial: int
    plan_epoch: int
    banned: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, serial: _Optional[int] = ..., plan_epoch: _Optional[int] = ..., banned: _Optional[_Iterable[str]] = ...) -> None: ...

class AuditReport(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "suspect_id", "record", "received", "distance")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    suspect_id: str
    record: bytes
    received: bytes
    distance: float
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., suspect_id: _Optional[str] = ..., record: _Optional[bytes] = ..., received: _Optional[bytes] = ..., distance: _Optional[float] = ...) -> None: ...

class AuditReply(_message.Message):
    __slots__ = ("banned", "distance")
    BANNED_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_FIELD_NUMBER: _ClassVar[int]
    banned: bool
    distance: float
    def __init__(self, banned: _Optional[bool] = ..., distance: _Optional[float] = ...) -> None: ...

class SuspectRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "suspects", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    suspects: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., suspects: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class SuspectReply(_message.Message):
    __slots__ = ("lost",)
    LOST_FIELD_NUMBER: _ClassVar[int]
    lost: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lost: _Optional[_Iterable[str]] = ...) -> None: ...

class VoteRequest(_message.Message):
    __slots__ = ("swarm_name", "term", "candidate_id", "plan_epoch", "node_certificate")
    SWARM_NAME_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    swarm_name: str
    term: int
    candidate_id: str
    plan_epoch: int
    node_certificate: bytes
    def __init__(self, swarm_name: _Optional[str] = ..., term: _Optional[int] = ..., candidate_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., node_certificate: _Optional[bytes] = ...) -> None: ...

class VoteReply(_message.Message):
    __slots__ = ("term", "granted", "reason")
    TERM_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    term: int
    granted: bool
    reason: str
    def __init__(self, term: _Optional[int] = ..., granted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class AuditRecordRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "seq", "backward")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    seq: int
    backward: bool
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., seq: _Optional[int] = ..., backward: _Optional[bool] = ...) -> None: ...

class AuditChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "pipeline", "stop_step")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STOP_STEP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    pipeline: int
    stop_step: int
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., pipeline: _Optional[int] = ..., stop_step: _Optional[int] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("stop_step",)
    STOP_STEP_FIELD_NUMBER: _ClassVar[int]
    stop_step: int
    def __init__(self, stop_step: _Optional[int] = ...) -> None: ...

class BlockRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "block")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    block: int
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., block: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "step")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    step: int
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("manifest", "offset", "data")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    manifest: bytes
    offset: int
    data: bytes
    def __init__(self, manifest: _Optional[bytes] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("block", "version", "optimizer_step", "name", "role", "dtype", "shape", "offset", "data")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block: int
    version: int
    optimizer_step: float
    name: str
    role: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, block: _Optional[int] = ..., version: _Optional[int] = ..., optimizer_step: _Optional[float] = ..., name: _Optional[str] = ..., role: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node_id", "address", "compute_threads", "protocol", "capabilities", "plan_epoch", "node_certificate")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_THREADS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    compute_threads: int
    protocol: str
    capabilities: Capabilities
    plan_epoch: int
    node_certificate: bytes
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., compute_threads: _Optional[int] = ..., protocol: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., plan_epoch: _Optional[int] = ..., node_certificate: _Optional[bytes] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("block_s", "memory_bytes", "device", "checkpoints", "uplink_bps", "rtt_s", "relay_node_id", "peer_links", "relay_address", "unpacks_deflate", "decodes_klt", "klt_coder")
    BLOCK_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    UPLINK_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_LINKS_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UNPACKS_DEFLATE_FIELD_NUMBER: _ClassVar[int]
    DECODES_KLT_FIELD_NUMBER: _ClassVar[int]
    KLT_CODER_FIELD_NUMBER: _ClassVar[int]
    block_s: _containers.RepeatedScalarFieldContainer[float]
    memory_bytes: int
    device: str
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointOffer]
    uplink_bps: float
    rtt_s: float
    relay_node_id: str
    peer_links: _containers.RepeatedCompositeFieldContainer[PeerLink]
    relay_address: str
    unpacks_deflate: bool
    decodes_klt: bool
    klt_coder: int
    def __init__(self, block_s: _Optional[_Iterable[float]] = ..., memory_bytes: _Optional[int] = ..., device: _Optional[str] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointOffer, _Mapping]]] = ..., uplink_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ..., relay_node_id: _Optional[str] = ..., peer_links: _Optional[_Iterable[_Union[PeerLink, _Mapping]]] = ..., relay_address: _Optional[str] = ..., unpacks_deflate: _Optional[bool] = ..., decodes_klt: _Optional[bool] = ..., klt_coder: _Optional[int] = ...) -> None: ...

class PeerLink(_message.Message):
    __slots__ = ("node_id", "to_bps", "from_bps", "rtt_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TO_BPS_FIELD_NUMBER: _ClassVar[int]
    FROM_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    to_bps: float
    from_bps: float
    rtt_s: float
    def __init__(self, node_id: _Optional[str] = ..., to_bps: _Optional[float] = ..., from_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ...) -> None: ...

class CheckpointOffer(_message.Message):
    __slots__ = ("step", "first_block", "stop_block", "run_key", "pipeline", "stage", "plan_epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    STOP_BLOCK_FIELD_NUMBER: _ClassVar[int]
    RUN_KEY_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    first_block: int
    stop_block: int
    run_key: str
    pipeline: int
    stage: int
    plan_epoch: int
    def __init__(self, step: _Optional[int] = ..., first_block: _Optional[int] = ..., stop_block: _Optional[int] = ..., run_key: _Optional[str] = ..., pipeline: _Optional[int] = ..., stage: _Optional[int] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("swarm_id", "member_index", "swarm_size", "model", "microbatch", "lease_s", "started_epoch", "precision", "model_package")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_INDEX_FIELD_NUMBER: _ClassVar[int]
    SWARM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    STARTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    MODEL_PACKAGE_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    member_index: int
    swarm_size: int
    model: str
    microbatch: int
    lease_s: float
    started_epoch: int
    precision: str
    model_package: str
    def __init__(self, swarm_id: _Optional[str] = ..., member_index: _Optional[int] = ..., swarm_size: _Optional[int] = ..., model: _Optional[str] = ..., microbatch: _Optional[int] = ..., lease_s: _Optional[float] = ..., started_epoch: _Optional[int] = ..., precision: _Optional[str] = ..., model_package: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "checkpoints", "rtt_s", "held_epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    HELD_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointOffer]
    rtt_s: float
    held_epoch: int
    def __init__(self, node_id: _Optional[str] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointOffer, _Mapping]]] = ..., rtt_s: _Optional[float] = ..., held_epoch: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease_s", "hold_epoch")
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HOLD_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    hold_epoch: int
    def __init__(self, lease_s: _Optional[float] = ..., hold_epoch: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("hand_off",)
    HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    hand_off: bool
    def __init__(self, hand_off: _Optional[bool] = ...) -> None: ...

class WatchPlanRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("model", "steps", "batch_size", "microbatches", "lr", "weight_decay", "seed", "max_staleness", "data_fingerprint", "fault_skip_step_stage", "schedule", "activation_codec", "gradient_codec", "lz4", "dataset_samples", "fault_slow_stage", "fault_slow_ms", "pipelines", "average_every", "outer_lr", "outer_momentum", "average_codec", "average_timeout_s", "staleness_warmup_steps", "fault_slow_link", "fault_link_kbps", "checkpoint_every", "fault_poison_pipeline", "recompute", "stages", "weight_prediction", "precision", "eval_every", "eval_batches", "fault_lie_stage", "fault_lie_after", "fault_lie_kind", "audit_share", "stale_microbatches", "stale_after_backwards", "ahead_wait_share")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    DATA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FAULT_SKIP_STEP_STAGE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CODEC_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CODEC_FIELD_NUMBER: _ClassVar[int]
    LZ4_FIELD_NUMBER: _ClassVar[int]
    DATASET_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FAULT_SLOW_STAGE_FIELD_NUMBER: _ClassVar[int]
    FAULT_SLOW_MS_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_CODEC_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STALENESS_WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    FAULT_SLOW_LINK_FIELD_NUMBER: _ClassVar[int]
    FAULT_LINK_KBPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    FAULT_POISON_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_PREDICTION_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FAULT_LIE_STAGE_FIELD_NUMBER: _ClassVar[int]
    FAULT_LIE_AFTER_FIELD_NUMBER: _ClassVar[int]
    FAULT_LIE_KIND_FIELD_NUMBER: _ClassVar[int]
    AUDIT_SHARE_FIELD_NUMBER: _ClassVar[int]
    STALE_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    STALE_AFTER_BACKWARDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_WAIT_SHARE_FIELD_NUMBER: _ClassVar[int]
    model: str
    steps: int
    batch_size: int
    microbatches: int
    lr: float
    weight_decay: float
    seed: int
    max_staleness: int
    data_fingerprint: str
    fault_skip_step_stage: int
    schedule: Schedule
    activation_codec: str
    gradient_codec: str
    lz4: bool
    dataset_samples: int
    fault_slow_stage: int
    fault_slow_ms: int
    pipelines: int
    average_every: int
    outer_lr: float
    outer_momentum: float
    average_codec: str
    average_timeout_s: float
    staleness_warmup_steps: int
    fault_slow_link: int
    fault_link_kbps: int
    checkpoint_every: int
    fault_poison_pipeline: int
    recompute: bool
    stages: int
    weight_prediction: bool
    precision: str
    eval_every: int
    eval_batches: int
    fault_lie_stage: int
    fault_lie_after: int
    fault_lie_kind: str
    audit_share: float
    stale_microbatches: int
    stale_after_backwards: int
    ahead_wait_share: float
    def __init__(self, model: _Optional[str] = ..., steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., microbatches: _Optional[int] = ..., lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., seed: _Optional[int] = ..., max_staleness: _Optional[int] = ..., data_fingerprint: _Optional[str] = ..., fault_skip_step_stage: _Optional[int] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., activation_codec: _Optional[str] = ..., gradient_codec: _Optional[str] = ..., lz4: _Optional[bool] = ..., dataset_samples: _Optional[int] = ..., fault_slow_stage: _Optional[int] = ..., fault_slow_ms: _Optional[int] = ..., pipelines: _Optional[int] = ..., average_every: _Optional[int] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., average_codec: _Optional[str] = ..., average_timeout_s: _Optional[float] = ..., staleness_warmup_steps: _Optional[int] = ..., fault_slow_link: _Optional[int] = ..., fault_link_kbps: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., fault_poison_pipeline: _Optional[int] = ..., recompute: _Optional[bool] = ..., stages: _Optional[int] = ..., weight_prediction: _Optional[bool] = ..., precision: _Optional[str] = ..., eval_every: _Optional[int] = ..., eval_batches: _Optional[int] = ..., fault_lie_stage: _Optional[int] = ..., fault_lie_after: _Optional[int] = ..., fault_lie_kind: _Optional[str] = ..., audit_share: _Optional[float] = ..., stale_microbatches: _Optional[int] = ..., stale_after_backwards: _Optional[int] = ..., ahead_wait_share: _Optional[float] = ...) -> None: ...

class StageAssignment(_message.Message):
    __slots__ = ("index", "first_block", "stop_block", "node_id", "address", "pipeline", "relayed", "unpacks_deflate", "member_key_sha256", "decodes_klt", "klt_coder")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    STOP_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    UNPACKS_DEFLATE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_KEY_SHA256_FIELD_NUMBER: _ClassVar[int]
    DECODES_KLT_FIELD_NUMBER: _ClassVar[int]
    KLT_CODER_FIELD_NUMBER: _ClassVar[int]
    index: int
    first_block: int
    stop_block: int
    node_id: str
    address: str
    pipeline: int
    relayed: bool
    unpacks_deflate: bool
    member_key_sha256: bytes
    decodes_klt: bool
    klt_coder: int
    def __init__(self, index: _Optional[int] = ..., first_block: _Optional[int] = ..., stop_block: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., pipeline: _Optional[int] = ..., relayed: _Optional[bool] = ..., unpacks_deflate: _Optional[bool] = ..., member_key_sha256: _Optional[bytes] = ..., decodes_klt: _Optional[bool] = ..., klt_coder: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("epoch", "swarm_id", "run", "stages", "start_step", "pending", "previous", "restore", "banned", "revocations")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    swarm_id: str
    run: RunSpec
    stages: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    start_step: int
    pending: bool
    previous: _containers.RepeatedCompositeFieldContainer[StageAssignment]
    restore: bool
    banned: _containers.RepeatedScalarFieldContainer[str]
    revocations: bytes
    def __init__(self, epoch: _Optional[int] = ..., swarm_id: _Optional[str] = ..., run: _Optional[_Union[RunSpec, _Mapping]] = ..., stages: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ..., start_step: _Optional[int] = ..., pending: _Optional[bool] = ..., previous: _Optional[_Iterable[_Union[StageAssignment, _Mapping]]] = ..., restore: _Optional[bool] = ..., banned: _Optional[_Iterable[str]] = ..., revocations: _Optional[bytes] = ...) -> None: ...

class StageReport(_message.Message):
    __slots__ = ("node_id", "stage", "plan_epoch", "step", "loss", "bytes_sent", "done", "params_sq_sum", "num_params", "compute_s", "activation_bytes_sent", "gradient_bytes_sent", "wall_s", "idle_upstream_s", "idle_downstream_s", "staleness_histogram", "max_in_flight", "max_weight_versions", "pipeline", "averaging_rounds", "averaging_rounds_incomplete", "averaging_bytes_sent", "averaging_wait_s", "activation_codec", "gradient_codec", "activation_codec_frames", "gradient_codec_frames", "downstream_bandwidth_bps", "upstream_bandwidth_bps", "checkpoint_step", "activation_deflated_frames", "gradient_deflated_frames", "activation_fp32_bytes", "gradient_fp32_bytes", "frame_decode_s", "device", "precision", "steps_skipped", "stream_resumes", "frames_resent", "eval_step", "eval_loss", "evals_lost", "audits", "audits_failed", "audits_unanswered", "audit_bytes", "audit_s", "audit_max_passed", "audits_skipped", "ahead_wait_s", "whole_step_ahead_from", "ahead_trial_from")
    class ActivationCodecFramesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GradientCodecFramesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SQ_SUM_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_UPSTREAM_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_DOWNSTREAM_S_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_ROUNDS_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CODEC_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CODEC_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CODEC_FRAMES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CODEC_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DEFLATED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_DEFLATED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FP32_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FP32_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAME_DECODE_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    STEPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    STREAM_RESUMES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_RESENT_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVALS_LOST_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FAILED_FIELD_NUMBER: _ClassVar[int]
    AUDITS_UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    AUDIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    AUDIT_S_FIELD_NUMBER: _ClassVar[int]
    AUDIT_MAX_PASSED_FIELD_NUMBER: _ClassVar[int]
    AUDITS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WHOLE_STEP_AHEAD_FROM_FIELD_NUMBER: _ClassVar[int]
    AHEAD_TRIAL_FROM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    stage: int
    plan_epoch: int
    step: int
    loss: float
    bytes_sent: int
    done: bool
    params_sq_sum: float
    num_params: int
    compute_s: float
    activation_bytes_sent: int
    gradient_bytes_sent: int
    wall_s: float
    idle_upstream_s: float
    idle_downstream_s: float
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    max_in_flight: int
    max_weight_versions: int
    pipeline: int
    averaging_rounds: int
    averaging_rounds_incomplete: int
    averaging_bytes_sent: int
    averaging_wait_s: float
    activation_codec: str
    gradient_codec: str
    activation_codec_frames: _containers.ScalarMap[str, int]
    gradient_codec_frames: _containers.ScalarMap[str, int]
    downstream_bandwidth_bps: float
    upstream_bandwidth_bps: float
    checkpoint_step: int
    activation_deflated_frames: int
    gradient_deflated_frames: int
    activation_fp32_bytes: int
    gradient_fp32_bytes: int
    frame_decode_s: float
    device: str
    precision: str
    steps_skipped: int
    stream_resumes: int
    frames_resent: int
    eval_step: int
    eval_loss: float
    evals_lost: int
    audits: int
    audits_failed: int
    audits_unanswered: int
    audit_bytes: int
    audit_s: float
    audit_max_passed: float
    audits_skipped: int
    ahead_wait_s: float
    whole_step_ahead_from: int
    ahead_trial_from: int
    def __init__(self, node_id: _Optional[str] = ..., stage: _Optional[int] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., done: _Optional[bool] = ..., params_sq_sum: _Optional[float] = ..., num_params: _Optional[int] = ..., compute_s: _Optional[float] = ..., activation_bytes_sent: _Optional[int] = ..., gradient_bytes_sent: _Optional[int] = ..., wall_s: _Optional[float] = ..., idle_upstream_s: _Optional[float] = ..., idle_downstream_s: _Optional[float] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., max_in_flight: _Optional[int] = ..., max_weight_versions: _Optional[int] = ..., pipeline: _Optional[int] = ..., averaging_rounds: _Optional[int] = ..., averaging_rounds_incomplete: _Optional[int] = ..., averaging_bytes_sent: _Optional[int] = ..., averaging_wait_s: _Optional[float] = ..., activation_codec: _Optional[str] = ..., gradient_codec: _Optional[str] = ..., activation_codec_frames: _Optional[_Mapping[str, int]] = ..., gradient_codec_frames: _Optional[_Mapping[str, int]] = ..., downstream_bandwidth_bps: _Optional[float] = ..., upstream_bandwidth_bps: _Optional[float] = ..., checkpoint_step: _Optional[int] = ..., activation_deflated_frames: _Optional[int] = ..., gradient_deflated_frames: _Optional[int] = ..., activation_fp32_bytes: _Optional[int] = ..., gradient_fp32_bytes: _Optional[int] = ..., frame_decode_s: _Optional[float] = ..., device: _Optional[str] = ..., precision: _Optional[str] = ..., steps_skipped: _Optional[int] = ..., stream_resumes: _Optional[int] = ..., frames_resent: _Optional[int] = ..., eval_step: _Optional[int] = ..., eval_loss: _Optional[float] = ..., evals_lost: _Optional[int] = ..., audits: _Optional[int] = ..., audits_failed: _Optional[int] = ..., audits_unanswered: _Optional[int] = ..., audit_bytes: _Optional[int] = ..., audit_s: _Optional[float] = ..., audit_max_passed: _Optional[float] = ..., audits_skipped: _Optional[int] = ..., ahead_wait_s: _Optional[float] = ..., whole_step_ahead_from: _Optional[int] = ..., ahead_trial_from: _Optional[int] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchProgressRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "steps", "loss", "samples", "wall_s", "bytes_on_wire", "done", "summary_json", "error", "eval_step", "eval_loss")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_ON_WIRE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    step: int
    steps: int
    loss: float
    samples: int
    wall_s: float
    bytes_on_wire: int
    done: bool
    summary_json: str
    error: str
    eval_step: int
    eval_loss: float
    def __init__(self, step: _Optional[int] = ..., steps: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., wall_s: _Optional[float] = ..., bytes_on_wire: _Optional[int] = ..., done: _Optional[bool] = ..., summary_json: _Optional[str] = ..., error: _Optional[str] = ..., eval_step: _Optional[int] = ..., eval_loss: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("brief",)
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    brief: bool
    def __init__(self, brief: _Optional[bool] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "address", "plan_epoch", "stage", "first_block", "stop_block", "version", "microbatches_in_flight", "frames_accepted", "frames_refused", "bytes_sent", "params_sha256", "run_done", "upstream_node_id", "role", "swarm_name", "coordinator_address", "coordinator_found_via", "coordinator_found_from", "mdns_peers", "term", "relay", "relay_address", "relayed", "relayed_bytes", "security", "refused_connections", "certificate_expires", "calls_limited", "messages_delayed", "banned_replicas", "requests_malformed", "requests_malformed_by_peer", "device", "precision", "eval_step", "eval_loss")
    class RelayedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RelayedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BannedReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RequestsMalformedByPeerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    STOP_BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    RUN_DONE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SWARM_NAME_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FOUND_VIA_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FOUND_FROM_FIELD_NUMBER: _ClassVar[int]
    MDNS_PEERS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECURITY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_EXPIRES_FIELD_NUMBER: _ClassVar[int]
    CALLS_LIMITED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_DELAYED_FIELD_NUMBER: _ClassVar[int]
    BANNED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MALFORMED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MALFORMED_BY_PEER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    plan_epoch: int
    stage: int
    first_block: int
    stop_block: int
    version: int
    microbatches_in_flight: int
    frames_accepted: int
    frames_refused: int
    bytes_sent: int
    params_sha256: str
    run_done: bool
    upstream_node_id: str
    role: NodeRole
    swarm_name: str
    coordinator_address: str
    coordinator_found_via: FoundVia
    coordinator_found_from: str
    mdns_peers: int
    term: int
    relay: str
    relay_address: str
    relayed: _containers.ScalarMap[str, str]
    relayed_bytes: _containers.ScalarMap[str, int]
    security: str
    refused_connections: int
    certificate_expires: float
    calls_limited: int
    messages_delayed: int
    banned_replicas: _containers.ScalarMap[str, str]
    requests_malformed: int
    requests_malformed_by_peer: _containers.ScalarMap[str, int]
    device: str
    precision: str
    eval_step: int
    eval_loss: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., stage: _Optional[int] = ..., first_block: _Optional[int] = ..., stop_block: _Optional[int] = ..., version: _Optional[int] = ..., microbatches_in_flight: _Optional[int] = ..., frames_accepted: _Optional[int] = ..., frames_refused: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., params_sha256: _Optional[str] = ..., run_done: _Optional[bool] = ..., upstream_node_id: _Optional[str] = ..., role: _Optional[_Union[NodeRole, str]] = ..., swarm_name: _Optional[str] = ..., coordinator_address: _Optional[str] = ..., coordinator_found_via: _Optional[_Union[FoundVia, str]] = ..., coordinator_found_from: _Optional[str] = ..., mdns_peers: _Optional[int] = ..., term: _Optional[int] = ..., relay: _Optional[str] = ..., relay_address: _Optional[str] = ..., relayed: _Optional[_Mapping[str, str]] = ..., relayed_bytes: _Optional[_Mapping[str, int]] = ..., security: _Optional[str] = ..., refused_connections: _Optional[int] = ..., certificate_expires: _Optional[float] = ..., calls_limited: _Optional[int] = ..., messages_delayed: _Optional[int] = ..., banned_replicas: _Optional[_Mapping[str, str]] = ..., requests_malformed: _Optional[int] = ..., requests_malformed_by_peer: _Optional[_Mapping[str, int]] = ..., device: _Optional[str] = ..., precision: _Optional[str] = ..., eval_step: _Optional[int] = ..., eval_loss: _Optional[float] = ...) -> None: ...

class SwarmRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwarmMember(_message.Message):
    __slots__ = ("node_id", "address", "compute_s", "speed", "silent_s", "lease_expired", "left", "checkpoint_step", "uplink_bps", "rtt_s", "relay_node_id", "peer_links", "measuring_since")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    SILENT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    UPLINK_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_LINKS_FIELD_NUMBER: _ClassVar[int]
    MEASURING_SINCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    compute_s: float
    speed: float
    silent_s: float
    lease_expired: bool
    left: bool
    checkpoint_step: int
    uplink_bps: float
    rtt_s: float
    relay_node_id: str
    peer_links: _containers.RepeatedCompositeFieldContainer[PeerLink]
    measuring_since: float
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., compute_s: _Optional[float] = ..., speed: _Optional[float] = ..., silent_s: _Optional[float] = ..., lease_expired: _Optional[bool] = ..., left: _Optional[bool] = ..., checkpoint_step: _Optional[int] = ..., uplink_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ..., relay_node_id: _Optional[str] = ..., peer_links: _Optional[_Iterable[_Union[PeerLink, _Mapping]]] = ..., measuring_since: _Optional[float] = ...) -> None: ...

class SwarmView(_message.Message):
    __slots__ = ("swarm_id", "swarm_size", "members", "plan", "step", "samples", "samples_per_s", "done", "relays", "loss_steps", "losses", "stages", "eval_steps", "eval_losses")
    SWARM_ID_FIELD_NUMBER: _ClassVar[int]
    SWARM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    LOSS_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSSES_FIELD_NUMBER: _ClassVar[int]
    swarm_id: str
    swarm_size: int
    members: _containers.RepeatedCompositeFieldContainer[SwarmMember]
    plan: Plan
    step: int
    samples: int
    samples_per_s: float
    done: bool
    relays: _containers.RepeatedCompositeFieldContainer[RelayOffer]
    loss_steps: _containers.RepeatedScalarFieldContainer[int]
    losses: _containers.RepeatedScalarFieldContainer[float]
    stages: _containers.RepeatedCompositeFieldContainer[StageReport]
    eval_steps: _containers.RepeatedScalarFieldContainer[int]
    eval_losses: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, swarm_id: _Optional[str] = ..., swarm_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[SwarmMember, _Mapping]]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., step: _Optional[int] = ..., samples: _Optional[int] = ..., samples_per_s: _Optional[float] = ..., done: _Optional[bool] = ..., relays: _Optional[_Iterable[_Union[RelayOffer, _Mapping]]] = ..., loss_steps: _Optional[_Iterable[int]] = ..., losses: _Optional[_Iterable[float]] = ..., stages: _Optional[_Iterable[_Union[StageReport, _Mapping]]] = ..., eval_steps: _Optional[_Iterable[int]] = ..., eval_losses: _Optional[_Iterable[float]] = ...) -> None: ...

class RelayOffer(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...
