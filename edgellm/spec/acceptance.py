"""The acceptance rule: which drafted tokens the target keeps, so that output follows the
target's own distribution (Leviathan et al. / Chen et al. rejection sampling; greedy:
the very same tokens). Both sides use the same `process_logits`."""

from __future__ import annotations

import torch

from edgellm.engine.sequence import Sequence
from edgellm.engine.speculator import Proposal
from edgellm.sampling.params import SamplingParams
from edgellm.sampling.sampler import process_logits


def target_distributions(
    logits: torch.Tensor,  # [k + 1, V] raw target logits for the verified positions
    seq: Sequence,
    drafted: list[int],
) -> torch.Tensor:
    """Processed target logits [k + 1, V]; position i sees the history plus drafted[:i]."""
    out, prompt = seq.output_ids, seq.prompt_ids
    rows = [
        process_logits(logits[i], seq.params, prompt, out + drafted[:i]) for i in range(len(logits))
    ]
    return torch.stack(rows)


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probabilities [V] (exponential race, as the sampler does)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify(
    processed: torch.Tensor,  # [k + 1, V] processed target logits
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted drafted tokens, the target's own next token after them)."""
    if params.greedy:
        return verify_greedy(processed, proposal.tokens)
    p = processed.softmax(-1)  # [k + 1, V]
    for i, token in enumerate(proposal.tokens):
        q = proposal_probs(proposal, i, p.shape[-1])
        if uniform(generator) * q[token] < p[i, token]:  # accept with prob min(1, p/q)
            continue
        residual = (p[i] - q).clamp_min(0)
        if residual.sum() <= 0:  # p == q up to rounding: any draw from p is right
            residual = p[i]
        return i, draw(residual / residual.sum(), generator)
    k = len(proposal.tokens)
    return k, draw(p[k], generator)


def verify_greedy(processed: torch.Tensor, drafted: list[int]) -> tuple[int, int]:
    best = processed.argmax(-1).tolist()  # [k + 1]
    n = 0
    while n < len(drafted) and drafted[n] == best[n]:
        n += 1
    return n, best[n]


def proposal_probs(proposal: Proposal, i: int, vocab: int) -> torch.Tensor:
    if proposal.probs is not None:
        return proposal.probs[i]
    return torch.nn.functional.one_hot(torch.tensor(proposal.tokens[i]), vocab).float()
