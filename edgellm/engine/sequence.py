"""A sequence: its token ids, its KV block table and its progress counters."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from edgellm.sampling.params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()  # preempted with its K/V parked in host memory (see HostSwap)
    FINISHED = auto()


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One stream of tokens. The engine owns it; the backend only reads it.

    Progress counters (`num_computed_tokens`, `num_hashed_blocks`) are written by the
    block manager alone: `commit` advances them, `trim` rolls them back.
    """

    request_id: str
    token_ids: list[int]  # prompt + generated
    params: SamplingParams
    num_prompt_tokens: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    index: int = 0  # which of the request's n outputs
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    host_table: list[int] = field(default_factory=list)  # host blocks while SWAPPED
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    num_hashed_blocks: int = 0  # leading full blocks registered in the prefix cache
    # chained hash of each full block of token_ids (a pure function of the tokens, which only
    # grow): the prefix cache's keys, kept so that released window blocks need no lookup
    block_hashes: list[int] = field(default_factory=list)
    num_released_blocks: int = 0  # table entries before this (past the sinks) are released
    generator: torch.Generator | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    output_text: str = ""
    logprobs: list = field(default_factory=list)
    pending_forks: int = 0  # children to fork after the prompt is computed (n > 1)
    # drafted tokens being verified this step: after token_ids, never part of them
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the newest token still needs computing (prompt or recompute)."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
