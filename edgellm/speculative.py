"""Speculative decoding: proposers, the acceptance rule and the adaptive controller.

A proposer guesses the next k tokens of a sequence (a small draft model, or an
n-gram lookup in the sequence's own text); the target scores all k + 1 positions
in one forward and `verify` keeps the longest prefix the rejection-sampling rule
of Leviathan et al. / Chen et al. accepts, plus one token of its own. Both sides
use the same `process_logits`, so the output distribution is the target's
(greedy: the very same tokens). `SpeculativeEngine` (spec_engine.py) drives it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from edgellm.errors import InvalidParameterError
from edgellm.kv_cache import BlockManager
from edgellm.sampler import process_logits
from edgellm.sampling_params import SamplingParams
from edgellm.scheduler import ScheduledSeq
from edgellm.sequence import Sequence

MODES = ("off", "ngram", "draft")


@dataclass(slots=True)
class SpeculativeConfig:
    """How to speculate. `num_draft_tokens` is the most a sequence drafts per step (k)."""

    method: str = "ngram"  # "ngram" | "draft" | "off"
    num_draft_tokens: int = 4
    draft_model: str | None = None  # with method="draft"
    ngram_max: int = 3  # longest suffix looked up (n)
    ngram_min: int = 2  # shortest suffix that counts as a match
    adaptive: bool = True  # k from acceptance; off-switch when it does not pay
    probe_every: int = 32  # decode steps a switched-off sequence waits before trying again

    def __post_init__(self):
        if self.method not in MODES:
            raise InvalidParameterError(
                f"unknown speculative method {self.method!r} (choose from {', '.join(MODES)})"
            )
        if not 1 <= self.num_draft_tokens <= 32:
            raise InvalidParameterError("num_draft_tokens must be in [1, 32]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidParameterError("need 1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise InvalidParameterError("speculative method 'draft' needs a draft model")


@dataclass(slots=True)
class Proposal:
    tokens: list[int]  # the k drafted tokens
    probs: torch.Tensor | None = None  # [k, V] the draft's processed distributions; None: one-hot


# ---- the acceptance rule --------------------------------------------------------------------------
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


# ---- proposers -------------------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from ngram_max down to ngram_min) and propose the tokens that followed it."""

    catch_up_tokens = 0  # a lookup computes nothing (see DraftProposer.catch_up_tokens)

    def __init__(self, ngram_max: int = 3, ngram_min: int = 2):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        return [Proposal(self.lookup(seq.token_ids, k)) for seq, k in items]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            start = find_last(tokens, tokens[-n:], end=len(tokens) - 1)
            if start >= 0:
                return tokens[start + n : start + n + k]
        return []

    def release(self, seq: Sequence) -> None:
        pass

    def close(self) -> None:
        pass


def find_last(tokens: list[int], pattern: list[int], end: int) -> int:
    """Start of the last occurrence of `pattern` that ends before index `end`, or -1."""
    n = len(pattern)
    first = pattern[0]
    for i in range(end - n, -1, -1):
        if tokens[i] == first and tokens[i : i + n] == pattern:
            return i
    return -1


class DraftProposer:
    """A small model with the target's tokenizer, on any backend. Its K/V lives in its own
    BlockManager; each target sequence has a mirror sequence that is rolled back with it."""

    def __init__(self, backend):
        self.backend = backend
        self.block_manager = BlockManager(backend.num_blocks, backend.block_size, True)
        if hasattr(backend, "bind"):
            backend.bind(self.block_manager)
        self.mirrors: dict[int, Sequence] = {}  # target seq_id -> draft sequence
        self.catch_up_tokens = 0

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Proposal]:
        live = [(seq, k, m) for seq, k in items if (m := self._mirror(seq, k)) is not None]
        # tokens computed beyond the usual gap (a drafted token and the bonus): a new mirror's
        # prompt, or the text a paused sequence produced; such a step's time is no cost sample
        self.catch_up_tokens = sum(max(m.num_uncomputed - 2, 0) for _, _, m in live)
        self._catch_up([m for _, _, m in live])
        drafted = {id(m): [] for _, _, m in live}
        probs = {id(m): [] for _, _, m in live}
        for step in range(max((k for _, k, _ in live), default=0)):
            batch = [(seq, m) for seq, k, m in live if step < k]
            self._draft_step(batch, drafted, probs)
        return [self._proposal(seq, drafted, probs) for seq, _ in items]

    def _proposal(self, seq: Sequence, drafted: dict, probs: dict) -> Proposal:
        m = self.mirrors.get(seq.seq_id)
        if m is None or not drafted.get(id(m)):
            return Proposal([])
        return Proposal(drafted[id(m)], torch.stack(probs[id(m)]))

    def _catch_up(self, mirrors: list[Sequence]) -> None:
        """Bring the mirrors close enough to their last token that the first draft step
        (which computes every uncomputed token) fits the backend's batch: a new mirror holds
        the whole prompt. Usually nothing to do: after a step the gap is a token or two,
        computed by the first draft forward itself rather than by an extra one."""
        budget = getattr(self.backend, "n_batch", None) or 1 << 30
        while sum(m.num_uncomputed for m in mirrors) > budget:
            chunk, used = [], 0
            for m in sorted(mirrors, key=lambda m: -m.num_uncomputed):
                n = min(m.num_uncomputed - 1, budget - used)
                if n <= 0:
                    break
                chunk.append(ScheduledSeq(m, n))
                used += n
            if not chunk:  # only last tokens left: the draft step takes them
                break
            self.backend.forward(chunk)  # no chunk reaches its last token: no logits
            for item in chunk:
                item.seq.num_computed_tokens += item.num_tokens
                self.block_manager.register_computed(item.seq)

    def _draft_step(self, batch, drafted: dict, probs: dict) -> None:
        """One draft forward for every mirror in `batch`; appends one drafted token each."""
        scheduled = [ScheduledSeq(m, m.num_uncomputed) for _, m in batch]
        logits = self.backend.forward(scheduled)  # [len(batch), V]
        for (seq, m), item, row in zip(batch, scheduled, logits, strict=True):
            m.num_computed_tokens += item.num_tokens
            self.block_manager.register_computed(m)
            history = seq.output_ids + drafted[id(m)]
            q = process_logits(row, seq.params, seq.prompt_ids, history).softmax(-1)
            token = int(q.argmax()) if seq.params.greedy else draw(q, seq.generator)
            drafted[id(m)].append(token)
            probs[id(m)].append(q)
            m.token_ids.append(token)

    def _mirror(self, seq: Sequence, k: int) -> Sequence | None:
        """The draft sequence of `seq`, synced to its tokens, with room for k more; None if
        the draft cache is full (this sequence then skips speculation this step)."""
        m = self.mirrors.get(seq.seq_id)
        if m is None:
            m = Sequence(seq.request_id, list(seq.token_ids), seq.params, seq.num_prompt_tokens)
            if not self.block_manager.can_allocate(m):
                return None
            self.block_manager.allocate(m)
            self.mirrors[seq.seq_id] = m
        self.sync(seq, m)
        if not self.block_manager.can_append(m, k):
            self.release(seq)
            return None
        # reserve the k drafted tokens' slots now: later mirrors share the pool
        self.backend.copy_blocks(self.block_manager.append_slots(m, k))
        return m

    def sync(self, seq: Sequence, m: Sequence) -> None:
        """Roll the mirror back to the longest common prefix with the target, then catch up."""
        common = 0
        limit = min(len(m), len(seq), m.num_computed_tokens)
        while common < limit and m.token_ids[common] == seq.token_ids[common]:
            common += 1
        if common < m.num_computed_tokens:
            self.block_manager.trim(m, common)
            self.backend.truncate(m, common)
        m.token_ids = list(seq.token_ids)

    def release(self, seq: Sequence) -> None:
        m = self.mirrors.pop(seq.seq_id, None)
        if m is not None:
            self.block_manager.free(m)
            self.backend.release(m)

    def close(self) -> None:
        for seq_id in list(self.mirrors):
            m = self.mirrors.pop(seq_id)
            self.block_manager.free(m)
            self.backend.release(m)


# ---- adaptation -----------------------------------------------------------------------------------
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

    def metrics(self, seqs: list[Sequence]) -> dict:
        """Per-request statistics, summed over its sequences."""
        states = [self.states[s.seq_id] for s in seqs if s.seq_id in self.states]
        proposed = sum(st.proposed for st in states)
        accepted = sum(st.accepted for st in states)
        tokens = sum(st.tokens for st in states)
        forwards = sum(st.spec_steps + st.plain_steps for st in states)
        return {
            "spec_proposed": proposed,
            "spec_accepted": accepted,
            "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_tokens_per_forward": tokens / forwards if forwards else 0.0,
        }

    def release(self, seq: Sequence) -> None:
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
