"""The serving form of a Llama-family `Model` on the CPU: same weights, fewer and larger ops.

- q/k/v and gate/up are fused into one matmul each (float weights are concatenated
  once at load; quantized Linears are called as they are);
- RoPE reads a cos/sin table built once, and rotates q and k in one call;
- attention runs every decode row and short prefill chunk of the step in one call of
  our CPU kernel (`kernels/cpu_kernels.c`); chunks longer than `KERNEL_MAX_CHUNK`
  take SDPA, whose matmuls win on long causal blocks.

`models/llama.py` stays the reference: EDGELLM_REFERENCE=1 runs it instead, and the tests
hold this module to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgellm.kernels import cpu
from edgellm.kernels.paged_attention import (
    AttentionMetadata,
    _causal_sdpa,
    _gather,
    dequantize_kv,
    paged_attention,
    write_kv,
)
from edgellm.models.llama import Model

KERNEL_MAX_CHUNK = 64  # prefill chunks up to this many rows go through the kernel
SMALL_M = 8  # matmuls of up to this many rows always stream the weights through our kernel
TUNE_M = (16, 32, 64)  # larger batches: our kernel or MKL, whichever this machine runs faster


@dataclass(slots=True)
class StepPlan:
    """How this step's attention is split; computed once per step, used by every layer."""

    meta: AttentionMetadata
    kernel_rows: torch.Tensor | None  # [R] rows the kernel computes; None: all of them
    row_seq: torch.Tensor  # [R] block-table row of each kernel row
    row_len: torch.Tensor  # [R] keys each kernel row attends to
    sdpa_chunks: list[tuple[int, int, int]]  # (start row, end row, sequence) for SDPA
    use_kernel: bool = True  # False: no compiled kernel, the reference attention runs

    @classmethod
    def build(cls, meta: AttentionMetadata, use_kernel: bool) -> StepPlan:
        if not use_kernel:
            return cls(meta, None, torch.empty(0), torch.empty(0), [], use_kernel=False)
        qsl = meta.query_start_loc
        sizes = [qsl[b + 1] - qsl[b] for b in range(len(meta.context_lens))]
        long = [b for b, n in enumerate(sizes) if n > KERNEL_MAX_CHUNK]
        chunks = [(qsl[b], qsl[b + 1], b) for b in long]
        row_seq, row_len = cpu.row_metadata(meta)
        if not long:
            return cls(meta, None, row_seq, row_len, chunks)
        keep = torch.ones(qsl[-1], dtype=torch.bool)
        for s, e, _ in chunks:
            keep[s:e] = False
        rows = keep.nonzero()[:, 0]
        return cls(meta, rows, row_seq[rows], row_len[rows], chunks)


def _fuse(linears: list[nn.Module]) -> nn.Linear | None:
    """One Linear computing `linears` side by side, or None when they are not all float."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=any(has_bias), device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if any(has_bias):
        bias = [
            m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
            for m in linears
        ]
        fused.bias = nn.Parameter(torch.cat(bias), requires_grad=False)
    return fused


class FastLinear(nn.Module):
    """A float Linear whose few-row products (decode of a few sequences) run through our
    weight-streaming kernel; MKL's GEMM takes larger batches, where it is faster."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.stream = (
            linear.weight.dtype == torch.float32
            and linear.weight.is_contiguous()
            and cpu.library() is not None
        )

        self.max_stream_rows = stream_limit(self.weight) if self.stream else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_stream_rows and x.dtype == torch.float32:
            return cpu.linear_rows(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


_LIMITS: dict[tuple[int, int], int] = {}


def stream_limit(weight: torch.Tensor) -> int:
    """Most rows for which our streaming kernel beats MKL on a weight of this shape, timed
    once per shape on this machine: MKL's GEMM wins on small weights that stay in cache,
    the stream on large ones and whenever memory bandwidth is contended (measured both)."""
    key = tuple(weight.shape)
    if key not in _LIMITS:
        limit = SMALL_M
        for m in TUNE_M:
            x = torch.randn(m, weight.shape[1])
            ours = _best_time(lambda x=x: cpu.linear_rows(x, weight, None))
            mkl = _best_time(lambda x=x: nn.functional.linear(x, weight))
            if ours > mkl:
                break
            limit = m
        _LIMITS[key] = limit
    return _LIMITS[key]


def _best_time(fn, reps: int = 3) -> float:
    fn()  # warm: the weight in cache as much as it will ever be
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _fast(linear: nn.Module) -> nn.Module:
    return FastLinear(linear) if type(linear) is nn.Linear else linear


class Projections(nn.Module):
    """Several Linears over one input, fused when possible; returns their outputs in order."""

    def __init__(self, linears: list[nn.Module]):
        super().__init__()
        fused = _fuse(linears)
        self.fused = None if fused is None else FastLinear(fused)
        self.parts = nn.ModuleList(linears if self.fused is None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, sum of out_features]
        if self.fused is not None:
            return self.fused(x)
        return torch.cat([m(x) for m in self.parts], dim=-1)


class FusedLayer(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.window, self.sinks = attn.window, attn.sinks
        self.qkv = Projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = _fast(attn.o_proj)
        self.gate_up = Projections([mlp.gate_proj, mlp.up_proj])
        self.down_proj = _fast(mlp.down_proj)
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.eps = layer.input_layernorm.eps
        self.glue = TORCH_GLUE

    def forward(self, x, residual, rope: Rope, kv_cache, plan: StepPlan):
        """(x, residual) -> (x', residual'): the layer's input is x + residual, its output
        x' + residual', so each residual add runs inside the next norm's kernel."""
        g = self.glue
        h, n = g.add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        o = self.o_proj(self.attend(n, rope, kv_cache, plan))
        h, n = g.add_rms_norm(h, o, self.post_attention_layernorm.weight, self.eps)
        return h, self.down_proj(g.silu_mul(self.gate_up(n)))

    def attend(self, x, rope: Rope, kv_cache, plan: StepPlan) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.glue.rope_qkv(self.qkv(x), rope, self.n_heads, self.n_kv_heads)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, plan.meta.slot_mapping)
        return self._attention(q, k_cache, v_cache, plan).reshape(t, -1)

    def _attention(self, q, k_cache, v_cache, plan: StepPlan) -> torch.Tensor:  # [T, H, D]
        meta, window, sinks = plan.meta, self.window, self.sinks
        if not plan.use_kernel:
            return paged_attention(q, k_cache, v_cache, meta, self.scale, window, sinks)
        if plan.kernel_rows is None:
            return cpu.paged_attention_rows(
                q, k_cache, v_cache, meta.block_tables, plan.row_seq, plan.row_len, self.scale,
                window, sinks,
            )  # fmt: skip
        out = torch.empty_like(q)
        if len(plan.kernel_rows):
            out[plan.kernel_rows] = cpu.paged_attention_rows(
                q[plan.kernel_rows], k_cache, v_cache, meta.block_tables,
                plan.row_seq, plan.row_len, self.scale, window, sinks,
            )  # fmt: skip
        for s, e, b in plan.sdpa_chunks:
            ctx, table = meta.context_lens[b], meta.block_tables[b]
            k = dequantize_kv(_gather(k_cache, table, ctx), q.dtype)  # [ctx, KVH, D]
            v = dequantize_kv(_gather(v_cache, table, ctx), q.dtype)
            out[s:e] = _causal_sdpa(q[s:e], k, v, self.scale, window, sinks)
        return out


# ---- the elementwise glue between the matmuls -------------------------------------------------
@dataclass(frozen=True, slots=True)
class Rope:
    """This step's rotary tables: the whole [P, D] tables and the rows' positions; `rows`
    gives the gathered [T, 1, D] rows (for the torch glue)."""

    cos: torch.Tensor  # [P, D]
    sin: torch.Tensor  # [P, D]
    positions: torch.Tensor  # [T] int64

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[self.positions][:, None], self.sin[self.positions][:, None]


def add_rms_norm(x, residual, weight, eps: float):
    """(x + residual, RMSNorm of it) as `RMSNorm` computes it (fp32 statistics)."""
    h = x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * normed.to(h.dtype)


def _split_qkv(qkv, n_heads: int, n_kv_heads: int, d: int):
    t = qkv.shape[0]
    q = qkv[:, : n_heads * d].view(t, n_heads, d)
    k = qkv[:, n_heads * d : (n_heads + n_kv_heads) * d].view(t, n_kv_heads, d)
    return q, k, qkv[:, (n_heads + n_kv_heads) * d :].view(t, n_kv_heads, d)


def rope_qkv(qkv, rope: Rope, n_heads: int, n_kv_heads: int):
    """q, k rotated (HF rotate-half) and v, from the fused projection [T, (H + 2 KVH) D]."""
    cos, sin = rope.rows()
    t, d = qkv.shape[0], cos.shape[-1]
    qk = qkv[:, : (n_heads + n_kv_heads) * d].view(t, -1, d)
    x1, x2 = qk.chunk(2, dim=-1)
    qk = qk * cos + torch.cat((-x2, x1), dim=-1) * sin  # q and k heads rotated together
    v = _split_qkv(qkv, n_heads, n_kv_heads, d)[2]
    return qk[:, :n_heads], qk[:, n_heads:], v


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _rope_qkv_c(qkv, rope: Rope, n_heads: int, n_kv_heads: int):
    cpu.rope_(qkv, rope.cos, rope.sin, rope.positions, n_heads + n_kv_heads)  # in place
    return _split_qkv(qkv, n_heads, n_kv_heads, rope.cos.shape[-1])


@dataclass(frozen=True, slots=True)
class Glue:
    add_rms_norm: Callable
    rope_qkv: Callable
    silu_mul: Callable


# torch ops (any dtype), and our C loops: one pass each instead of 3-8 ops, which on a few
# rows cost more in dispatch and thread wake-ups than in arithmetic
TORCH_GLUE = Glue(add_rms_norm, rope_qkv, silu_mul)
C_GLUE = Glue(cpu.add_rms_norm, _rope_qkv_c, cpu.silu_mul)


class FusedModel(nn.Module):
    """`Model`'s forward with the same arguments, from the same weights (moved, not copied,
    where nothing is fused)."""

    def __init__(self, model: Model, max_positions: int):
        super().__init__()
        self.args = model.args
        self.model = nn.Module()  # HF's names, as in the reference: model.embed_tokens, ...
        self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleList(FusedLayer(layer) for layer in model.model.layers)
        self.model.norm = model.model.norm
        self.lm_head = _fast(model.lm_head)
        self.use_kernel = cpu.library() is not None
        dtype = self.model.embed_tokens.weight.dtype
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * model.inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)
        c_glue = self.use_kernel and dtype == torch.float32
        self.glue = C_GLUE if c_glue else TORCH_GLUE
        for layer in self.model.layers:
            layer.glue = self.glue

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [N, vocab] float32
        plan = StepPlan.build(meta, self.use_kernel and cpu.supports(kv_caches[0][0]))
        h = self.model.embed_tokens(input_ids)
        residual = torch.zeros_like(h)
        rope = Rope(self.cos, self.sin, positions)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv, plan)
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        norm = self.model.norm
        return self.lm_head(self.glue.add_rms_norm(h, residual, norm.weight, norm.eps)[1]).float()
