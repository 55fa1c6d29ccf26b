"""The one sampler every backend shares.

`process_logits` turns raw logits into the distribution a request samples from
(penalties, temperature, top-k, top-p, min-p); speculative decoding applies the
same function on both sides so acceptance preserves the target's distribution.
"""

from __future__ import annotations

import torch

from edgellm.sampling.params import SamplingParams

NEG_INF = float("-inf")


def apply_penalties(
    logits: torch.Tensor,  # [V]
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties."""
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        vals = logits[seen]
        p = params.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. logits: [V]."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (keep at least one)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop_sorted[0] = False
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), NEG_INF)
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), NEG_INF)
    return logits


def process_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """Raw logits [V] -> the processed logits a token is drawn from (greedy: argmax of them)."""
    logits = apply_penalties(logits.float().clone(), params, prompt_ids, output_ids)
    if params.greedy:
        return logits
    return filter_logits(logits, params)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Draw one token from processed logits [V] (argmax when greedy)."""
    if params.greedy:
        return int(logits.argmax())
    probs = logits.softmax(-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    return g


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, dict[int, float]]:
    """Log-probability of `token` and the k most likely tokens under raw logits [V]."""
    lp = logits.float().log_softmax(-1)
    top = torch.topk(lp, k) if k else None
    alts = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return float(lp[token]), alts
