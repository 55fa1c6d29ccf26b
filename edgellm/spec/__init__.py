"""Speculative decoding inside the engine's one step.

A proposer (`proposers.py`: n-gram lookup or a draft model) guesses k tokens; the
target scores all k + 1 positions in the same forward as everything else; the
acceptance rule (`acceptance.py`) keeps what the target's own distribution allows;
the controller (`controller.py`) adapts k and switches speculation off where it costs
more than it saves. `decoder.py` binds them into the engine's `Speculator`.
"""
