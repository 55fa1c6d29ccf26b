"""Proposers: who guesses the next k tokens of a sequence.

- `NgramProposer`: prompt lookup, the tokens that followed the latest earlier
  occurrence of the sequence's last n tokens (costs nothing to compute);
- `DraftProposer`: a small model with the target's tokenizer on the target's kind of
  backend, its K/V in its own block manager, one mirror sequence per target sequence.
"""

from __future__ import annotations

import torch

from edgellm.engine.block_manager import BlockManager
from edgellm.engine.scheduler import ScheduledSeq
from edgellm.engine.sequence import Sequence
from edgellm.engine.speculator import Proposal
from edgellm.sampling.sampler import process_logits
from edgellm.spec.acceptance import draw


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
        self.block_manager = BlockManager(backend.num_blocks, backend.block_size, True, backend)
        backend.bind(self.block_manager.uncache)
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
        budget = self.backend.max_num_batched_tokens
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
                self.block_manager.commit(item.seq, item.start + item.num_new)

    def _draft_step(self, batch, drafted: dict, probs: dict) -> None:
        """One draft forward for every mirror in `batch`; appends one drafted token each."""
        scheduled = [ScheduledSeq(m, m.num_uncomputed) for _, m in batch]
        logits = self.backend.forward(scheduled)  # [len(batch), V]
        for (seq, m), item, row in zip(batch, scheduled, logits, strict=True):
            self.block_manager.commit(m, item.start + item.num_new)
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
