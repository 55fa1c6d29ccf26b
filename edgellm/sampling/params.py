"""Sampling options of one request (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgellm.errors import InvalidParameterError


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. `temperature=0` is greedy; every filter is off by default."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI-style, on generated tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        for check, msg in _CHECKS:
            if not check(self):
                raise InvalidParameterError(f"invalid sampling parameters: {msg}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_CHECKS = [
    (lambda p: p.n >= 1, "n must be >= 1"),
    (lambda p: p.temperature >= 0.0, "temperature must be >= 0"),
    (lambda p: p.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
    (lambda p: 0.0 < p.top_p <= 1.0, "top_p must be in (0, 1]"),
    (lambda p: 0.0 <= p.min_p <= 1.0, "min_p must be in [0, 1]"),
    (lambda p: p.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
    (lambda p: -2.0 <= p.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
    (lambda p: -2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
    (lambda p: p.max_tokens >= 1, "max_tokens must be >= 1"),
    (lambda p: p.logprobs is None or 0 <= p.logprobs <= 20, "logprobs must be in [0, 20]"),
    (lambda p: p.seed is None or p.seed >= 0, "seed must be >= 0"),
]
