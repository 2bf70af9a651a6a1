"""Codecs for tensors on the wire (pure torch, no I/O)."""

from ravnest_node.compression.codecs import (
    CODECS,
    GRADIENT_ONLY,
    WIRE_DTYPES,
    Codec,
    dtype_name,
    encoder,
    get_codec,
)

__all__ = ["CODECS", "GRADIENT_ONLY", "WIRE_DTYPES", "Codec", "dtype_name", "encoder", "get_codec"]
