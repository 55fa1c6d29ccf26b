"""What the engine hands back: per-request outputs and streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecMetrics:
    """Speculative decoding of one request, summed over its sequences."""

    proposed: int = 0  # drafted tokens sent to verification
    accepted: int = 0  # ... that the target accepted
    tokens_per_forward: float = 0.0  # tokens produced per target forward while decoding

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(slots=True)
class RequestMetrics:
    """Timing of one request (seconds from its arrival); `spec` when speculation ran."""

    ttft_s: float | None = None  # time to first token
    e2e_s: float | None = None  # time to the last token (finished requests)
    decode_tokens_per_s: float = 0.0  # after the first token
    spec: SpecMetrics | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list | None = None  # per token: (logprob, {token_id: logprob})
    error: str | None = None  # what went wrong, when finish_reason is "error"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def text(self) -> str:
        return self.outputs[0].text


@dataclass(slots=True)
class StreamDelta:
    """New text of one completion since the previous step."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None  # what went wrong, when finish_reason is "error"
