"""Paged attention in MLX: the engine's block pool as MLX arrays, written through the slot
mapping and read through each sequence's block table.

The pool of one layer is K and V of shape `[num_blocks, block_size, n_kv_heads, head_dim]`,
the layout of the torch backend (`kernels.paged_attention`). A step's queries are flattened
into `[T, H, D]`; `StepAttention` (built once per step, shared by every layer) says which
rows belong to which sequence and how far each sees. Short query runs (decodes, speculative
verifies, small chunks) go through one padded `mx.fast.scaled_dot_product_attention` call
over gathered blocks with a boolean mask; long prefill chunks are attended one by one.
Scatter updates of the pool donate its buffer (MLX reuses an array nobody else holds), so a
write costs the written rows, not the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

try:  # optional: the MLX backend says when it cannot run
    import mlx.core as mx
except ImportError:  # pragma: no cover - exercised where MLX is not installed
    mx = None

SHORT_QUERIES = 16  # runs of at most this many queries share one padded attention call


def quantize_rows(x):
    """[..., D] -> [..., D + 4] int8: symmetric codes round(x / s), s = max|x| / 127 per row,
    then s's fp32 bytes (the torch backend's int8 row layout, `kernels.paged_attention`)."""
    x = x.astype(mx.float32)
    scale = mx.max(mx.abs(x), axis=-1, keepdims=True) / 127.0
    codes = mx.clip(mx.round(x / mx.where(scale > 0, scale, 1.0)), -127, 127).astype(mx.int8)
    return mx.concatenate([codes, scale.view(mx.int8)], axis=-1)


def dequantize_rows(rows, dtype):
    """int8 rows [..., D + 4] -> [..., D] codes * scale in `dtype` (float rows: cast)."""
    if rows.dtype != mx.int8:
        return rows.astype(dtype)
    scale = mx.contiguous(rows[..., -4:]).view(mx.float32)
    return (rows[..., :-4].astype(mx.float32) * scale).astype(dtype)


class MLXKVPool:
    """K and V per layer, `[num_blocks, block_size, n_kv_heads, head_dim]` each (int8:
    `head_dim + 4`, codes and the row's fp32 scale)."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 dtype) -> None:  # fmt: skip
        shape = (num_blocks, block_size, n_kv, head_dim + (4 if dtype == mx.int8 else 0))
        self.block_size, self.shape = block_size, shape
        self.k = [mx.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [mx.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        mx.eval(self.k, self.v)

    @property
    def arrays(self) -> list:
        return [*self.k, *self.v]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def write(self, layer: int, k, v, slots) -> None:
        """k, v [T, KVH, D] into their slots (block * block_size + offset)."""
        n, bs = self.shape[0], self.block_size
        for pool, new in ((self.k, k), (self.v, v)):
            flat = pool[layer].reshape(n * bs, *self.shape[2:])
            flat[slots] = quantize_rows(new) if flat.dtype == mx.int8 else new.astype(flat.dtype)
            pool[layer] = flat.reshape(self.shape)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        s, d = mx.array(src), mx.array(dst)
        for pool in (self.k, self.v):
            for i, a in enumerate(pool):
                a[d] = a[s]
                pool[i] = a
        mx.eval(self.k, self.v)

    def close(self) -> None:
        self.k, self.v = [], []


@dataclass(slots=True)
class _Group:
    """Sequences attended in one call: their query rows (padded), block tables and mask."""

    rows: object  # mx int32 [B * qmax]: flat query row of each padded slot
    table: object  # mx int32 [B, n_blocks]
    mask: object  # mx bool [B, 1, qmax, L] or the string "causal"
    keep: object  # mx int32: the padded slots that are real rows, in order
    n_seqs: int
    qmax: int
    ctx: int  # L: keys gathered per sequence
    qpos: np.ndarray  # [B, qmax] position of each padded query row (padding: 0)
    windowed: dict = field(default_factory=dict)  # (window, sinks) -> mx bool mask

    def mask_for(self, window: int, sinks: int):
        """The causal mask, narrowed to the last `window` keys plus the first `sinks`."""
        if not window:
            return self.mask
        if (window, sinks) not in self.windowed:
            keys = np.arange(self.ctx)[None, None, :]
            q = self.qpos[:, :, None]
            seen = (keys <= q) & ((keys > q - window) | (keys < sinks))
            self.windowed[window, sinks] = mx.array(seen[:, None])
        return self.windowed[window, sinks]


class StepAttention:
    """Everything attention needs for one step, built once from the scheduled batch."""

    def __init__(self, q_lens: list[int], starts: list[int], tables: list[list[int]],
                 block_size: int) -> None:  # fmt: skip
        self.groups: list[_Group] = []
        qsl = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
        short = [b for b, n in enumerate(q_lens) if n <= SHORT_QUERIES]
        order: list[np.ndarray] = []
        if short:
            self.groups.append(_padded(short, q_lens, starts, tables, qsl, block_size))
            order += [np.arange(qsl[b], qsl[b + 1]) for b in short]
        for b, n in enumerate(q_lens):
            if n > SHORT_QUERIES:
                self.groups.append(_padded([b], q_lens, starts, tables, qsl, block_size))
                order.append(np.arange(qsl[b], qsl[b + 1]))
        flat = np.concatenate(order)
        # the groups' outputs are concatenated in `flat` order; put rows back in batch order
        self.restore = None
        if not np.array_equal(flat, np.arange(len(flat))):
            self.restore = mx.array(np.argsort(flat).astype(np.int32))

    def __call__(self, q, k_pool, v_pool, scale: float, window: int = 0, sinks: int = 0):
        """q [T, H, D] -> [T, H * D]: each row attends to its sequence's keys up to itself
        (with a window: the last `window` of them and the first `sinks`)."""
        t, h, d = q.shape
        n_blocks, bs, n_kv, row = k_pool.shape
        outs = []
        for g in self.groups:
            qg = q[g.rows].reshape(g.n_seqs, g.qmax, h, d).transpose(0, 2, 1, 3)
            width = g.table.shape[1] * bs
            k = k_pool[g.table].reshape(g.n_seqs, width, n_kv, row)[:, : g.ctx]
            v = v_pool[g.table].reshape(g.n_seqs, width, n_kv, row)[:, : g.ctx]
            k = dequantize_rows(k, q.dtype).transpose(0, 2, 1, 3)
            v = dequantize_rows(v, q.dtype).transpose(0, 2, 1, 3)
            o = mx.fast.scaled_dot_product_attention(qg, k, v,
                                                     scale=scale, mask=g.mask_for(window, sinks))  # fmt: skip
            o = o.transpose(0, 2, 1, 3).reshape(g.n_seqs * g.qmax, h * d)
            outs.append(o if g.keep is None else o[g.keep])
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return out if self.restore is None else out[self.restore]


def _padded(seqs, q_lens, starts, tables, qsl, block_size: int) -> _Group:
    """Sequences `seqs` as one call: queries padded to the longest run, keys to the longest
    context. Query i of sequence b sits at position starts[b] + i and sees keys 0..that."""
    qmax = max(q_lens[b] for b in seqs)
    ctx = max(starts[b] + q_lens[b] for b in seqs)
    n_blocks = -(-ctx // block_size)
    table = np.zeros((len(seqs), n_blocks), dtype=np.int32)
    rows = np.zeros((len(seqs), qmax), dtype=np.int32)
    mask = np.zeros((len(seqs), 1, qmax, ctx), dtype=bool)
    qpos = np.zeros((len(seqs), qmax), dtype=np.int64)
    keep = []
    for j, b in enumerate(seqs):
        n, start = q_lens[b], starts[b]
        used = -(-(start + n) // block_size)
        table[j, :used] = np.maximum(tables[b][:used], 0)  # released window blocks: masked
        rows[j, :n] = np.arange(qsl[b], qsl[b] + n)
        visible = start + 1 + np.arange(qmax)  # keys each query row sees
        visible[n:] = 1  # padding rows look at key 0 only (kept finite, then dropped)
        mask[j, 0] = np.arange(ctx)[None, :] < visible[:, None]
        qpos[j] = visible - 1
        keep += range(j * qmax, j * qmax + n)
    whole = len(keep) == len(seqs) * qmax
    if len(seqs) == 1 and starts[seqs[0]] == 0:
        mask_arr = "causal"  # a whole prompt: MLX's own causal mask, nothing to build
    else:
        mask_arr = mx.array(mask)
    return _Group(
        mx.array(rows.reshape(-1)), mx.array(table), mask_arr,
        None if whole else mx.array(np.asarray(keep, dtype=np.int32)), len(seqs), qmax, ctx,
        qpos,
    )  # fmt: skip
