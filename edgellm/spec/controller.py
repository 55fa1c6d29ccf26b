"""Adaptation: how many tokens each sequence drafts, and when speculation is off."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from edgellm.config import SpeculativeConfig
from edgellm.engine.outputs import SpecMetrics
from edgellm.engine.sequence import Sequence


@dataclass(slots=True)
class SeqSpecState:
    """Per-sequence statistics and the adaptive choice of k."""

    k: int
    proposed: int = 0
    accepted: int = 0
    spec_steps: int = 0  # target forwards that verified drafted tokens
    plain_steps: int = 0  # decode forwards without drafted tokens
    tokens: int = 0  # tokens produced by this sequence's decode forwards
    acceptance: float = 0.7  # running (EMA) acceptance rate per drafted token
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # (drafted, accepted)
    off_until: int = 0  # decode step index before which speculation stays off
    steps: int = 0  # decode steps seen


EMA = 0.3
WINDOW = 16
RECENT = 8  # speculative steps a sequence's real gain is judged on
MIN_EVIDENCE = 4  # speculative steps before a sequence may be switched off


class Controller:
    """Chooses k per sequence and switches speculation off where it costs more than it saves.

    Cost is measured, not assumed: the wall time of plain decode steps and of speculative
    steps (draft + verify), the latter per number of drafted tokens, since both drafting and
    verifying cost more with k. For each sequence, k maximises the expected tokens per step
    (from its running acceptance rate) over the step's relative cost; where the tokens its
    last speculative steps really produced fall below what those steps cost (in plain
    steps), speculation pauses for `probe_every` steps and probes again with k = 1."""

    def __init__(self, config: SpeculativeConfig, costly_start: bool = False):
        self.config = config
        # a proposer that must first compute the sequence (a draft model prefilling the
        # prompt) starts only where the engine's measurements say speculation pays
        self.costly_start = costly_start
        self.pooled: deque[tuple[int, int]] = deque(maxlen=4 * WINDOW)  # all sequences
        self.states: dict[int, SeqSpecState] = {}
        # recent step times; their minimum is the cost estimate, since other processes on
        # the machine only ever add time
        self.plain_s: deque[float] = deque(maxlen=WINDOW)  # decode steps without speculation
        self.spec_s: dict[int, deque[float]] = {}  # drafted tokens -> speculative step times

    def state(self, seq: Sequence) -> SeqSpecState:
        if seq.seq_id not in self.states:
            self.states[seq.seq_id] = SeqSpecState(k=self.config.num_draft_tokens)
        return self.states[seq.seq_id]

    def k_for(self, seq: Sequence, room: int) -> int:
        """Tokens to draft this step (0: plain decode); `room` bounds it (max_tokens, context)."""
        st = self.state(seq)
        st.steps += 1
        if not self.config.adaptive:
            return min(self.config.num_draft_tokens, room)
        if st.steps <= 2 or st.steps < st.off_until:  # warm-up measures plain steps
            return 0
        starting = st.steps == 3 or st.steps == st.off_until
        if starting and self.costly_start and not self.pays():
            st.off_until = st.steps + self.config.probe_every
            return 0
        return min(st.k, room)

    def pays(self) -> bool:
        """Whether some k beats plain decoding at the measured costs and the acceptance
        pooled over recent speculative steps of all sequences (True until measured)."""
        proposed = sum(p for p, _ in self.pooled)
        if self.cost(1) is None or not proposed:
            return True
        a = sum(acc for _, acc in self.pooled) / proposed
        k_max = self.config.num_draft_tokens
        return any(expected_tokens(a, k) >= self.cost(k) for k in range(1, k_max + 1))

    def record_step(self, seconds: float, drafted: int) -> None:
        """A decode step's wall time; `drafted`: the most tokens a sequence drafted in it."""
        if drafted == 0:
            self.plain_s.append(seconds)
        else:
            self.spec_s.setdefault(drafted, deque(maxlen=WINDOW)).append(seconds)

    def cost(self, k: int) -> float | None:
        """Seconds of a step drafting k tokens over a plain step (None until measured):
        measured where k was, else linear in k through the measured ones."""
        if not self.plain_s or not self.spec_s:
            return None
        plain = min(self.plain_s)
        if k in self.spec_s:
            return min(self.spec_s[k]) / plain
        slopes = sorted((min(v) / plain - 1) / j for j, v in self.spec_s.items())
        return 1 + max(slopes[len(slopes) // 2], 0.0) * k

    def record(self, seq: Sequence, proposed: int, accepted: int, produced: int) -> None:
        if proposed == 0 and seq.seq_id not in self.states:  # never asked to speculate
            return
        st = self.state(seq)
        st.tokens += produced
        if proposed == 0:
            st.plain_steps += 1
            return
        st.spec_steps += 1
        st.proposed += proposed
        st.accepted += accepted
        st.acceptance = (1 - EMA) * st.acceptance + EMA * (accepted / proposed)
        st.recent.append((proposed, accepted))
        self.pooled.append((proposed, accepted))
        if self.config.adaptive:
            self._adapt(st)

    def _adapt(self, st: SeqSpecState) -> None:
        k_max = self.config.num_draft_tokens
        costs = [self.cost(k) for k in range(1, k_max + 1)]
        if costs[0] is None:  # nothing measured yet: from acceptance alone
            st.k = choose_k(st.acceptance, k_max)
            return
        gains = [expected_tokens(st.acceptance, k) / c for k, c in enumerate(costs, start=1)]
        best = max(range(k_max), key=gains.__getitem__)
        st.k = best + 1
        if len(st.recent) < MIN_EVIDENCE:
            return
        # what the recent speculative steps really produced, against what they cost
        produced = sum(a + 1 for _, a in st.recent)
        cost = sum(self.cost(d) for d, _ in st.recent)
        if produced < cost:  # (acceptance swings from step to step; this is what happened)
            st.off_until = st.steps + self.config.probe_every
            st.k = 1
            st.recent.clear()

    def metrics(self, seqs: list[Sequence]) -> SpecMetrics:
        """Per-request statistics, summed over its sequences."""
        states = [self.states[s.seq_id] for s in seqs if s.seq_id in self.states]
        proposed = sum(st.proposed for st in states)
        accepted = sum(st.accepted for st in states)
        tokens = sum(st.tokens for st in states)
        forwards = sum(st.spec_steps + st.plain_steps for st in states)
        return SpecMetrics(proposed, accepted, tokens / forwards if forwards else 0.0)

    def forget(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens per step drafting k, each accepted with probability `acceptance`
    (until the first rejection), plus the target's own token."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def choose_k(acceptance: float, k_max: int) -> int:
    """Draft until the chance that every drafted token is accepted falls below 1/4."""
    if acceptance <= 0.0:
        return 1
    if acceptance >= 1.0:
        return k_max
    return max(1, min(k_max, math.ceil(math.log(0.25) / math.log(acceptance))))
