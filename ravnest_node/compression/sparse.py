"""Top-k sparsification with error feedback (Deep Gradient Compression, arXiv 1712.01887).

The sender keeps a residual v (float32, the tensor's size, created at the first encode):
v <- v + x; it sends the k = max(1, ceil(fraction * numel)) entries of largest |v| and zeroes
them in v, so what is not sent now is sent later (error feedback, Karimireddy et al., arXiv
1901.09847): after n steps the sum of what the receiver decoded differs from the sum of the
inputs by exactly the residual v, which stays bounded. The receiver gets a dense tensor with
zeros outside the k indices.

Payload (little-endian), indices sorted ascending:

```
float32 value[k]             4 * k bytes: float32 so that large magnitudes survive and the
                             residual is exact (the receiver gets v[i] itself)
uintW   delta[k]             W = index_bytes (2 or 4) bytes each: delta[0] = index[0],
                             delta[i] = index[i] - index[i-1] >= 1
```

Frame params: {"k": 1..numel, "index_bytes": 2 (every delta < 65536) or 4}. The decoder refuses
a payload whose indices are not strictly increasing or reach numel, or whose values are not finite.
Bytes per element sent: 4 + index_bytes (6 or 8); lz4 on top is the frame layer's business.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import torch

from ravnest_node.compression.host import to_host
from ravnest_node.compression.quant import (
    cast_finite,
    check_params,
    check_payload_size,
    checked_numel,
    flat_float32,
    int_param,
    owned_bytes,
)
from ravnest_node.errors import ConfigError, FrameError

_VALUE_BYTES = 4
_U16_LIMIT = 1 << 16
_INDEX_DTYPES: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


@dataclass(slots=True)
class TopKState:
    """Sender-side residual v of one tensor stream (same shape every step; not thread-safe)."""

    residual: torch.Tensor | None = None
    """v, flat float32, created at the first encode."""


@dataclass(frozen=True, slots=True)
class TopK:
    """Top-k with error feedback (`topk-ef`); see the module doc."""

    name: str = "topk-ef"
    """Registry name carried in frames."""
    fraction: float = 0.01
    """Share of the elements sent each step, in (0, 1]; at least one is always sent."""

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, float | int) and 0 < self.fraction <= 1):
            raise ConfigError(f"{self.name}: fraction must be in (0, 1], not {self.fraction!r}")

    @property
    def bits_per_element(self) -> float:
        """Wire bits per element of the tensor, at most: a float32 value and a 4-byte index
        delta for each of the `fraction` of entries sent (the planner's estimate)."""
        return 64 * self.fraction

    def k_for(self, numel: int) -> int:
        """Elements sent for a tensor of `numel` elements (0 for an empty tensor)."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def new_state(self) -> TopKState:
        """A fresh, empty residual."""
        return TopKState()

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        """(params, payload); updates the residual in `state` (on the tensor's device).
        TypeError for a missing or foreign state, ValueError for non-finite values or a tensor
        of another size than the state's."""
        if not isinstance(state, TopKState):
            raise TypeError(f"{self.name} needs the state of new_state(), got {type(state)}")
        x = flat_float32(tensor)
        numel = x.numel()
        if numel == 0:
            raise ValueError(f"{self.name}: an empty tensor has nothing to send")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{self.name}: the tensor has non-finite values")
        if state.residual is None:
            state.residual = torch.zeros(numel, dtype=torch.float32, device=x.device)
        elif state.residual.numel() != numel:
            raise ValueError(
                f"{self.name}: the state holds {state.residual.numel()} elements, the tensor has "
                f"{numel}; use one state per tensor stream"
            )
        v = state.residual
        v.add_(x)
        k = self.k_for(numel)
        idx = torch.topk(v.abs(), k, sorted=False).indices.sort().values
        values = v[idx]
        v[idx] = 0.0
        deltas = torch.diff(idx, prepend=idx.new_zeros(1))
        values, deltas = to_host(values, deltas)
        index_bytes = 2 if int(deltas.max()) < _U16_LIMIT else 4
        payload = (
            values.numpy().astype("<f4", copy=False).tobytes()
            + deltas.numpy().astype(_INDEX_DTYPES[index_bytes]).tobytes()
        )
        return {"k": k, "index_bytes": index_bytes}, payload

    def payload_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, params: Mapping[str, int]
    ) -> int:
        """Exact payload size; FrameError for bad params (k outside 1..numel, index_bytes not 2
        or 4), shape or dtype."""
        check_params(self.name, params, ("k", "index_bytes"))
        numel = checked_numel(self.name, shape, dtype)
        k = int_param(self.name, params, "k", 1, numel)
        index_bytes = int_param(self.name, params, "index_bytes", 2, 4)
        if index_bytes not in _INDEX_DTYPES:
            raise FrameError(f"codec {self.name}: param 'index_bytes' must be 2 or 4")
        return k * (_VALUE_BYTES + index_bytes)

    def decode(
        self,
        payload: memoryview,
        shape: Sequence[int],
        dtype: torch.dtype,
        params: Mapping[str, int],
    ) -> torch.Tensor:
        """The dense tensor; FrameError if the payload has the wrong size, indices that are not
        strictly increasing or reach numel, or values that are not finite (in `dtype`). The
        payload is checked before anything is allocated; the dense output (numel elements) is
        sized by the shape, which the frame layer has already bounded by its message limit."""
        check_payload_size(self.name, payload, self.payload_nbytes(shape, dtype, params))
        k, index_bytes = params["k"], params["index_bytes"]
        numel = prod(shape)
        buf = owned_bytes(payload)
        values = np.frombuffer(buf, dtype="<f4", count=k)
        deltas = np.frombuffer(buf, dtype=_INDEX_DTYPES[index_bytes], offset=k * _VALUE_BYTES)
        if k > 1 and not bool((deltas[1:] > 0).all()):
            raise FrameError(f"codec {self.name}: indices are not strictly increasing")
        indices = np.cumsum(deltas, dtype=np.int64)  # k < 2**31 deltas < 2**32: no overflow
        if int(indices[-1]) >= numel:
            raise FrameError(f"codec {self.name}: index {int(indices[-1])} >= numel {numel}")
        if not bool(np.isfinite(values).all()):
            raise FrameError(f"codec {self.name}: a value is not finite")
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(indices)] = torch.from_numpy(values.astype(np.float32))
        return cast_finite(self.name, out.reshape(tuple(shape)), dtype)
