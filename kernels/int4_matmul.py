"""W4A16 matmul on the CPU with torch's int4 kernels, and its dequantize-then-matmul twin.

torch's `_weight_int4pack_mm_for_cpu` computes, per group of `group` input columns,

    w = (q_u - 8) * scale + zero        q_u in [0, 15] unsigned

from a weight repacked by `_convert_weight_to_int4pack_for_cpu` ([N, K] int32 ->
[N, K/2] uint8) and `scales_and_zeros` [K/group, N, 2] in the activation dtype.
Our signed codes q = q_u - 8 with w = (q - zp) * scale map onto it exactly with
zero = -zp * scale. The kernel wants N % 16 == 0 and group in {32, 64, 128, 256};
coarser groups (per-channel included) are split by repeating their scales.

Only the bfloat16 kernel is vectorized in torch 2.13 (fp32/fp16 run a scalar loop
30-100x slower than a dense matmul), so the fast path computes in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_GROUPS = (256, 128, 64, 32)
FAST_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """A 4-bit weight in the layout of torch's CPU int4 kernel."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scales_and_zeros: torch.Tensor  # bf16 [K/group, N, 2]
    group: int
    out_features: int


def kernel_group(out_features: int, group_len: int) -> int | None:
    """The kernel's group size for a layer with groups of `group_len` columns; None: unsupported."""
    if out_features % 16:
        return None
    return next((g for g in KERNEL_GROUPS if group_len % g == 0), None)


def prepare_int4(
    q: torch.Tensor,  # int8 [N, K] signed codes in [-8, 7]
    scale: torch.Tensor,  # [N, n_groups]
    zero: torch.Tensor | None,  # int [N, n_groups] signed, or None (symmetric)
    group: int,  # kernel group, from `kernel_group`
) -> Int4Weight:
    """Repack codes and group parameters once for `int4_matmul`."""
    n, k = q.shape
    repeat = k // scale.shape[1] // group  # split coarse groups into kernel groups
    scale = scale.float().repeat_interleave(repeat, dim=1)  # [N, K/group]
    zf = (
        torch.zeros_like(scale)
        if zero is None
        else -zero.float().repeat_interleave(repeat, 1) * scale
    )
    sz = torch.stack([scale.t(), zf.t()], dim=-1).to(FAST_DTYPE).contiguous()  # [K/group, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)
    return Int4Weight(packed, sz, group, n)


def int4_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., K] @ w.T -> [..., N] in x's dtype, computed in bfloat16."""
    x2 = x.reshape(-1, x.shape[-1]).to(FAST_DTYPE)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, w.group, w.scales_and_zeros)
    return y.to(x.dtype).view(*x.shape[:-1], w.out_features)


def dequantize_weight(
    q: torch.Tensor,  # int8 [N, K]
    scale: torch.Tensor,  # [N, n_groups]
    zero: torch.Tensor | None,  # [N, n_groups] or None
) -> torch.Tensor:  # float32 [N, K]
    """w = (q - zero) * scale, computed in float32."""
    n, k = q.shape
    qg = q.view(n, scale.shape[1], -1).float()
    if zero is not None:
        qg = qg - zero[..., None].float()
    return (qg * scale[..., None].float()).view(n, k)


def dequantize_matmul(
    x: torch.Tensor,  # [..., K]
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N]
    """The reference twin: dequantize in float32, then a dense matmul in x's dtype."""
    return torch.nn.functional.linear(x, dequantize_weight(q, scale, zero).to(x.dtype), bias)
