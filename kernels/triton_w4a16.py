"""W4A16 group-wise matmul in Triton, reading our INT4 layout as stored.

The weight stays in the checkpoint's layout (compressed-tensors `pack-quantized`, see
`quantize/format.py`): `packed` int32 [N, ceil(K/8)], element k of row n in word k // 8 at
bits 4 * (k % 8), stored unsigned (q + 8); `scales` [N, K/group]; asymmetric zero points
unpacked once at load to int8 [N, K/group]. Then

    y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, k // group]) * scale[n, k // group]

accumulated in float32. One kernel, two inner products:
- small M (<= GEMV_MAX_M rows, decode): a broadcast multiply and row sum, no tensor cores,
  the weight streamed once; split-K over programs so a small N still fills the device;
- larger M: `tl.dot` tiles of BLOCK_M x BLOCK_N (split-K when the tile grid is small).
Split-K partial sums go to a float32 [splits, M, N] buffer summed afterwards: the result
does not depend on which program finishes first (no atomics), so a batch computes the same
numbers every time. From DEQUANT_MIN_M rows (long prefill chunks) the weight is dequantized
once into the activation dtype by a Triton kernel and multiplied by cuBLAS.

The reference twin is `kernels.int4_matmul.dequantize_matmul` (dequantize in float32, dense
matmul). `TRITON_INTERPRET=1` runs all of it on the CPU (float32/float16 only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgellm.kernels.triton_fused import dot

GEMV_MAX_M = 4  # rows computed without tensor cores
DEQUANT_MIN_M = 512  # from this many rows: dequantize once, then a dense matmul
TARGET_PROGRAMS = 264  # split-K aims for about this many programs (2 per SM of an H100/H200)


@dataclass(frozen=True, slots=True)
class W4A16Weight:
    """A 4-bit weight in the kernel's (= the checkpoint's) layout, on its device."""

    packed: torch.Tensor  # int32 [N, ceil(K/8)]
    scales: torch.Tensor  # float [N, K/group]
    zeros: torch.Tensor | None  # int8 [N, K/group] signed zero points; None: symmetric
    group: int
    in_features: int
    out_features: int

    @classmethod
    def concat(cls, parts: list[W4A16Weight]) -> W4A16Weight:
        """The weights side by side along N (fused q/k/v or gate/up): one launch for all."""
        first = parts[0]
        same = all(
            (p.group, p.in_features, p.zeros is None)
            == (first.group, first.in_features, first.zeros is None)
            for p in parts
        )
        if not same:
            raise ValueError("only weights of one input width, group and symmetry fuse")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return cls(
            torch.cat([p.packed for p in parts]),
            torch.cat([p.scales for p in parts]),
            zeros,
            first.group,
            first.in_features,
            sum(p.out_features for p in parts),
        )

    @property
    def nbytes(self) -> int:
        zeros = 0 if self.zeros is None else self.zeros.nbytes
        return self.packed.nbytes + self.scales.nbytes + zeros


def prepare_w4a16(
    packed: torch.Tensor,  # int32 [N, ceil(K/8)]
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # signed codes [N, G] or None
    in_features: int,
    device: torch.device | str,
    scale_dtype: torch.dtype,
) -> W4A16Weight:
    n, g = scales.shape
    if packed.shape != (n, -(-in_features // 8)) or in_features % g:
        raise ValueError(
            f"packed {tuple(packed.shape)} / scales {tuple(scales.shape)} do not describe a "
            f"4-bit [{n}, {in_features}] weight"
        )
    return W4A16Weight(
        packed.to(device=device, dtype=torch.int32).contiguous(),
        scales.to(device=device, dtype=scale_dtype).contiguous(),
        None if zeros is None else zeros.to(device=device, dtype=torch.int8).contiguous(),
        in_features // g,
        in_features,
        n,
    )


@triton.jit
def _dequant_tile(
    W, S, Z, offs_n, k0, N, K, ldw, n_groups,
    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Weights [BLOCK_N, BLOCK_K] in float32 for rows offs_n, columns k0.. (k0 a multiple of
    8): one int32 load per 8 codes, one scale (and zero) per row when the tile sits inside a
    group, else gathered per column."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask_w = (offs_n[:, None] < N) & (words_k[None, :] * 8 < K)
    words = tl.load(W + offs_n[:, None] * ldw + words_k[None, :], mask=mask_w, other=0)
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 15  # [BN, BK/8, 8]
    q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0
    if GROUP % BLOCK_K == 0:  # the whole tile is in one group: [BN] parameters
        g_idx = offs_n * n_groups + k0 // GROUP
        s = tl.load(S + g_idx, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        if HAS_ZERO:
            q = q - tl.load(Z + g_idx, mask=offs_n < N, other=0).to(tl.float32)[:, None]
    else:
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        g_idx = offs_n[:, None] * n_groups + offs_k[None, :] // GROUP
        s = tl.load(S + g_idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            q = q - tl.load(Z + g_idx, mask=mask, other=0).to(tl.float32)
    return q * s


@triton.jit
def _w4a16_kernel(
    X, W, S, Z, B, OUT,
    M, N, K, ldw, n_groups, stride_xm, k_per_split,
    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """OUT[pid_k, m, n] = partial sums over this program's K range (float32); with one K
    range (no split) the finished y (+ bias) in OUT's dtype."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < k_end)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w = _dequant_tile(
            W, S, Z, offs_n, k0, N, K, ldw, n_groups, GROUP, HAS_ZERO, BLOCK_N, BLOCK_K
        )
        if USE_DOT:
            acc += dot(x, tl.trans(w.to(x.dtype)))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:  # only without a split: the sums are final
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = OUT + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    PART, B, OUT, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """OUT = sum over splits of PART [SPLITS, M*N] (+ bias), in a fixed order, cast once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLITS):
        acc += tl.load(PART + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(
    W, S, Z, OUT, N, K, ldw, n_groups,
    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = _dequant_tile(W, S, Z, offs_n, k0, N, K, ldw, n_groups, GROUP, HAS_ZERO, BLOCK_N, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tl.store(OUT + offs_n[:, None] * K + offs_k[None, :], w.to(OUT.dtype.element_ty), mask=mask)


def _block_k(group: int) -> int:
    """K tile: the group when it is a power of two up to 128, else 64 (scales gathered)."""
    return group if group in (32, 64, 128) else 64 if group % 64 == 0 or group > 64 else 32


def launch_config(m: int, n: int, k: int, group: int, on_gpu: bool) -> dict:
    """Tile sizes and split-K for an M x N x K product (heuristics; bench_cuda.py measures)."""
    use_dot = m > GEMV_MAX_M
    block_k = _block_k(group)
    if use_dot:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 64
    else:  # the [BLOCK_M, BLOCK_N, BLOCK_K] product lives in registers: keep it ~8k values
        block_m = triton.next_power_of_2(max(m, 1))
        block_n = max(16, 64 // block_m) if on_gpu else 32
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_blocks = triton.cdiv(k, block_k)
    split = max(1, min(k_blocks, TARGET_PROGRAMS // max(tiles, 1))) if on_gpu else 1
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, split_k=split)


def w4a16_matmul(
    x: torch.Tensor,  # [..., K]
    w: W4A16Weight,
    bias: torch.Tensor | None = None,  # [N]
    split_k: int | None = None,  # override the heuristic (tests)
    force_kernel: bool = False,  # never the dequantize + cuBLAS path
) -> torch.Tensor:  # [..., N] in x's dtype
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} features, the weight {w.in_features}")
    on_gpu = x.is_cuda
    if m >= DEQUANT_MIN_M and not force_kernel:
        dense = dequantize_w4a16(w, x.dtype)
        return torch.nn.functional.linear(x, dense, bias)
    cfg = launch_config(m, n, k, w.group, on_gpu)
    split = split_k or cfg.pop("split_k")
    cfg.pop("split_k", None)
    bk = cfg["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    # one K range: the kernel writes y itself; several: float32 partials, reduced once
    part = y if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    zeros = w.zeros if w.zeros is not None else w.scales  # never read when symmetric
    b = bias if bias is not None else w.scales  # never read without a bias
    _w4a16_kernel[grid](
        x2, w.packed, w.scales, zeros, b, part,
        m, n, k, w.packed.shape[1], w.scales.shape[1], x2.stride(0), k_per_split,
        GROUP=w.group, HAS_ZERO=w.zeros is not None, HAS_BIAS=bias is not None and split == 1,
        **cfg,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, b, y, m * n, n, SPLITS=split, HAS_BIAS=bias is not None, BLOCK=block
        )
    return y.view(*shape[:-1], n)


def dequantize_w4a16(w: W4A16Weight, dtype: torch.dtype) -> torch.Tensor:  # [N, K]
    """The weight as a dense [N, K] tensor of `dtype` (computed in float32, then cast)."""
    n, k = w.out_features, w.in_features
    out = torch.empty((n, k), device=w.packed.device, dtype=dtype)
    bn, bk = 32, _block_k(w.group)
    zeros = w.zeros if w.zeros is not None else w.scales
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w.packed, w.scales, zeros, out, n, k, w.packed.shape[1], w.scales.shape[1],
        GROUP=w.group, HAS_ZERO=w.zeros is not None, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    return out
