"""What every backend implements. The engine decides; the backend computes.

A backend owns the physical KV storage for `num_blocks` blocks of `block_size`
tokens and runs one forward pass over a scheduled batch: for each scheduled
sequence, `num_tokens` tokens starting at `seq.num_computed_tokens`, whose K/V
go into the blocks of `seq.block_table`. It returns logits only for the rows
that need them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from edgellm.scheduler import ScheduledSeq
from edgellm.sequence import Sequence


class Backend(Protocol):
    name: str
    block_size: int
    num_blocks: int
    vocab_size: int
    max_model_len: int

    def forward(self, batch: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] float32: `item.logit_rows` rows per scheduled item, in batch
        order (the chunk's last tokens), or every computed token of every item when
        `all_logits`."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate K/V of block src into block dst."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence finished, was aborted or preempted: drop any storage the backend keeps
        for it outside the block pool (llama.cpp sequence cells). Its block table may already
        be empty."""
        ...

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the sequence's K/V past `num_tokens` (rejected speculative tokens); the
        engine trims the block table through the block manager."""
        ...


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
