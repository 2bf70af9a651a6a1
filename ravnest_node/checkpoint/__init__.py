"""Stage checkpoints on a node's disk (store.py) and the merge of a run's checkpoints back
into one model (export.py, `ravnest-node export`)."""

from ravnest_node.checkpoint.store import (
    SET_ASIDE_DIR,
    CheckpointCopies,
    CheckpointDir,
    CheckpointError,
    Manifest,
    Retention,
    bytes_bound,
    parse_manifest,
    run_key,
)

__all__ = [
    "SET_ASIDE_DIR",
    "CheckpointCopies",
    "CheckpointDir",
    "CheckpointError",
    "Manifest",
    "Retention",
    "bytes_bound",
    "parse_manifest",
    "run_key",
]
