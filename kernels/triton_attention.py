"""Paged attention in Triton over the engine's block tables.

The cache of one layer is K and V `[num_blocks, block_size, n_kv_heads, head_dim]` (the
layout of `kernels.paged_attention`, its reference twin); key j of sequence b lives in
block `block_tables[b, j // block_size]` at offset `j % block_size`. Queries of the step
are flattened `[T, H, D]`; sequence b owns rows `query_start_loc[b]:query_start_loc[b+1]`,
the last q_len positions of its `context_lens[b]` keys (K/V already written).

Two kernels, both with the G = H / KVH query heads of one KV head packed into the rows of
one program (each K/V tile is loaded once for all of them, GQA's point):
- `_mixed_kernel`, any batch: prefill chunks, decodes and (k+1)-token verifies together;
  a program takes BLOCK_Q tokens x G heads of one sequence, walks its keys up to the
  last query's position in tiles of TILE_N keys (gathered through the block table, so any
  block size works), causal mask inside the chunk, online softmax in float32.
- `_decode_kernel` + `_reduce_kernel`, every sequence one query (decode-only steps):
  flash-decoding; each sequence's keys are split over NUM_SPLITS programs that write a
  partial output and its log-sum-exp, and the reduce step combines them. The split ranges
  are computed on the device from `context_lens`, so a CUDA graph captured once replays
  for any lengths.
Rows of a padded batch (context length 0) produce zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from edgellm.kernels.triton_fused import dot

TILE_N = 64  # keys per inner step
HEAD_DIMS = (16, 256)  # head sizes the kernels take: tensor-core tiles, registers
NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity": masked rows never produce NaN


@triton.jit
def _load_kv_tile(CACHE, BT, b, keys, n_ctx, kvh, stride_bt, KVH: tl.constexpr, D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, Q8: tl.constexpr):  # fmt: skip
    """[TILE, BLOCK_D] rows of keys `keys` of sequence b (zeros past n_ctx). Q8: int8 rows
    of D codes and their fp32 scale (`kernels.paged_attention`), decoded to float32."""
    valid = keys < n_ctx
    block = tl.load(BT + b * stride_bt + keys // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    if Q8:
        row = (slot * KVH + kvh) * (D + 4)
        codes = tl.load(CACHE + row[:, None] + offs_d[None, :],
                        mask=valid[:, None] & (offs_d[None, :] < D), other=0)  # fmt: skip
        scale = tl.load((CACHE + row + D).to(tl.pointer_type(tl.float32), bitcast=True),
                        mask=valid, other=0.0)  # fmt: skip
        tile = codes.to(tl.float32) * scale[:, None]
    else:
        ptrs = CACHE + (slot[:, None] * KVH + kvh) * D + offs_d[None, :]
        tile = tl.load(ptrs, mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
    return tile


@triton.jit
def _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale):
    """One key tile of flash attention: scores of the visible (row, key) pairs, the running
    max / sum rescaled, the tile's values accumulated (float32)."""
    s = dot(q, tl.trans(k.to(q.dtype))) * scale  # [rows, tile]
    s = tl.where(visible, s, NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype)).to(tl.float32)
    return m_new, l_new, acc


@triton.jit
def _mixed_kernel(
    Q, KC, VC, OUT, BT, CTX, QSL, scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    WINDOW, SINKS,
    H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    Q8: tl.constexpr = False,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    n_ctx = tl.load(CTX + b)
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q_tile * BLOCK_Q + rows // G_PAD
    g = rows % G_PAD
    row_ok = (tok < q_len) & (g < G)
    head = kvh * G + g
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    pos = n_ctx - q_len + tok  # absolute position of each row's query
    # keys up to the last query of this tile
    last = tl.minimum(n_ctx, n_ctx - q_len + (q_tile + 1) * BLOCK_Q)
    m_i = tl.full((BLOCK_Q * G_PAD,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_Q * G_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_Q * G_PAD, BLOCK_D), tl.float32)
    # with a window: the tile's first query sees keys from lo on (plus the first SINKS), so
    # the sink tiles [0, sink_end) and the window's [lo_t, last) are walked, nothing between
    first = n_ctx - q_len + q_tile * BLOCK_Q
    lo_t = tl.where(WINDOW > 0, tl.maximum(first - WINDOW + 1, 0) // TILE * TILE, 0)
    sink_end = tl.where(WINDOW > 0, tl.minimum(SINKS, lo_t), 0)
    for start in range(0, sink_end, TILE):
        keys = start + tl.arange(0, TILE)
        k = _load_kv_tile(KC, BT, b, keys, sink_end, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        v = _load_kv_tile(VC, BT, b, keys, sink_end, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] < sink_end) & row_ok[:, None]
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale)
    for start in range(lo_t, last, TILE):
        keys = start + tl.arange(0, TILE)
        k = _load_kv_tile(KC, BT, b, keys, last, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        v = _load_kv_tile(VC, BT, b, keys, last, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        in_window = (
            (keys[None, :] > pos[:, None] - WINDOW) | (keys[None, :] < SINKS) | (WINDOW == 0)
        )
        visible = (
            (keys[None, :] <= pos[:, None]) & (keys[None, :] < last) & row_ok[:, None] & in_window
        )
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = (
        OUT + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    )
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _decode_kernel(
    Q, KC, VC, PART_O, PART_LSE, BT, CTX, scale, stride_qt, stride_qh, stride_bt, WINDOW, SINKS,
    H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, Q8: tl.constexpr = False,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_ctx = tl.load(CTX + b)
    # with a window the query (position n_ctx - 1) sees keys from n_ctx - WINDOW on, and the
    # first SINKS (walked by split 0); the splits share the window's tiles
    base = tl.where(WINDOW > 0, tl.maximum(n_ctx - WINDOW, 0) // TILE * TILE, 0)
    sink_end = tl.where((WINDOW > 0) & (split == 0), tl.minimum(SINKS, base), 0)
    # this split's keys: equal shares, rounded up to whole tiles
    per_split = tl.cdiv(tl.cdiv(n_ctx - base, NUM_SPLITS), TILE) * TILE
    lo = base + split * per_split
    hi = tl.minimum(lo + per_split, n_ctx)
    g = tl.arange(0, ROWS)
    row_ok = g < G
    head = kvh * G + g
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    m_i = tl.full((ROWS,), NEG, tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for start in range(0, sink_end, TILE):
        keys = start + tl.arange(0, TILE)
        k = _load_kv_tile(KC, BT, b, keys, sink_end, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        v = _load_kv_tile(VC, BT, b, keys, sink_end, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        visible = (keys[None, :] < sink_end) & row_ok[:, None]
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale)
    for start in range(lo, hi, TILE):
        keys = start + tl.arange(0, TILE)
        k = _load_kv_tile(KC, BT, b, keys, hi, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        v = _load_kv_tile(VC, BT, b, keys, hi, kvh, stride_bt, KVH, D, BLOCK_SIZE, BLOCK_D, Q8)
        in_window = (keys[None, :] >= n_ctx - WINDOW) | (keys[None, :] < SINKS) | (WINDOW == 0)
        visible = (keys[None, :] < hi) & row_ok[:, None] & in_window
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), NEG)
    base = (b * H + head) * NUM_SPLITS + split  # [B, H, NUM_SPLITS]
    tl.store(PART_LSE + base, lse, mask=row_ok)
    tl.store(
        PART_O + base[:, None] * D + offs_d[None, :],
        out,
        mask=row_ok[:, None] & (offs_d[None, :] < D),
    )


@triton.jit
def _reduce_kernel(
    PART_O, PART_LSE, OUT, stride_ot, stride_oh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    base = (b * H + h) * NUM_SPLITS
    lse = tl.load(PART_LSE + base + sp, mask=sp < NUM_SPLITS, other=NEG)
    m = tl.max(lse, 0)
    w = tl.where(lse > NEG, tl.exp(lse - m), 0.0)  # empty splits weigh nothing
    o = tl.load(
        PART_O + (base + sp)[:, None] * D + offs_d[None, :],
        mask=(sp[:, None] < NUM_SPLITS) & (offs_d[None, :] < D),
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty),
             mask=offs_d < D)  # fmt: skip


def kernel_takes(head_dim: int) -> bool:
    return HEAD_DIMS[0] <= head_dim <= HEAD_DIMS[1]


def _shape(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    t, h, d = q.shape
    _, block_size, kvh, dk = k_cache.shape
    if k_cache.dtype == torch.int8:  # int8 rows: D codes + the fp32 scale's 4 bytes
        dk -= 4
    if dk != d or h % kvh:
        raise ValueError(f"queries [{t}, {h}, {d}] do not fit a cache of {kvh} heads x {dk}")
    return h, kvh, d, block_size, h // kvh


def mixed_config(max_query_len: int, group: int) -> tuple[int, int]:
    """(padded heads per KV head, query tokens per program) of the mixed kernel: at least 16
    rows a program (tensor-core tiles), 64 when some sequence brings a prefill chunk."""
    g_pad = triton.next_power_of_2(group)
    rows = 64 if max_query_len > 16 // min(g_pad, 16) else 16
    return g_pad, max(rows // g_pad, 1)


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, W] on q's device
    context_lens: torch.Tensor,  # int32 [B]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    window: int = 0,  # the last `window` keys only (0: all) ...
    sinks: int = 0,  # ... and the first `sinks`
) -> torch.Tensor:
    """Causal attention of every sequence's queries over its cached keys (any batch)."""
    h, kvh, d, block_size, g = _shape(q, k_cache)
    out = torch.empty_like(q) if out is None else out
    b = block_tables.shape[0]
    g_pad, block_q = mixed_config(max_query_len, g)
    grid = (b, kvh, triton.cdiv(max_query_len, block_q))
    _mixed_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        window, sinks, H=h, KVH=kvh, G=g, G_PAD=g_pad, D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_Q=block_q, BLOCK_SIZE=block_size, TILE=TILE_N, Q8=k_cache.dtype == torch.int8,
    )  # fmt: skip
    return out


def decode_splits(max_context: int, batch: int, kv_heads: int, on_gpu: bool) -> int:
    """How many programs share one sequence's keys: enough to fill the device (about 2 per
    SM of an H200) without splitting below one tile each."""
    if not on_gpu:
        return 1 if max_context <= TILE_N else 2
    want = triton.cdiv(264, max(batch * kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_context, TILE_N), 64))


def paged_decode_triton(
    q: torch.Tensor,  # [B, H, D]: one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, W]
    context_lens: torch.Tensor,  # int32 [B]
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    window: int = 0,
    sinks: int = 0,
) -> torch.Tensor:
    """Split-KV (flash-decoding) attention for a decode-only batch."""
    h, kvh, d, block_size, g = _shape(q, k_cache)
    b = q.shape[0]
    out = torch.empty_like(q) if out is None else out
    part_o = torch.empty((b, h, num_splits, d), device=q.device, dtype=torch.float32)
    part_lse = torch.empty((b, h, num_splits), device=q.device, dtype=torch.float32)
    block_d = triton.next_power_of_2(d)
    _decode_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, part_o, part_lse, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), window, sinks,
        H=h, KVH=kvh, G=g, ROWS=max(16, triton.next_power_of_2(g)), D=d, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE=TILE_N, NUM_SPLITS=num_splits,
        Q8=k_cache.dtype == torch.int8,
    )  # fmt: skip
    _reduce_kernel[(b, h)](
        part_o, part_lse, out, out.stride(0), out.stride(1),
        H=h, D=d, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out
