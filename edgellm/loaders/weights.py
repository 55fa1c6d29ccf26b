"""Weight sources: stream tensors by HF name from a GGUF file or safetensors shards.

A source never loads the whole model at once: `get(name)` reads (and for GGUF
dequantizes) one tensor, so quantizers can walk a model one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str  # HF name
    shape: tuple[int, ...]  # torch order, e.g. [out, in]
    dtype: str  # storage type: "Q4_1", "F32", "bfloat16", ...
    bits_per_weight: float


class WeightSource(Protocol):
    def names(self) -> list[str]: ...

    def info(self, name: str) -> TensorInfo: ...

    def get(self, name: str) -> torch.Tensor: ...

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor, decoded alone (not the whole tensor)."""
        ...


ROW_CHUNK = 4096  # rows decoded at once by `gather_rows` / `rows_as` (25 MB of float32 at 1536)


def gather_rows(source: WeightSource, name: str, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), cols]: rows `ids` of a 2-D tensor (an embedding lookup), decoding
    ROW_CHUNK rows at a time, never the whole table (Qwen's 151,936 x 1536 is 933 MB)."""
    n = source.info(name).shape[0]
    out = None
    for a in range(0, n, ROW_CHUNK):
        b = min(a + ROW_CHUNK, n)
        sel = ((ids >= a) & (ids < b)).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        block = source.rows(name, a, b).float()
        if out is None:
            out = torch.empty(ids.numel(), block.shape[1])
        out[sel] = block[ids[sel] - a]
    if out is None:  # no ids
        return torch.empty(0, source.info(name).shape[1])
    return out


def rows_as(source: WeightSource, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A tensor in `dtype`, converted ROW_CHUNK rows at a time: a 16-bit embedding table
    without its float32 copy beside it."""
    shape = source.info(name).shape
    if len(shape) != 2:
        return source.get(name).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    for a in range(0, shape[0], ROW_CHUNK):
        b = min(a + ROW_CHUNK, shape[0])
        out[a:b] = source.rows(name, a, b)
    return out


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


class SafetensorsSource:
    """One or more safetensors files (sharded checkpoints), read lazily."""

    _BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I8": 8, "U8": 8}

    def __init__(self, files: list[Path]):

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {n: h for h in self._handles for n in h.keys()}

    def names(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> TensorInfo:
        sl = self._where[name].get_slice(name)
        dtype = sl.get_dtype()
        return TensorInfo(name, tuple(sl.get_shape()), dtype, self._BITS.get(dtype, 0))

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[start:stop]


class DictSource:
    """Tensors already in memory (tests, freshly built models)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._t = tensors

    def names(self) -> list[str]:
        return list(self._t)

    def info(self, name: str) -> TensorInfo:
        t = self._t[name]
        return TensorInfo(
            name, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.element_size() * 8
        )

    def get(self, name: str) -> torch.Tensor:
        return self._t[name]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._t[name][start:stop]
