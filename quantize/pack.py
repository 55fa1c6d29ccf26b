"""Dense int32 packing of signed b-bit codes, bit for bit as compressed-tensors' `pack-quantized`.

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

import torch


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
