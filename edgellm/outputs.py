"""What the engine hands back: per-request outputs and streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list | None = None  # per token: (logprob, {token_id: logprob})


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # ttft_s, e2e_s, tokens_per_s

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
