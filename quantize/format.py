"""The INT format every quantizer writes and every reader reads: `QuantConfig` (bits, group
size, symmetry), dense int32 packing bit for bit as compressed-tensors' `pack-quantized`,
and reading a checkpoint's `quantization_config`. Depends on nothing else in quantize/.

Packing:

Codes q in [-2^(b-1), 2^(b-1) - 1] are stored unsigned (q + 2^(b-1)) as one bit
stream per row: element j occupies bits [j*b, (j+1)*b) of the row, word j*b // 32,
lowest bits first, and may straddle two words when b does not divide 32 (3, 5, 6,
7 bits). For 4 bits: 8 nibbles per word, element j in word j // 8 at bits 4*(j % 8).
A row of n codes takes ceil(n*b / 32) words. Zero points are packed along dim 0
(output rows) with `dim=0`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from edgellm.errors import InvalidParameterError, ModelFormatError, UnsupportedArchitectureError

FORMAT = "pack-quantized"


@dataclass(frozen=True, slots=True)
class QuantConfig:
    bits: int = 4
    group_size: int = 128  # -1: per-channel
    symmetric: bool = True

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise InvalidParameterError(f"bits must be in 2..8, got {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise InvalidParameterError(
                f"group size must be positive or -1 (per-channel), got {self.group_size}"
            )

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def groups(self, in_features: int) -> int:
        """Number of groups per row; raises when the group size does not divide the row."""
        g = in_features if self.group_size == -1 else self.group_size
        if in_features % g:
            raise InvalidParameterError(
                f"group size {g} does not divide the {in_features} input features of a layer"
            )
        return in_features // g

    def for_features(self, in_features: int) -> QuantConfig:
        """The config a layer with `in_features` inputs uses: this one when the group size
        divides it, else the largest smaller power of two >= 32 that does (so GGUF blocks
        and MLX groups stay exact), e.g. 64 for SmolLM2's 576-wide layers at 128."""
        g = self.group_size
        if g == -1 or in_features % g == 0:
            return self
        for cand in (256, 128, 64, 32):
            if cand < g and in_features % cand == 0:
                return QuantConfig(self.bits, cand, self.symmetric)
        raise InvalidParameterError(
            f"group size {g} does not divide the {in_features} input features of a layer, "
            "and no smaller power of two >= 32 does; use --group-size -1 (per-channel)"
        )

    def group_len(self, in_features: int) -> int:
        return in_features // self.groups(in_features)


def _bit_layout(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Word index and bit offset of each of 32 consecutive elements (32 elements = `bits` words)."""
    start = torch.arange(32, dtype=torch.int64) * bits
    return start // 32, start % 32


def pack_int32(q: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Signed codes q [rows, n] (any integer dtype) -> int32 [rows, ceil(n*bits/32)] (dim=1)."""
    if dim == 0:
        return pack_int32(q.t(), bits).t().contiguous()
    rows, n = q.shape
    u = q.to(torch.int64) + (1 << (bits - 1))  # unsigned codes in [0, 2^bits)
    u = torch.nn.functional.pad(u, (0, -n % 32)).view(rows, -1, 32)  # [rows, G, 32]
    word, offset = _bit_layout(bits)
    shifted = u << offset  # < 2^39: the part past bit 31 spills into the next word
    words = torch.zeros(rows, u.shape[1], bits + 1, dtype=torch.int64)  # one spare word
    words.index_add_(2, word, shifted & 0xFFFFFFFF)  # fields are disjoint: add == or
    words.index_add_(2, word + 1, shifted >> 32)
    words = words[..., :bits].reshape(rows, -1)[:, : math.ceil(n * bits / 32)]
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed int32


def unpack_int32(packed: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 words -> int8 signed codes with `n` elements along `dim`."""
    if dim == 0:
        return unpack_int32(packed.t(), bits, n).t().contiguous()
    rows, n_words = packed.shape
    if bits == 4 and sys.byteorder == "little":  # nibbles never straddle bytes: split bytes
        b = packed.contiguous().view(torch.uint8)  # [rows, 4*n_words], byte i = elements 2i, 2i+1
        u = torch.stack((b & 0xF, b >> 4), dim=-1).view(rows, -1)
        return (u[:, :n].to(torch.int8) - 8).contiguous()
    words = packed.to(torch.int64) & 0xFFFFFFFF
    words = torch.nn.functional.pad(words, (0, -n_words % bits + 1)).view(rows, -1)
    groups = (words.shape[1] - 1) // bits
    word, offset = _bit_layout(bits)
    idx = (torch.arange(groups)[:, None] * bits + word).reshape(-1)  # [G*32]
    both = words[:, idx] | (words[:, idx + 1] << 32)  # the field's word and the next one
    u = (both >> offset.repeat(groups)) & ((1 << bits) - 1)
    return (u[:, :n] - (1 << (bits - 1))).to(torch.int8)


_STRATEGIES = {"group", "channel"}


def read_quant_config(config: dict) -> QuantConfig | None:
    """The QuantConfig of an HF config.json dict; None when it has no `quantization_config`.

    Accepts compressed-tensors `pack-quantized` weight-only integer schemes (ours and
    llm-compressor's W4A16/W8A16, group or channel, symmetric or not) and raises
    UnsupportedArchitectureError for anything else (other methods, activation
    quantization, act-order indices), ModelFormatError for a malformed config.
    """
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelFormatError("quantization_config is not a JSON object")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedArchitectureError(
            f"quantization method {method!r} is not supported: edgellm runs compressed-tensors "
            "pack-quantized checkpoints (re-quantize with `edgellm quantize`)"
        )
    if qc.get("quantization_status", "compressed") != "compressed":
        raise UnsupportedArchitectureError(
            f"quantization_status {qc['quantization_status']!r}: only compressed checkpoints are supported"
        )
    if qc.get("kv_cache_scheme") or qc.get("sparsity_config") or qc.get("transform_config"):
        raise UnsupportedArchitectureError(
            "KV-cache quantization, sparsity and transforms are not supported"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelFormatError("quantization_config has no config_groups")
    found = {_group_quant_config(name, g, qc.get("format")) for name, g in groups.items()}
    if len({(c.bits, c.symmetric) for c in found}) > 1:
        raise UnsupportedArchitectureError(
            f"mixed quantization schemes are not supported ({', '.join(map(str, found))})"
        )
    # groups differing only in group size are our per-layer fallback (QuantConfig.for_features):
    # the largest is the scheme; each Linear derives its own from its input width
    return max(found, key=lambda c: c.group_size)


def _group_quant_config(name: str, group: dict, top_format: str | None) -> QuantConfig:
    fmt = group.get("format") or top_format
    if fmt != FORMAT:
        raise UnsupportedArchitectureError(
            f"compressed-tensors format {fmt!r} is not supported (only {FORMAT!r})"
        )
    if group.get("input_activations") or group.get("output_activations"):
        raise UnsupportedArchitectureError(
            f"config group {name}: activation quantization is not supported (weight-only only)"
        )
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ModelFormatError(f"config group {name} has no weights scheme")
    strategy = w.get("strategy")
    problems = [
        (w.get("type", "int") != "int", f"type {w.get('type')!r}"),
        (strategy not in _STRATEGIES, f"strategy {strategy!r}"),
        (bool(w.get("dynamic")), "dynamic quantization"),
        (w.get("actorder") == "group", "act-order with group indices (g_idx)"),
        (not 2 <= int(w.get("num_bits", 0)) <= 8, f"{w.get('num_bits')} bits"),
    ]
    bad = [what for cond, what in problems if cond]
    if bad:
        raise UnsupportedArchitectureError(f"config group {name}: {', '.join(bad)} not supported")
    group_size = -1 if strategy == "channel" else w.get("group_size")
    if not isinstance(group_size, int) or (strategy == "group" and group_size < 1):
        raise ModelFormatError(f"config group {name}: bad group_size {w.get('group_size')!r}")
    return QuantConfig(int(w["num_bits"]), group_size, bool(w.get("symmetric", True)))
