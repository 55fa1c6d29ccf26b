"""Perplexity with a sliding window, the way llama.cpp and HF's guide compute it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.progress import Progress

from edgellm.errors import InvalidParameterError


@dataclass(slots=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood (nats/token)
    tokens_scored: int
    windows: int
    ctx: int
    stride: int


def windows(n_tokens: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) per window; each token is scored once, with
    up to `ctx` tokens of context. stride == ctx gives non-overlapping windows."""
    if not 0 < stride <= ctx:
        raise InvalidParameterError("perplexity needs 0 < stride <= ctx")
    out, scored_until = [], 1  # the very first token has no context and is never scored
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + ctx, n_tokens)
        first = max(scored_until, begin + 1)
        if first < end:
            out.append((begin, end, first))
            scored_until = end
        if end == n_tokens:
            break
    return out


def perplexity(
    score: Callable[[list[int]], torch.Tensor],
    tokens: list[int],
    ctx: int = 512,
    stride: int | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """`score(window)` returns log p(window[i+1] | window[:i+1]) for each i: [len - 1]."""
    stride = stride or ctx
    if len(tokens) < 2:
        raise InvalidParameterError("the text has fewer than two tokens")
    spans = windows(len(tokens), ctx, stride)
    total, count = 0.0, 0
    for begin, end, first in _progress(spans, progress):
        logp = score(tokens[begin:end])  # logp[j] scores position begin + j + 1
        total -= float(logp[first - begin - 1 :].double().sum())
        count += end - first
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, len(spans), ctx, stride)


def _progress(items, enabled: bool):
    if not enabled:
        yield from items
        return

    with Progress(transient=True) as bar:
        task = bar.add_task("perplexity", total=len(items))
        for item in items:
            yield item
            bar.advance(task)
