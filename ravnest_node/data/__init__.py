"""Training data that every node can read locally and identically."""

from ravnest_node.data.stdlib_bytes import StdlibBytes

__all__ = ["StdlibBytes"]
