"""Continuous-batching scheduler: which sequences run this step, and how many tokens each.

Each step fills a token budget with decodes of running sequences first, then
prefill chunks (long prompts are split across steps), then newly admitted
requests as soon as their blocks fit. When blocks run out, the newest running
sequence is preempted: its blocks freed and recomputed later from its tokens, or, when the
backend has host swap space and `preemption` says so (by default: when copying is measured
cheaper than recomputing), its K/V parked in host memory and brought back before any new
request is admitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager
from edgellm.engine.sequence import Sequence, SequenceStatus

# (sequence, room) -> drafted tokens to verify this step, at most `room` (0: plain decode)
Lookahead = Callable[[Sequence, int], int]
# a preempted sequence -> True: swap its K/V to the host; False: recompute it later
SwapPolicy = Callable[[Sequence], bool]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: `num_new` of its tokens from `seq.num_computed_tokens`,
    then, when the chunk reaches its last token, its drafted tokens (`seq.spec_token_ids`)."""

    seq: Sequence
    num_new: int  # real tokens to compute this step
    num_lookahead: int = 0  # slots the scheduler reserved for drafted tokens

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def wants_logits(self) -> bool:
        """Logits are needed when this chunk reaches the sequence's last token."""
        return self.seq.num_computed_tokens + self.num_new == len(self.seq)

    @property
    def num_spec(self) -> int:
        return len(self.seq.spec_token_ids) if self.wants_logits else 0

    @property
    def num_tokens(self) -> int:
        """Tokens the backend computes: the new ones plus the drafted ones."""
        return self.num_new + self.num_spec

    @property
    def logit_rows(self) -> int:
        """How many logits rows the backend returns for this chunk (its last tokens, in order):
        the last real token and every drafted one."""
        return 1 + self.num_spec if self.wants_logits else 0

    @property
    def is_decode(self) -> bool:
        """One new token at the end of a sequence that has nothing left to fork."""
        return self.num_new == 1 and self.wants_logits and not self.seq.pending_forks

    def input_ids(self) -> list[int]:
        seq, start = self.seq, self.seq.num_computed_tokens
        ids = seq.token_ids[start : start + self.num_new]
        return ids + seq.spec_token_ids if self.wants_logits else ids


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) before all
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) then these

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens + s.num_lookahead for s in self.scheduled)


class Scheduler:
    """Fills each step's token budget; with `lookahead` (speculation), decodes also get slots
    for drafted tokens out of what the budget has left."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        lookahead: Lookahead | None = None,
        swap_policy: SwapPolicy | None = None,
    ):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.lookahead = lookahead
        self.swap_policy = swap_policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()  # oldest first
        self.num_preemptions = 0
        self.num_swaps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # admitting while preempting would thrash
            budget = self._swap_in(out, budget)
        if not out.preempted and not self.swapped:  # swapped sequences come back first
            budget = self._admit_waiting(out, budget)
        if self.lookahead is not None:
            self._reserve_lookahead(out, budget)
        return out

    def _reserve_lookahead(self, out: SchedulerOutput, budget: int) -> None:
        """Slots for drafted tokens, from the budget the step has left, decodes in order."""
        bm = self.block_manager
        for item in out.scheduled:
            if budget <= 0:
                break
            seq = item.seq
            if not item.is_decode:
                continue
            room = min(
                seq.params.max_tokens - len(seq.output_ids) - 1,
                self.max_model_len - len(seq) - 1,
                budget,
            )
            k = self.lookahead(seq, max(room, 0))
            if k <= 0 or not bm.can_append(seq, k):
                continue
            out.block_copies += bm.append_slots(seq, k)
            item.num_lookahead = k
            budget -= k

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            upto = seq.num_computed_tokens + n  # blocks come lazily with a window
            while not bm.can_append(seq, 0, upto) and self._preempt_newest(out, keep=seq):
                pass
            if seq not in self.running:  # preempted itself: nothing else could give way
                continue
            out.block_copies += bm.append_slots(seq, 0, upto)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def _preempt_newest(self, out: SchedulerOutput, keep: Sequence) -> bool:
        """Free the newest running sequence (possibly `keep` itself); False if none left."""
        if not self.running:
            return False
        victim = self.running.pop()
        scheduled = [s for s in out.scheduled if s.seq is victim]
        for s in scheduled:
            out.scheduled.remove(s)
        bm = self.block_manager
        if (
            self.swap_policy is not None
            and victim.num_computed_tokens
            and bm.can_swap_out(victim)
            and self.swap_policy(victim)
        ):
            out.swap_out += bm.swap_out(victim)
            victim.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(victim)
            self.num_swaps += 1
        else:
            bm.free(victim)
            victim.status = SequenceStatus.WAITING
            self.waiting.appendleft(victim)
        out.preempted.append(victim)
        self.num_preemptions += 1
        return victim is not keep

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped sequences back, oldest first, while their blocks fit."""
        bm = self.block_manager
        slots = sum(1 + s.pending_forks for s in self.running)
        while self.swapped and budget > 0 and slots < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed, budget)
            if not bm.can_swap_in(seq, seq.num_computed_tokens + n):
                break
            self.swapped.popleft()
            out.swap_in += bm.swap_in(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.block_copies += bm.append_slots(seq, 0, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            slots += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        # a request with n > 1 forks its children when its prompt is computed: they count now
        slots = sum(1 + s.pending_forks for s in [*self.running, *self.swapped])
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if slots + 1 + seq.pending_forks > self.config.max_num_seqs or not bm.can_allocate(
                seq, budget
            ):
                break
            slots += 1 + seq.pending_forks
            self.waiting.popleft()
            bm.allocate(seq, num_new=budget)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return budget

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence at once, freeing its blocks (also for aborts of waiting ones)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
