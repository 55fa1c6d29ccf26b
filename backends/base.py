"""What every backend implements. The engine decides; the backend computes.

A backend owns the physical KV storage for `num_blocks` blocks of `block_size`
tokens and runs one forward pass over a scheduled batch: for each scheduled
sequence, `item.num_tokens` tokens (`item.input_ids()`) from position
`item.start`, whose K/V go into the blocks of `seq.block_table`. It returns logits
only for the rows that need them. Backends are built from (model, EngineConfig) by
the registry (`backends/registry.py`); `check_backend` holds each to this contract.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from edgellm.config import EngineConfig, kv_pool_blocks
from edgellm.errors import InvalidParameterError
from edgellm.kernels.paged_attention import KV_SCALE_SLOTS
from edgellm.models.llama import attention_windows

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the engine sits above the backends: its types are only named here
    from edgellm.engine.scheduler import ScheduledSeq
    from edgellm.engine.sequence import Sequence


@runtime_checkable
class Backend(Protocol):
    name: str
    block_size: int
    num_blocks: int  # KV blocks the backend's storage holds
    vocab_size: int
    max_model_len: int  # longest sequence it can run (model limit, bounded by the pool)
    max_num_batched_tokens: int  # most tokens one forward takes

    def bind(self, uncache: Callable[[int], None]) -> None:
        """Called once by the engine: `uncache(block_id)` withdraws a block from the prefix
        cache, for a backend that cannot keep that block's K/V any longer."""
        ...

    def forward(self, batch: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] float32: `item.logit_rows` rows per scheduled item, in batch
        order (the chunk's last tokens), or every computed token of every item when
        `all_logits`. Valid until the backend's next forward: a backend may hand out a view
        of its own output buffer (llama.cpp does), so a caller that keeps them copies them.
        It may hand out the same tensor object again (llama.cpp does, for each row count),
        but then over the same memory: the engine keeps the numpy view of such a tensor."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate K/V of block src into block dst."""
        ...

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the sequence's K/V past `num_tokens` (rejected speculative tokens); the
        engine trims the block table through the block manager."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence finished, was aborted or preempted: drop any storage the backend keeps
        for it outside the block pool (llama.cpp sequence cells). Its block table may already
        be empty."""
        ...

    def block_cached(self, block_id: int) -> None:
        """The block's K/V entered the prefix cache."""
        ...

    def block_evicted(self, block_id: int) -> None:
        """The block left the prefix cache (evicted for reuse or rewritten)."""
        ...

    def close(self) -> None:
        """Free the backend's memory and native handles; idempotent."""
        ...


def check_backend(backend: object) -> None:
    """Raise TypeError naming what `backend` lacks of the Backend contract."""
    members = [*Backend.__annotations__, *(n for n in vars(Backend) if not n.startswith("_"))]
    missing = sorted({m for m in members if not hasattr(backend, m)})
    if missing:
        raise TypeError(f"{type(backend).__name__} is not a Backend: lacks {', '.join(missing)}")


class PoolStorage:
    """The hooks of a backend whose K/V live only in the engine's block pool (torch, MLX):
    whatever the prefix cache keeps stays valid, K/V past a truncation is simply overwritten
    and the block manager owns the blocks, so there is nothing to do."""

    def bind(self, uncache: Callable[[int], None]) -> None:
        pass

    def block_cached(self, block_id: int) -> None:
        pass

    def block_evicted(self, block_id: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        pass


def flatten_batch(batch: list[ScheduledSeq], block_size: int, all_logits: bool = False):
    """A scheduled batch as flat lists: token ids, positions, slots (block * block_size +
    offset), the rows that need logits, and each item's query count and start position."""
    ids, pos, slots, rows, q_lens, starts = [], [], [], [], [], []
    total = 0
    for item in batch:
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_tokens
        ids += item.input_ids()
        table = seq.block_table
        positions = range(start, start + n)
        pos += positions
        slots += [table[p // block_size] * block_size + p % block_size for p in positions]
        first = total if all_logits else total + n - item.logit_rows
        rows += range(first, total + n)
        q_lens.append(n)
        starts.append(start)
        total += n
    return ids, pos, slots, rows, q_lens, starts


def copy_pool_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies) -> None:
    """Copy-on-write in a per-layer (K, V) tensor pool: block src's K/V into block dst."""
    if not copies:
        return
    dev = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in copies], device=dev)
    dst = torch.tensor([d for _, d in copies], device=dev)
    for k, v in kv_caches:
        k[dst] = k[src]
        v[dst] = v[src]


# bytes of one (token, KV head) row of head_dim values in llama.cpp's block types
GGML_ROW_BYTES = {"q8_0": lambda d: d // 32 * 34, "q4_0": lambda d: d // 32 * 18}


def kv_row_bytes(head_dim: int, dtype: torch.dtype | str) -> int:
    """Bytes one (token, KV head) row of K (or V) takes: a float dtype's elements, int8
    codes plus their fp32 scale, or a llama.cpp block type ("q8_0", "q4_0")."""
    if isinstance(dtype, str):
        return GGML_ROW_BYTES[dtype](head_dim)
    if dtype == torch.int8:
        return head_dim + KV_SCALE_SLOTS
    return head_dim * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(
    n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype | str
) -> int:
    return 2 * n_layers * n_kv_heads * kv_row_bytes(head_dim, dtype)


KV_WINDOW_CONTEXT = 65536  # positions a `kv_window` run allows by default (max_model_len)


@dataclass(frozen=True, slots=True)
class Windows:
    """What each layer attends to: the last `layers[i]` keys (0: all) plus `sinks[i]` first."""

    layers: list[int]
    sinks: list[int]

    @property
    def everywhere(self) -> int:
        """The widest window when every layer has one (the block manager frees outside it)."""
        return max(self.layers) if self.layers and all(self.layers) else 0

    @property
    def kept_sinks(self) -> int:
        return max(self.sinks) if self.everywhere else 0


def attention_plan(args, config: EngineConfig) -> Windows:
    """The layers' windows on a backend that masks them (the model's own, narrowed by
    `kv_window`)."""
    return Windows(*attention_windows(args, config.kv_window, config.kv_sinks))


def pool_geometry(
    args, config: EngineConfig, dtype: torch.dtype | str, windows: Windows | None = None,
    backend: str = "this",
) -> tuple[int, int, int]:  # fmt: skip
    """(bytes of K/V per token, blocks `kv_cache_mb` holds, the longest sequence): the
    model's context or the config's limit, and never more tokens than the whole pool.
    `dtype` is how K/V are stored (see `kv_row_bytes`).

    `windows`: the backend masks sliding windows. When every layer has one, a sequence holds
    only its window's blocks, so its length is not bounded by the pool (if the pool holds
    a window, the sinks and one step's chunk). None: the backend attends to the whole
    context, so a model with sliding windows is limited to its narrowest window (where
    the two agree exactly), and `kv_window` is an error."""
    per_token = kv_bytes_per_token(
        args.num_hidden_layers, args.num_key_value_heads, args.head_dim, dtype
    )
    num_blocks = kv_pool_blocks(config.kv_cache_mb, config.block_size, per_token)
    limit = min(config.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
    if windows is None:
        if config.kv_window:
            raise InvalidParameterError(
                f"kv_window is not available on the {backend} backend, which attends to the whole "
                "context (the torch, mlx and cuda backends have it)"
            )
        declared = [w for w in args.layer_windows() if w]
        if declared and min(declared) < limit:
            log.warning(
                "the %s backend attends to the whole context: the context is limited to the "
                "model's sliding window of %d tokens, where the two agree",
                backend, min(declared),
            )  # fmt: skip
            limit = min(declared)
    elif windows.everywhere:
        if config.kv_window:
            limit = config.max_model_len or max(args.max_position_embeddings, KV_WINDOW_CONTEXT)
        bs = config.block_size
        held = -(-windows.kept_sinks // bs) + -(-(windows.everywhere - 1) // bs) + 1
        if num_blocks >= held + -(-config.max_num_batched_tokens // bs):
            return per_token, num_blocks, limit
    return per_token, num_blocks, min(limit, num_blocks * config.block_size)


class HostSwap:
    """K/V blocks of preempted sequences parked in host memory and brought back (offloading).

    A backend whose pool is `self.kv_caches` (per layer (K, V) `[num_blocks, block_size,
    KVH, D]`) calls `init_swap`; the engine then moves blocks with `swap_out` / `swap_in`
    when the scheduler finds a copy cheaper than recomputing (`swap_seconds`, measured).
    The host pool is pinned when the device pool is on a GPU, and allocated on first use.
    """

    num_host_blocks: int = 0

    def init_swap(self, swap_space_mb: float, bytes_per_token: int) -> None:
        per_block = bytes_per_token * self.block_size
        self.num_host_blocks = int(swap_space_mb * 2**20 // per_block) if swap_space_mb else 0
        self._host: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._block_seconds: float | None = None  # measured copy time of one block, one way

    def _host_pool(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._host is None:
            k0 = self.kv_caches[0][0]
            shape = (self.num_host_blocks, *k0.shape[1:])
            pin = k0.is_cuda

            def make():
                t = torch.empty(shape, dtype=k0.dtype)
                return t.pin_memory() if pin else t

            self._host = [(make(), make()) for _ in self.kv_caches]
        return self._host

    def _copy(self, pairs: list[tuple[int, int]], out: bool) -> float:
        """Copy blocks (device -> host when `out`, else host -> device); returns seconds."""
        if not pairs:
            return 0.0
        t0 = time.perf_counter()
        dev = self.kv_caches[0][0].device
        a = torch.tensor([p for p, _ in pairs])
        b = torch.tensor([q for _, q in pairs])
        for (dk, dv), (hk, hv) in zip(self.kv_caches, self._host_pool(), strict=True):
            if out:  # device blocks a -> host blocks b
                da = a.to(dev)
                hk[b] = dk[da].to("cpu")
                hv[b] = dv[da].to("cpu")
            else:  # host blocks a -> device blocks b
                db = b.to(dev)
                dk[db] = hk[a].to(dev, non_blocking=True)
                dv[db] = hv[a].to(dev, non_blocking=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        per_block = seconds / len(pairs)
        prev = self._block_seconds
        self._block_seconds = per_block if prev is None else 0.7 * prev + 0.3 * per_block
        return seconds

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: park the K/V before the device blocks are reused."""
        self._copy(pairs, out=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: bring parked K/V back."""
        self._copy(pairs, out=False)

    def swap_seconds(self, num_blocks: int) -> float:
        """Measured cost of parking `num_blocks` and bringing them back (a probe of a few
        blocks through the host pool's end the first time)."""
        if self._block_seconds is None:
            n = min(8, self.num_host_blocks, len(self.kv_caches[0][0]))
            probe = [(i, self.num_host_blocks - n + i) for i in range(n)]
            self._copy(probe, out=True)
        return 2 * num_blocks * (self._block_seconds or 0.0)

    def close_swap(self) -> None:
        self._host = None
        self.num_host_blocks = 0
