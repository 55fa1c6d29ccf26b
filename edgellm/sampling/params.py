"""Sampling options of one request (validated on construction).

The bounds are those of OpenAI's API (temperature in [0, 2], penalties in [-2, 2],
at most 4 stop strings) plus caps that keep hostile values out of the sampler;
the server's request models declare the same bounds (`LIMITS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgellm.errors import InvalidParameterError

# every bound in one table: the server's pydantic models read it too
LIMITS = {
    "n": (1, 128),  # OpenAI's cap; the engine also holds n to max_num_seqs
    "temperature": (0.0, 2.0),
    "top_k": (-1, 2**31 - 1),  # -1 and 0 turn it off
    "top_p": (0.0, 1.0),  # open at 0
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 2.0),  # open at 0
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "seed": (-(2**63), 2**64 - 1),  # any 64-bit value, signed or not; reduced by the engine
    "logprobs": (0, 20),
}
MAX_STOP = 4  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MIN_TEMPERATURE = 0.01  # smaller positive temperatures are raised to it, as vLLM does


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. `temperature=0` is greedy; every filter is off by default."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1): off
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
        self.top_k = max(self.top_k, 0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # 1/t would overflow the logits
            self.temperature = MIN_TEMPERATURE

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy on raw logits (no penalty changes them): the argmax of a whole batch of
        rows, taken at once, is each row's token."""
        return (
            self.greedy
            and self.repetition_penalty == 1.0
            and not (self.presence_penalty or self.frequency_penalty)
        )


def _within(name: str, open_low: bool = False):
    lo, hi = LIMITS[name]

    def check(p: SamplingParams) -> bool:
        value = getattr(p, name)
        if value is None:
            return True
        return (lo < value if open_low else lo <= value) and value <= hi

    shown = f"({lo}, {hi}]" if open_low else f"[{lo}, {hi}]"
    return check, f"{name} must be in {shown}"


def _valid_stop(p: SamplingParams) -> bool:
    return len(p.stop) <= MAX_STOP and all(len(s) <= MAX_STOP_CHARS for s in p.stop)


_OPEN_LOW = ("top_p", "repetition_penalty")
# comparisons are written so that NaN fails them
_CHECKS = [
    *(_within(name) for name in LIMITS if name not in _OPEN_LOW),
    *(_within(name, open_low=True) for name in _OPEN_LOW),
    (lambda p: p.max_tokens >= 1, "max_tokens must be >= 1"),
    (_valid_stop, f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters"),
]
