"""Codecs for tensors on the wire (pure torch, no I/O)."""

from ravnest_node.compression.aq import AQDelta, AQState, SampleReferences
from ravnest_node.compression.codecs import (
    ACTIVATION_ONLY,
    CODECS,
    GRADIENT_ONLY,
    WIRE_DTYPES,
    Codec,
    dtype_name,
    encoder,
    get_codec,
)

__all__ = [
    "ACTIVATION_ONLY",
    "CODECS",
    "GRADIENT_ONLY",
    "WIRE_DTYPES",
    "AQDelta",
    "AQState",
    "Codec",
    "SampleReferences",
    "dtype_name",
    "encoder",
    "get_codec",
]
