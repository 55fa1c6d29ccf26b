"""`SpeculativeDecoder`: a proposer, the acceptance rule and the controller, as the engine's
`Speculator` (see `edgellm.engine.speculator`)."""

from __future__ import annotations

import torch

from edgellm.backends.base import Backend
from edgellm.config import SpeculativeConfig
from edgellm.engine.outputs import SpecMetrics
from edgellm.engine.sequence import Sequence
from edgellm.engine.speculator import Proposal
from edgellm.spec.acceptance import target_distributions, verify
from edgellm.spec.controller import Controller
from edgellm.spec.proposers import DraftProposer, NgramProposer


class SpeculativeDecoder:
    """Drafts with `proposer`, judges with the rejection-sampling rule, adapts k per sequence."""

    def __init__(self, config: SpeculativeConfig, proposer: NgramProposer | DraftProposer):
        self.config = config
        self.proposer = proposer
        # a draft model first computes the prompt: it starts only where it measurably pays
        self.controller = Controller(config, costly_start=isinstance(proposer, DraftProposer))

    def lookahead(self, seq: Sequence, room: int) -> int:
        return self.controller.k_for(seq, room)

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        return self.proposer.propose(items)

    def verify(self, seq: Sequence, rows: torch.Tensor, proposal: Proposal) -> tuple[int, int]:
        processed = target_distributions(rows, seq, proposal.tokens)  # [k + 1, V]
        return verify(processed, proposal, seq.params, seq.generator)

    def record(self, seq: Sequence, proposed: int, accepted: int, produced: int) -> None:
        self.controller.record(seq, proposed, accepted, produced)

    def record_step(self, seconds: float, drafted: int) -> None:
        if drafted and self.proposer.catch_up_tokens:  # the draft computed a prompt: no sample
            return
        self.controller.record_step(seconds, drafted)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def forget(self, seq: Sequence) -> None:
        self.controller.forget(seq)

    def metrics(self, seqs: list[Sequence]) -> SpecMetrics:
        return self.controller.metrics(seqs)

    def close(self) -> None:
        self.proposer.close()


def build_speculator(
    config: SpeculativeConfig, draft_backend: Backend | None = None
) -> SpeculativeDecoder | None:
    """The speculator `config` asks for (None when off); method "draft" needs the draft
    model's backend."""
    if not config.enabled:
        return None
    if config.method == "draft":
        return SpeculativeDecoder(config, DraftProposer(draft_backend))
    return SpeculativeDecoder(config, NgramProposer(config.ngram_max, config.ngram_min))
