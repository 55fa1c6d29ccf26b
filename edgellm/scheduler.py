"""Continuous-batching scheduler: which sequences run this step, and how many tokens each.

Each step fills a token budget with decodes of running sequences first, then
prefill chunks (long prompts are split across steps), then newly admitted
requests as soon as their blocks fit. When blocks run out, the newest running
sequence is preempted (its blocks freed, recomputed later from its tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from edgellm.errors import InvalidParameterError
from edgellm.kv_cache import BlockManager
from edgellm.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise InvalidParameterError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    num_logits: int = 0  # > 0: logits for the chunk's last num_logits tokens (speculative verify)

    @property
    def wants_logits(self) -> bool:
        """Logits are needed when this chunk reaches the sequence's last token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)

    @property
    def logit_rows(self) -> int:
        """How many logits rows the backend returns for this chunk (in token order)."""
        return self.num_logits or int(self.wants_logits)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # admitting while preempting would thrash
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not bm.can_append(seq, 0) and self._preempt_newest(out, keep=seq):
                pass
            if seq not in self.running:  # preempted itself: nothing else could give way
                continue
            out.block_copies += bm.append_slots(seq, 0)
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
        self.block_manager.free(victim)
        victim.status = SequenceStatus.WAITING
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        self.num_preemptions += 1
        return victim is not keep

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence at once, freeing its blocks (also for aborts of waiting ones)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
