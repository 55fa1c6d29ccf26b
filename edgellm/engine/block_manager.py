"""Paged KV-cache block manager (PagedAttention-style), shared by every backend.

It hands out block ids and tracks who uses them; it holds no tensors. Full
blocks whose K/V are computed are registered under a chained hash of their
token ids (prefix caching); a freed cached block stays revivable in LRU order
until its id is needed again. A block shared by several sequences is copied
before one of them writes into it (copy-on-write).

With sliding-window attention in every layer (`window` > 0) a sequence holds only the
blocks its next queries can see: the block of its first `sinks` tokens and the last
`window` tokens' blocks. Blocks wholly outside are released as progress is committed (their
table entries become NULL_BLOCK; a cached one stays revivable), blocks are allocated as the
scheduler computes them rather than for the whole prompt at once, and a prefix-cache hit
needs only the blocks its window sees.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from edgellm.engine.sequence import Sequence
from edgellm.errors import InvalidParameterError


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # chained hash of a full, computed block
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, checked on a hit


NULL_BLOCK = -1  # a table entry whose block was released (outside every layer's window)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


def live(table: list[int]) -> list[int]:
    """The block ids a table holds (released entries left out)."""
    return [b for b in table if b != NULL_BLOCK]


class CacheListener(Protocol):
    """Told when a block enters or leaves the prefix cache (a backend that keeps K/V outside
    the block pool, as llama.cpp's cells, follows the cache this way)."""

    def block_cached(self, block_id: int) -> None: ...

    def block_evicted(self, block_id: int) -> None: ...


class BlockManager:
    """Block ids for sequences: allocation, prefix hits, append, fork, copy-on-write, free.

    It is also the one writer of a sequence's progress: `commit` advances
    `num_computed_tokens`, `trim` rolls it back, allocation and `free` set it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        listener: CacheListener | None = None,
        num_host_blocks: int = 0,
        window: int = 0,
        sinks: int = 0,
    ):
        if num_blocks < 1 or block_size < 1:
            raise InvalidParameterError(
                "the KV cache needs at least one block of at least one token"
            )
        if window < 0 or sinks < 0:
            raise InvalidParameterError("window and sinks must be >= 0")
        self.block_size = block_size
        # every layer's window is at most `window` keys (plus `sinks` first tokens): 0 = off
        self.window, self.sinks = window, sinks
        self.enable_prefix_caching = enable_prefix_caching
        self.listener = listener
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_to_block: dict[int, int] = {}
        # host blocks for swapped-out sequences (offloading); ids only, the backend copies
        self.num_host_blocks = num_host_blocks
        self.free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.prefix_queries = 0  # prompt blocks looked up
        self.prefix_hits = 0  # ... found cached

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def sink_blocks(self) -> int:
        return self.blocks_needed(self.sinks) if self.window else 0

    def window_start(self, num_tokens: int) -> int:
        """First block a query at position >= num_tokens can see past the sink blocks: its
        keys start at num_tokens - window + 1 (everything without a window)."""
        if not self.window:
            return 0
        return max(num_tokens - self.window + 1, 0) // self.block_size

    def _sees(self, i: int, num_tokens: int) -> bool:
        """Whether queries from position num_tokens on read block i."""
        return i < self.sink_blocks or i >= self.window_start(num_tokens)

    def _upto(self, seq: Sequence, upto: int | None, num_new: int = 0) -> int:
        """Tokens whose blocks must exist: `upto` (the tokens computed by the end of this
        step) when blocks come lazily (a window), else all of them plus `num_new`."""
        if self.window and upto is not None:
            return min(upto, len(seq) + num_new)
        return len(seq) + num_new

    # ---- allocation --------------------------------------------------------------------------
    def _take(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the least recently used cached block
            self.uncache(block_id)
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    def _hash_blocks(self, seq: Sequence, n_full: int) -> None:
        """Extend seq.block_hashes over its first n_full full blocks."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), n_full):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(chain_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))

    def _lookup(self, seq: Sequence, i: int) -> int | None:
        """The cached block holding seq's full block i, if any."""
        bs = self.block_size
        block_id = self.hash_to_block.get(seq.block_hashes[i])
        tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks matching the sequence's leading full blocks. With a window:
        the longest prefix whose blocks its next queries see are all cached (the others
        NULL_BLOCK: they need not exist)."""
        if not self.enable_prefix_caching:
            return []
        # at least one token must be computed to produce logits
        n_full = (len(seq) - 1) // self.block_size
        self._hash_blocks(seq, n_full)
        if not self.window:
            hits = []
            for i in range(n_full):
                block_id = self._lookup(seq, i)
                if block_id is None:
                    break
                hits.append(block_id)
            return hits
        found: dict[int, int | None] = {}
        for h in range(n_full, 0, -1):  # h blocks hit: queries start at h * block_size
            need = [i for i in range(h) if self._sees(i, h * self.block_size)]
            for i in need:
                if i not in found:
                    found[i] = self._lookup(seq, i)
            if all(found[i] is not None for i in need):
                return [found[i] if i in need else NULL_BLOCK for i in range(h)]
        return []

    def can_allocate(self, seq: Sequence, num_new: int | None = None) -> bool:
        """Room for `seq`'s blocks: all its tokens, or with a window the prefix hit plus the
        `num_new` tokens computed next (None: all)."""
        hits = self._cached_prefix(seq)
        upto = None if num_new is None else len(hits) * self.block_size + num_new
        revived = sum(1 for b in live(hits) if self.blocks[b].ref_count == 0)
        return self.blocks_needed(self._upto(seq, upto)) - len(hits) + revived <= self.num_free

    def allocate(
        self, seq: Sequence, use_prefix_cache: bool = True, num_new: int | None = None
    ) -> None:
        """Blocks for all of `seq`'s current tokens (with a window: for the `num_new` computed
        next), reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already has blocks"
        hits = self._cached_prefix(seq) if use_prefix_cache else []
        if self.enable_prefix_caching and use_prefix_cache:
            self.prefix_queries += (len(seq) - 1) // self.block_size
        self.prefix_hits += len(live(hits))
        for block_id in live(hits):
            self._ref(block_id)
        upto = None if num_new is None else len(hits) * self.block_size + num_new
        seq.block_table = hits + [
            self._take() for _ in range(self.blocks_needed(self._upto(seq, upto)) - len(hits))
        ]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.num_released_blocks = self.window_start(seq.num_computed_tokens)

    def can_append(self, seq: Sequence, num_new: int = 0, upto: int | None = None) -> bool:
        """Room for all of seq's tokens plus `num_new` (with a window: its first `upto`), and
        a copy if a shared block is written."""
        need = self.blocks_needed(self._upto(seq, upto, num_new)) - len(seq.block_table)
        return max(need, 0) + (self._shared_write_block(seq) is not None) <= self.num_free

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the block table of the next block written, if other sequences share it."""
        w = seq.num_computed_tokens // self.block_size
        if w < len(seq.block_table) and self.blocks[seq.block_table[w]].ref_count > 1:
            return w
        return None

    def append_slots(
        self, seq: Sequence, num_new: int = 0, upto: int | None = None
    ) -> list[tuple[int, int]]:
        """Blocks for all of seq's tokens plus `num_new` (with a window: its first `upto`);
        returns (src, dst) block copies."""
        copies = []
        w = self._shared_write_block(seq)
        if w is not None:  # copy-on-write: the block about to be written is shared
            old = seq.block_table[w]
            seq.block_table[w] = self._take()
            self._unref(old)
            copies.append((old, seq.block_table[w]))
        while len(seq.block_table) < self.blocks_needed(self._upto(seq, upto, num_new)):
            seq.block_table.append(self._take())
        return copies

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None  # most recently used end: evicted last

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (cached ones stay revivable)."""
        # free back to front so the tail of a prefix is evicted before its head
        for block_id in reversed(live(seq.block_table)):
            self._unref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.num_released_blocks = 0
        # num_cached_tokens stays: a statistic

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (copy-on-write on the next write)."""
        for block_id in live(parent.block_table):
            self._ref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks
        child.num_released_blocks = parent.num_released_blocks
        child.block_hashes = list(parent.block_hashes)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Forget K/V past `num_tokens` (rejected speculative tokens); frees whole blocks."""
        keep = self.blocks_needed(num_tokens)
        if num_tokens % self.block_size and keep <= len(seq.block_table):
            # the kept partial block will be rewritten in place: its hash would lie
            last = self.blocks[seq.block_table[keep - 1]]
            if last.ref_count == 1 and last.hash is not None:
                self.uncache(last.block_id)
        for block_id in live(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, num_tokens // self.block_size)

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """K/V of the sequence's first `num_computed` tokens are now computed: the one place
        progress advances (`trim` rolls it back). Newly full blocks enter the prefix cache."""
        if not seq.num_computed_tokens <= num_computed <= len(seq):
            raise InvalidParameterError(
                f"commit of {num_computed} tokens: the sequence has {seq.num_computed_tokens} "
                f"computed of {len(seq)}"
            )
        seq.num_computed_tokens = num_computed
        self.register_computed(seq)
        self._release_window(seq)

    def _release_window(self, seq: Sequence) -> None:
        """Give back the blocks no later query of `seq` sees (outside its window and sinks)."""
        end = min(self.window_start(seq.num_computed_tokens), len(seq.block_table))
        table = seq.block_table
        for i in range(max(seq.num_released_blocks, self.sink_blocks), end):
            if table[i] != NULL_BLOCK:
                self._unref(table[i])
                table[i] = NULL_BLOCK
        seq.num_released_blocks = max(seq.num_released_blocks, end)

    # ---- swapping (offloading) -----------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(live(seq.block_table)) <= len(self.free_host)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to host blocks: returns (device, host) pairs to copy
        before the device blocks are reused. Progress stays: the K/V come back with
        `swap_in`. Shared (prefix) blocks are copied too and stay with their other owners."""
        host = [NULL_BLOCK if b == NULL_BLOCK else self.free_host.pop() for b in seq.block_table]
        pairs = [(d, h) for d, h in zip(seq.block_table, host, strict=True) if d != NULL_BLOCK]
        for block_id in reversed(live(seq.block_table)):
            self._unref(block_id)
        seq.block_table = []
        seq.host_table = host
        return pairs

    def can_swap_in(self, seq: Sequence, upto: int | None = None) -> bool:
        """Room for its blocks and the tokens it computes next (with a window: up to `upto`)."""
        if self.window and upto is not None:
            more = max(self.blocks_needed(min(upto, len(seq) + 1)) - len(seq.host_table), 0)
            return len(live(seq.host_table)) + more <= self.num_free
        return self.blocks_needed(len(seq) + 1) <= self.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Fresh device blocks for a swapped sequence: returns (host, device) pairs to copy.
        The new blocks re-enter the prefix cache as the sequence commits."""
        assert not seq.block_table, "sequence already has device blocks"
        table = [NULL_BLOCK if h == NULL_BLOCK else self._take() for h in seq.host_table]
        pairs = [(h, d) for h, d in zip(seq.host_table, table, strict=True) if h != NULL_BLOCK]
        self.free_host.extend(reversed(live(seq.host_table)))
        seq.host_table = []
        seq.block_table = table
        seq.num_hashed_blocks = 0  # new ids: hashed again by the next commit
        return pairs

    def free_swapped(self, seq: Sequence) -> None:
        """A swapped sequence ends (aborted): its host blocks are free again."""
        self.free_host.extend(reversed(live(seq.host_table)))
        seq.host_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.num_released_blocks = 0

    # ---- prefix caching ------------------------------------------------------------------------
    def register_computed(self, seq: Sequence) -> None:
        """Hash the sequence's full blocks whose K/V are now computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = seq.num_computed_tokens // bs
        self._hash_blocks(seq, n_full)
        for i in range(seq.num_hashed_blocks, n_full):
            if seq.block_table[i] == NULL_BLOCK:
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash = seq.block_hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.hash_to_block.setdefault(block.hash, block.block_id)
                if self.listener is not None:
                    self.listener.block_cached(block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, n_full)

    def uncache(self, block_id: int) -> None:
        """Take a block out of the prefix cache: evicted for reuse, rewritten in place, or
        given up by a backend that cannot keep its K/V (the listener hears of it)."""
        block = self.blocks[block_id]
        if block.hash is None:
            return
        if self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
        if self.listener is not None:
            self.listener.block_evicted(block_id)

    def is_cached(self, block_id: int) -> bool:
        return self.blocks[block_id].hash is not None

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Every block is free xor referenced; ref counts equal the owners; nothing leaks."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            table = live(seq.block_table)
            assert len(table) == len(set(table)), "block twice in one table"
            for block_id in table:
                owners[block_id] += 1
            for i, block_id in enumerate(seq.block_table):  # with a window: nothing unseen
                assert block_id == NULL_BLOCK or self._sees(i, seq.num_computed_tokens), (
                    f"sequence {seq.seq_id} holds block {block_id} outside its window"
                )
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != owners {owners[block.block_id]}"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free_ids), (
                f"block {block.block_id} free-list state disagrees with ref_count {block.ref_count}"
            )
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"stale hash entry for block {block_id}"
        host = sorted([*self.free_host, *(h for seq in seqs for h in live(seq.host_table))])
        assert host == list(range(self.num_host_blocks)), "host blocks lost or owned twice"
