"""Files a node keeps in its state directory, written so that a crash never leaves half a file."""

from __future__ import annotations

import os
from pathlib import Path

NODE_ID_FILE = "node_id"
MEMBER_KEY_FILE = "member_key"
"""What nodes before node keys kept (a bearer secret for the coordinator): removed."""
MAX_NODE_ID_LEN = 64
MAX_SWARM_NAME_LEN = 64


def valid_node_id(node_id: str) -> bool:
    """Node ids are short ASCII words: safe in logs, file names and gRPC metadata."""
    return (
        0 < len(node_id) <= MAX_NODE_ID_LEN
        and node_id.isascii()
        and node_id.replace("-", "").replace("_", "").isalnum()
    )


def valid_swarm_name(name: str) -> bool:
    """Swarm names are 1 to 64 printable characters, no '=' (they travel as mDNS TXT values and
    in member certificates)."""
    return 0 < len(name) <= MAX_SWARM_NAME_LEN and name.isprintable() and "=" not in name


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data`: readers see the old file or the new one, never a mix.

    Writes a temporary file beside it (created with `mode`, less the umask: 0o600 for a secret
    is never readable by others, not even for a moment), fsyncs it, renames it over `path`,
    fsyncs the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a stale one (a crash) could have another mode
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk keeps nothing of a failed write
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def record_node_id(state_dir: Path | None, node_id: str) -> str | None:
    """Write this node's id (made from its key, identity.py) to `state_dir`'s `node_id` for
    people and tools to read. Returns the id the file held before if it was another one (a
    state directory from before node keys: its member key, no longer used, is removed)."""
    if state_dir is None:
        return None
    path = state_dir / NODE_ID_FILE
    before = path.read_text().strip() if path.exists() else None
    if before != node_id:
        write_atomic(path, node_id.encode())
    (state_dir / MEMBER_KEY_FILE).unlink(missing_ok=True)
    return before if before is not None and before != node_id else None
