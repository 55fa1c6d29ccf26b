"""Paged attention in plain torch: the reference every backend is held to.

The KV cache of one layer is two tensors `[num_blocks, block_size, n_kv_heads,
head_dim]`; a sequence's tokens live in the blocks its `block_table` lists, token
`i` at block `block_table[i // block_size]`, offset `i % block_size`. Queries of
all sequences in a step are flattened into one `[T, n_heads, head_dim]` tensor.

An int8 cache stores each (token, KV head) row as `head_dim` symmetric codes followed by
its fp32 scale in 4 more int8 slots (`[..., head_dim + 4]`, like a GGML q8_0 block of one
row): a block is still one slice of one tensor, so copy-on-write, swapping and the
prefix cache move codes and scales together, and readers dequantize rows as they load them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: list[int]  # [B + 1]: sequence b's queries are rows qsl[b]:qsl[b+1]
    context_lens: list[int]  # [B]: KV length of each sequence after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (masked by context_lens)

    @property
    def decode_only(self) -> bool:
        """Every sequence has exactly one query token (the batched fast path)."""
        return len(self.query_start_loc) - 1 == self.query_start_loc[-1]


KV_SCALE_SLOTS = 4  # int8 slots holding a row's fp32 scale after its codes


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: round(x / s) with s = max|x| / 127 per row, the
    scale's fp32 bytes appended (an all-zero row gets s = 0 and codes 0)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.round(x / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127)
    return torch.cat([codes.to(torch.int8), scale.view(torch.int8)], -1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows in `dtype`: int8 rows [..., D + 4] decoded as codes * scale (in fp32, then
    cast), float rows just cast."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., -KV_SCALE_SLOTS:].contiguous().view(torch.float32)
    return (rows[..., :-KV_SCALE_SLOTS].float() * scale).to(dtype)


def write_kv(
    k_cache: torch.Tensor,  # [N, bs, KVH, D]
    v_cache: torch.Tensor,  # [N, bs, KVH, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Scatter this step's keys and values into their slots (quantized for an int8 cache)."""
    n_kv, d = k_cache.shape[-2:]
    if k_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    k_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached rows: [length, KVH, D]."""
    n_blocks = -(-length // cache.shape[1])
    return cache[block_table[:n_blocks]].flatten(0, 1)[:length]


def visible(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: int = 0, sinks: int = 0
) -> torch.Tensor:
    """Which keys each query sees (broadcast): causal, and with a window of W tokens only
    keys p - W < k <= p (HF's sliding-window rule) plus the first `sinks` keys (attention
    sinks, as StreamingLLM keeps them)."""
    seen = key_pos <= query_pos
    if window:
        seen &= (key_pos > query_pos - window) | (key_pos < sinks)
    return seen


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # attend to the last `window` keys only (0: the whole context)
    sinks: int = 0,  # ... and to the sequence's first `sinks` keys
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's queries over its cached context.

    Single-token (decode) rows are batched into one call; multi-token (prefill)
    chunks are attended one sequence at a time. Blocks wholly outside a window may be
    gone from the table (id 0 there): their rows are read and masked, never used."""
    if meta.decode_only:
        return _decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window, sinks
        )
    out = torch.empty_like(q)
    qsl = meta.query_start_loc
    decodes = [b for b in range(len(meta.context_lens)) if qsl[b + 1] - qsl[b] == 1]
    if len(decodes) > 1:
        rows = torch.tensor([qsl[b] for b in decodes], device=q.device)
        out[rows] = _decode_attention(
            q[rows], k_cache, v_cache, meta.block_tables[decodes],
            [meta.context_lens[b] for b in decodes], scale, window, sinks,
        )  # fmt: skip
    for b, ctx in enumerate(meta.context_lens):
        if len(decodes) > 1 and qsl[b + 1] - qsl[b] == 1:
            continue
        s, e = qsl[b], qsl[b + 1]
        k = dequantize_kv(_gather(k_cache, meta.block_tables[b], ctx), q.dtype)  # [ctx, KVH, D]
        v = dequantize_kv(_gather(v_cache, meta.block_tables[b], ctx), q.dtype)
        out[s:e] = _causal_sdpa(q[s:e], k, v, scale, window, sinks)
    return out


def _causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
    sinks: int = 0,
) -> torch.Tensor:  # fmt: skip
    """q [n, H, D] are the last n positions of a context of k/v [ctx, KVH, D]."""
    n, ctx = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n == ctx and not window:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # query i sits at absolute position ctx - n + i and sees keys 0..that position
        rows = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = visible(rows, torch.arange(ctx, device=q.device)[None, :], window, sinks)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode_attention(
    q: torch.Tensor,  # [B, H, D]: one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: list[int],
    scale: float,
    window: int = 0,
    sinks: int = 0,
) -> torch.Tensor:  # [B, H, D]
    """Sequences that decode one token: gather padded contexts and attend in one call."""
    bs = k_cache.shape[1]
    lens = torch.tensor(context_lens, device=q.device)
    n_blocks = -(-int(lens.max()) // bs)
    table = block_tables[:, :n_blocks]  # [B, nb]
    k = dequantize_kv(k_cache[table].flatten(1, 2), torch.float32)  # [B, L, KVH, D]
    v = dequantize_kv(v_cache[table].flatten(1, 2), torch.float32)
    mask = visible(lens[:, None] - 1, torch.arange(k.shape[1], device=q.device)[None, :], window, sinks)
    # one query per sequence: plain matmuls in float32 over grouped heads beat SDPA's
    # masked GQA path on CPU (much so in bf16)
    b, h, d = q.shape
    kvh = k.shape[2]
    qg = q.float().view(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    o = torch.matmul(scores.softmax(-1), v.transpose(1, 2))  # [B, KVH, G, D]
    return o.reshape(b, h, d).to(q.dtype)
