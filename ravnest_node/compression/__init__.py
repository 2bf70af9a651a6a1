"""Codecs for tensors on the wire (pure torch, no I/O)."""

from ravnest_node.compression.codecs import CODECS, WIRE_DTYPES, Codec, dtype_name, get_codec

__all__ = ["CODECS", "WIRE_DTYPES", "Codec", "dtype_name", "get_codec"]
