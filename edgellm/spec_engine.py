"""The engine with speculative decoding: draft k tokens, verify k + 1 in one target forward.

A step schedules as usual; every decoding sequence the controller lets speculate gets
its drafted tokens appended (and KV slots for them), so one backend forward scores them
for the whole batch beside plain decodes and prefill chunks. Rejected tokens are cut
from the sequence and their KV released (block manager `trim` + backend `truncate`).
"""

from __future__ import annotations

import time

import torch

from edgellm.engine import Engine, EngineConfig, Request
from edgellm.outputs import RequestOutput, StreamDelta
from edgellm.scheduler import ScheduledSeq
from edgellm.sequence import Sequence
from edgellm.speculative import (
    Controller,
    DraftProposer,
    Proposal,
    SpeculativeConfig,
    target_distributions,
    verify,
)


class SpeculativeEngine(Engine):
    def __init__(
        self,
        backend,
        tokenizer,
        config: EngineConfig | None,
        spec: SpeculativeConfig,
        proposer,
    ):
        super().__init__(backend, tokenizer, config)
        self.spec = spec
        self.proposer = proposer
        self.controller = Controller(spec, costly_start=isinstance(proposer, DraftProposer))

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.backend.release(seq)
            self.proposer.release(seq)
        if not out.scheduled:
            return []
        self.backend.copy_blocks(out.block_copies)
        proposals, all_decode = self._propose(out.scheduled)
        t1 = time.perf_counter()
        logits = self.backend.forward(out.scheduled)
        self.stats["forward_s"] += time.perf_counter() - t1
        self.stats["steps"] += 1
        deltas = self._postprocess_spec(out.scheduled, logits, proposals)
        # prefill chunks, or a draft catching up on a prompt, would blur the cost of a step
        if all_decode and not (proposals and self.proposer.catch_up_tokens):
            drafted = max((len(p.tokens) for p in proposals.values()), default=0)
            self.controller.record_step(time.perf_counter() - t0, drafted)
        return deltas

    def _propose(self, scheduled: list[ScheduledSeq]) -> tuple[dict[int, Proposal], bool]:
        """Draft tokens for the decoding sequences that speculate this step, keyed by seq_id;
        appends them to the sequences and widens their scheduled chunks."""
        # drafted tokens share the step's token budget with everything scheduled
        spare = self.config.max_num_batched_tokens - sum(it.num_tokens for it in scheduled)
        asks = []
        for item in scheduled:
            if self._is_decode(item):
                asks.append((item.seq, k := self._k(item, max(spare, 0))))
                spare -= k
        all_decode = len(asks) == len(scheduled)
        asks = [(seq, k) for seq, k in asks if k > 0]
        props = self.proposer.propose(asks) if asks else []
        proposals = {s.seq_id: p for (s, _), p in zip(asks, props, strict=True) if p.tokens}
        for seq, _ in asks:
            if seq.seq_id not in proposals:  # nothing drafted: give the reserved slots back
                self.block_manager.trim(seq, len(seq))
        for item in scheduled:
            p = proposals.get(item.seq.seq_id)
            if p is not None:
                item.seq.token_ids += p.tokens
                item.num_tokens = item.num_logits = 1 + len(p.tokens)
        return proposals, all_decode

    @staticmethod
    def _is_decode(item: ScheduledSeq) -> bool:
        seq = item.seq
        return item.num_tokens == 1 and item.wants_logits and not seq.pending_forks

    def _k(self, item: ScheduledSeq, spare: int) -> int:
        seq = item.seq
        room = min(
            seq.params.max_tokens - len(seq.output_ids) - 1,
            self.max_model_len - len(seq) - 1,
            spare,
        )
        k = self.controller.k_for(seq, max(room, 0))
        if not k or not self.block_manager.can_append(seq, k):
            return 0
        # reserve the slots now: the sequences after this one share the pool
        self.backend.copy_blocks(self.block_manager.append_slots(seq, k))
        return k

    # ---- verification --------------------------------------------------------------------------
    def _postprocess_spec(
        self, scheduled: list[ScheduledSeq], logits: torch.Tensor, proposals: dict[int, Proposal]
    ) -> list[StreamDelta]:
        rows = torch.split(logits, [item.logit_rows for item in scheduled])
        plain = [
            (it, r) for it, r in zip(scheduled, rows, strict=True) if it.seq.seq_id not in proposals
        ]
        for item, _ in plain:
            if self._is_decode(item) and item.seq.seq_id in self.controller.states:
                self.controller.record(item.seq, 0, 0, 1)
        plain_rows = [r for _, r in plain if len(r)]
        empty = logits[:0]
        deltas = self._postprocess(
            [it for it, _ in plain], torch.cat(plain_rows) if plain_rows else empty
        )
        touched: dict[str, Request] = {}
        for item, r in zip(scheduled, rows, strict=True):
            p = proposals.get(item.seq.seq_id)
            if p is not None:
                req = self.requests[item.seq.request_id]
                self._accept(req, item.seq, r, p)
                touched[req.request_id] = req
        return deltas + [d for req in touched.values() for d in self._deltas(req)]

    def _accept(self, req: Request, seq: Sequence, rows: torch.Tensor, p: Proposal) -> None:
        """Verify the drafted tokens of one sequence; keep the accepted ones plus one more."""
        k = len(p.tokens)
        del seq.token_ids[len(seq) - k :]
        processed = target_distributions(rows, seq, p.tokens)  # [k + 1, V]
        n, extra = verify(processed, p, seq.params, seq.generator)
        # K/V are valid for the tokens before the first rejected one
        computed = len(seq) + n
        seq.num_computed_tokens = computed
        self.block_manager.trim(seq, computed)
        self.backend.truncate(seq, computed)
        produced = 0
        for token, row in zip([*p.tokens[:n], extra], rows, strict=False):
            self._push_token(req, seq, token, row)
            produced += 1
            if seq.finished:  # tokens after a stop are discarded
                break
        else:
            self.block_manager.register_computed(seq)
        self.controller.record(seq, k, n, produced)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str) -> None:
        super()._finish(seq, reason)
        self.proposer.release(seq)

    def _request_metrics(self, req: Request) -> dict:
        return {**super()._request_metrics(req), **self.controller.metrics(req.seqs)}

    def pop_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id].seqs
        out = super().pop_output(request_id)
        for seq in seqs:
            self.controller.release(seq)
        return out
