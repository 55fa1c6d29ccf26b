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
        """Logits [rows, vocab] float32: one row per sequence whose chunk reaches its end
        (in batch order), or every computed token of every sequence when `all_logits`."""
        ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate K/V of block src into block dst."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence's storage is no longer needed (backends with their own cells)."""
        ...


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * n_layers * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
