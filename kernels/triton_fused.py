"""Small fused ops in Triton, each beside its torch twin (`*_ref`), for the CUDA backend.

- `rms_norm`: optionally adds the residual first (x + r, written back into r) and
  normalizes in one pass over the row: one read and two writes instead of the five tensors
  torch's separate add / pow / mean / rsqrt / mul touch;
- `silu_and_mul`: silu(gate) * up from the fused gate|up projection [T, 2F] -> [T, F];
- `rope_and_cache`: rotates q and k of the fused q|k|v projection (rotate-half
  convention, the model's scaled frequencies) and writes k and v into their cache slots,
  one launch per layer for what is otherwise rotate q, rotate k, two scatters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgellm.kernels.paged_attention import write_kv


@triton.jit
def dot(a, b):
    """tl.dot, in full float32 (not TF32) when the inputs are float32: the float32 path is the
    one held to the torch reference exactly; bf16/fp16 inputs take the tensor cores as is."""
    if a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, stride_x, stride_r, stride_o, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * inv).to(x.dtype)  # as the reference: normalized in the input dtype, then scaled
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(OUT + row * stride_o + cols, (w * y).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, D]: becomes x + residual
) -> torch.Tensor:
    t, d = x.shape
    out = torch.empty_like(x)
    r = residual if residual is not None else x
    _rms_norm_kernel[(t,)](
        x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), d, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(d),
    )  # fmt: skip
    return out


def rms_norm_ref(x, weight, eps, residual=None):
    """The twin (models.llama.RMSNorm, with the residual add in place)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@triton.jit
def _silu_mul_kernel(X, OUT, stride_x, stride_o, F, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + F + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(OUT + row * stride_o + cols, (silu * up).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2F] -> [T, F]
    t, two_f = x.shape
    f = two_f // 2
    out = torch.empty((t, f), device=x.device, dtype=x.dtype)
    block = min(1024, triton.next_power_of_2(f))
    _silu_mul_kernel[(t, triton.cdiv(f, block))](x, out, x.stride(0), out.stride(0), f, BLOCK=block)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _store_row(DST, i, x1, x2, mask, HALF: tl.constexpr, D: tl.constexpr, Q8: tl.constexpr):
    """One cache row from its two halves: as is, or (Q8) symmetric int8 codes of the row's
    max|x| / 127 followed by that scale's fp32 bytes (`kernels.paged_attention.quantize_kv`;
    rounding half away from zero where torch rounds half to even: ties only)."""
    if Q8:
        a = tl.maximum(tl.max(tl.where(mask, tl.abs(x1), 0.0), 0),
                       tl.max(tl.where(mask, tl.abs(x2), 0.0), 0))  # fmt: skip
        scale = a / 127.0
        div = tl.where(scale > 0, scale, 1.0)
        y1, y2 = x1 / div, x2 / div
        c1 = tl.where(y1 >= 0, tl.floor(y1 + 0.5), -tl.floor(-y1 + 0.5))
        c2 = tl.where(y2 >= 0, tl.floor(y2 + 0.5), -tl.floor(-y2 + 0.5))
        tl.store(DST + i, tl.minimum(tl.maximum(c1, -127.0), 127.0).to(tl.int8), mask=mask)
        tl.store(DST + HALF + i, tl.minimum(tl.maximum(c2, -127.0), 127.0).to(tl.int8), mask=mask)
        tl.store((DST + D).to(tl.pointer_type(tl.float32), bitcast=True), scale)
    else:
        tl.store(DST + i, x1.to(DST.dtype.element_ty), mask=mask)
        tl.store(DST + HALF + i, x2.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_kernel(
    QKV, POS, INV_FREQ, Q_OUT, KC, VC, SLOTS, stride_t, stride_qt,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, Q8: tl.constexpr = False,
):  # fmt: skip
    t = tl.program_id(0)
    head = tl.program_id(1)  # [0, H): q heads; [H, H + KVH): k heads; then v heads
    i = tl.arange(0, BLOCK_H)
    mask = i < HALF
    base = QKV + t * stride_t + head * D
    slot = tl.load(SLOTS + t).to(tl.int64)
    if head < H + KVH:
        pos = tl.load(POS + t).to(tl.float32)
        freq = pos * tl.load(INV_FREQ + i, mask=mask, other=0.0)
        cos = tl.cos(freq)
        sin = tl.sin(freq)
        x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if head < H:
            dst = Q_OUT + t * stride_qt + head * D
            tl.store(dst + i, o1.to(Q_OUT.dtype.element_ty), mask=mask)
            tl.store(dst + HALF + i, o2.to(Q_OUT.dtype.element_ty), mask=mask)
        elif slot >= 0:
            row = D + 4 if Q8 else D
            _store_row(KC + (slot * KVH + head - H) * row, i, o1, o2, mask, HALF, D, Q8)
    elif slot >= 0:
        row = D + 4 if Q8 else D
        v1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
        _store_row(VC + (slot * KVH + head - H - KVH) * row, i, v1, v2, mask, HALF, D, Q8)


def rope_and_cache(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,  # float32 [D / 2]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; negative: not written (padding rows)
    n_heads: int,
) -> torch.Tensor:  # rotated q [T, H, D]
    t = qkv.shape[0]
    q8 = k_cache.dtype == torch.int8  # rows of D codes + a 4-byte scale
    kvh, d = k_cache.shape[2], k_cache.shape[3] - (4 if q8 else 0)
    q = torch.empty((t, n_heads, d), device=qkv.device, dtype=qkv.dtype)
    _rope_cache_kernel[(t, n_heads + 2 * kvh)](
        qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping, qkv.stride(0), q.stride(0),
        H=n_heads, KVH=kvh, D=d, HALF=d // 2, BLOCK_H=triton.next_power_of_2(d // 2), Q8=q8,
    )  # fmt: skip
    return q


def rope_and_cache_ref(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, n_heads):
    """The twin: models.llama's rotation and kernels.paged_attention.write_kv."""
    t = qkv.shape[0]
    kvh, d = k_cache.shape[2], k_cache.shape[3] - (4 if k_cache.dtype == torch.int8 else 0)
    q, k, v = qkv.view(t, -1, d).split([n_heads, kvh, kvh], dim=1)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    q, k = rot(q), rot(k)
    keep = slot_mapping >= 0
    write_kv(k_cache, v_cache, k[keep], v[keep], slot_mapping[keep].long())
    return q
