"""One boundary's stream of klt frames in the one-process simulations (boundary_codec_sim.py,
staleness_sim.py, klt_refresh.py): the sender's codec and state, the receiver's bases."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ravnest_node.compression import encoder
from ravnest_node.compression.codecs import Role
from ravnest_node.compression.transform import KLT, KLTBases, KLTState


@dataclass
class KLTStream:
    codec: KLT
    state: KLTState
    bases: KLTBases

    @classmethod
    def new(cls, role: Role, *, fine: bool = False, columns: bool = True) -> "KLTStream":
        """A stream as a sender sends `role` (activations at the fine step with `fine`),
        towards a peer that decodes columns (coder 2) unless `columns` is False (coder 1)."""
        codec = encoder("klt", role, fine=fine)
        assert isinstance(codec, KLT)
        state = codec.new_state()
        state.columns = columns
        return cls(codec, state, KLTBases())

    def through(self, x: torch.Tensor) -> tuple[torch.Tensor, Mapping[str, int], int]:
        """(`x` as the receiver decodes it, the frame's params, its payload bytes): one frame."""
        params, payload = self.codec.encode(x, self.state)
        out, commit = self.codec.decode_stream(
            self.bases, memoryview(payload), x.shape, x.dtype, params
        )
        commit()
        return out, params, len(payload)
