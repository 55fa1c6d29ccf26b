"""Stop rules: when a completion ends, and how its text is cut at a stop string."""

from __future__ import annotations

from edgellm.engine.sequence import Sequence
from edgellm.sampling.params import SamplingParams


def stop_reason(
    seq: Sequence, token: int, stop_ids: frozenset[int], max_model_len: int
) -> str | None:
    """Why the sequence ends after appending `token` by its token alone: "stop" for a stop
    token, "length" when out of room; None otherwise (stop strings are checked on text)."""
    if token in stop_ids:
        return "stop"
    if len(seq.output_ids) >= seq.params.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None


def truncate_at_stop(seq: Sequence, params: SamplingParams) -> bool:
    """Cut the output text at the first stop string that appears in its tail; True if one did."""
    window = max(len(s) for s in params.stop) + 16
    start = max(0, len(seq.output_text) - window)
    hits = [(seq.output_text.find(s, start), s) for s in params.stop]
    hits = [(i, s) for i, s in hits if i >= 0]
    if not hits:
        return False
    i, s = min(hits)
    seq.output_text = seq.output_text[: i + len(s) if params.include_stop_str_in_output else i]
    return True


def holdback(params: SamplingParams) -> int:
    """Characters a stream holds back: text that may still become a stop string."""
    return max((len(s) for s in params.stop), default=1) - 1
