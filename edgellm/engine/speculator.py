"""The contract between the engine's step and a speculative decoder (`edgellm.spec`).

The engine stays ignorant of how tokens are drafted or judged: the scheduler asks
`lookahead` how many slots a decoding sequence wants, the step asks `propose` for
the drafts (they go to `seq.spec_token_ids`), the backend scores them with the
sequence's last token, and `verify` says how many the target accepts and which token
follows them. With speculation off the engine has no speculator and proposes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from edgellm.engine.outputs import SpecMetrics
from edgellm.engine.sequence import Sequence


@dataclass(slots=True)
class Proposal:
    tokens: list[int]  # the k drafted tokens
    probs: torch.Tensor | None = None  # [k, V] the draft's processed distributions; None: one-hot


class Speculator(Protocol):
    def lookahead(self, seq: Sequence, room: int) -> int:
        """Tokens to draft for `seq` this step, at most `room` (0: a plain decode)."""
        ...

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        """Up to k drafted tokens for each (sequence, k), in order."""
        ...

    def verify(self, seq: Sequence, rows: torch.Tensor, proposal: Proposal) -> tuple[int, int]:
        """(accepted drafted tokens, the target's next token after them) from the target's
        raw logits `rows` [k + 1, V] of the verified positions."""
        ...

    def record(self, seq: Sequence, proposed: int, accepted: int, produced: int) -> None:
        """What one decode of `seq` drafted, accepted and produced (proposed 0: a plain one)."""
        ...

    def record_step(self, seconds: float, drafted: int) -> None:
        """The wall time of a step of decodes only; `drafted`: the most tokens a sequence
        drafted in it (0: a plain step). The cost model of the controller."""
        ...

    def release(self, seq: Sequence) -> None:
        """`seq` finished or was preempted: drop what the proposer keeps for it."""
        ...

    def forget(self, seq: Sequence) -> None:
        """Its request is gone: drop its statistics too."""
        ...

    def metrics(self, seqs: list[Sequence]) -> SpecMetrics: ...

    def close(self) -> None: ...
