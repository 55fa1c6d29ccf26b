"""The engine: `step()` = schedule -> backend forward -> sample -> postprocess.

Requests can be added and aborted at any time; every step returns the text each
running request gained (streaming), and finished requests are retired at once.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from edgellm.errors import ContextLengthError, InvalidParameterError
from edgellm.kv_cache import BlockManager
from edgellm.outputs import CompletionOutput, RequestOutput, StreamDelta
from edgellm.sampler import make_generator, process_logits, sample_token, top_logprobs
from edgellm.sampling_params import SamplingParams
from edgellm.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from edgellm.sequence import Sequence


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_mb: float = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    decoders: dict[int, object] = field(default_factory=dict)  # seq_id -> incremental detokenizer
    emitted: dict[int, int] = field(default_factory=dict)  # seq_id -> chars already streamed
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_ids: frozenset[int] = frozenset()  # token ids that end a completion

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs) and not any(s.pending_forks for s in self.seqs)


class Engine:
    """Drives one backend with the shared block manager, scheduler and sampler."""

    def __init__(self, backend, tokenizer, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_model_len = backend.max_model_len
        self.block_manager = BlockManager(
            backend.num_blocks, backend.block_size, self.config.enable_prefix_caching
        )
        if hasattr(backend, "bind"):  # backends that mirror blocks in their own cells
            backend.bind(self.block_manager)
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len
            ),
            self.block_manager,
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "forward_s": 0.0}

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidParameterError(f"request id {request_id!r} is already in use")
        stop = set(params.stop_token_ids) | (
            set() if params.ignore_eos else self.tokenizer.stop_ids
        )
        req = Request(request_id, text, ids, params, stop_ids=frozenset(stop))
        seq = Sequence(request_id, list(ids), params, generator=make_generator(params.seed))
        seq.pending_forks = params.n - 1
        self._track(req, seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidParameterError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        bad = [t for t in ids if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise InvalidParameterError(f"token id {bad[0]} is outside the vocabulary")
        if self.block_manager.blocks_needed(len(ids) + 1) > self.block_manager.num_blocks:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the KV cache holds only "
                f"{self.block_manager.num_blocks * self.block_manager.block_size}; raise --kv-cache-mb"
            )

    def _track(self, req: Request, seq: Sequence) -> None:
        req.seqs.append(seq)
        req.decoders[seq.seq_id] = self.tokenizer.stream_decoder(prompt_ids=req.prompt_ids)
        req.emitted[seq.seq_id] = 0

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, free its KV blocks and forget it; returns what it had produced
        (finish_reason "abort" on unfinished completions). Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            seq.pending_forks = 0
            if not seq.finished:
                self._finish(seq, "abort")
        return self.pop_output(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One scheduling round; returns the new text of every request that advanced."""
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.backend.release(seq)
        if not out.scheduled:
            return []
        self.backend.copy_blocks(out.block_copies)
        t0 = time.perf_counter()
        logits = self.backend.forward(out.scheduled)
        self.stats["forward_s"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        return self._postprocess(out.scheduled, logits)

    def _postprocess(
        self, scheduled: list[ScheduledSeq], logits: torch.Tensor
    ) -> list[StreamDelta]:
        wanting = [s for s in scheduled if s.wants_logits]
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.block_manager.register_computed(item.seq)
        touched: dict[str, Request] = {}
        for item, row in zip(wanting, logits, strict=True):
            req = self.requests[item.seq.request_id]
            for seq in [item.seq, *self._fork(req, item.seq)]:
                self._append_token(req, seq, row)
            touched[req.request_id] = req
        return [d for req in touched.values() for d in self._deltas(req)]

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """After the prompt is computed, n > 1 requests fork children that share its blocks."""
        children = []
        for i in range(1, parent.pending_forks + 1):
            seed = None if req.params.seed is None else req.params.seed + i
            child = Sequence(
                req.request_id,
                list(parent.token_ids),
                req.params,
                parent.num_prompt_tokens,
                index=i,
                generator=make_generator(seed),
            )
            self.block_manager.fork(parent, child)
            child.status = parent.status
            self.scheduler.running.append(child)
            self._track(req, child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _append_token(self, req: Request, seq: Sequence, row: torch.Tensor) -> None:
        params = seq.params
        processed = process_logits(row, params, seq.prompt_ids, seq.output_ids)
        token = sample_token(processed, params, seq.generator)
        self._push_token(req, seq, token, row)

    def _push_token(self, req: Request, seq: Sequence, token: int, row: torch.Tensor) -> None:
        """Append a chosen token (raw logits `row` gave it) and apply the stop rules."""
        params = seq.params
        if params.logprobs is not None:
            seq.logprobs.append(top_logprobs(row, token, params.logprobs))
        seq.token_ids.append(token)
        self.stats["generated_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        self._check_stop(req, seq, token)

    def _check_stop(self, req: Request, seq: Sequence, token: int) -> None:
        params = seq.params
        decoder = req.decoders[seq.seq_id]
        if token in req.stop_ids:  # the stop token itself is not part of the text
            seq.output_text += decoder.flush()
            return self._finish(seq, "stop")
        seq.output_text += decoder.step(token)
        out_of_room = len(seq.output_ids) >= params.max_tokens or len(seq) >= self.max_model_len
        if out_of_room:
            seq.output_text += decoder.flush()
        if params.stop and self._truncate_at_stop(seq, params):
            return self._finish(seq, "stop")
        if out_of_room:
            return self._finish(seq, "length")
        return None

    @staticmethod
    def _truncate_at_stop(seq: Sequence, params: SamplingParams) -> bool:
        window = max(len(s) for s in params.stop) + 16
        start = max(0, len(seq.output_text) - window)
        hits = [(seq.output_text.find(s, start), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        seq.output_text = seq.output_text[: i + len(s) if params.include_stop_str_in_output else i]
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.backend.release(seq)

    def _deltas(self, req: Request) -> list[StreamDelta]:
        """Text gained since last time; text that may still become a stop string is held back."""
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        deltas = []
        for seq in req.seqs:
            end = len(seq.output_text) if seq.finished else max(len(seq.output_text) - hold, 0)
            start = req.emitted[seq.seq_id]
            if end > start or seq.finished:
                deltas.append(
                    StreamDelta(
                        req.request_id,
                        seq.index,
                        seq.output_text[start:end],
                        seq.output_ids,
                        seq.finish_reason,
                    )
                )
                req.emitted[seq.seq_id] = max(end, start)
        if req.finished and req.finish_time is None:
            req.finish_time = time.perf_counter()
        return deltas

    # ---- results and metrics -------------------------------------------------------------------
    def output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        seqs = sorted(req.seqs, key=lambda s: s.index)
        outs = [
            CompletionOutput(
                s.index,
                s.output_text,
                s.output_ids,
                s.finish_reason,
                s.logprobs if req.params.logprobs is not None else None,
            )
            for s in seqs
        ]
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_ids,
            outs,
            req.finished,
            seqs[0].num_cached_tokens if seqs else 0,
            self._request_metrics(req),
        )

    def _request_metrics(self, req: Request) -> dict:
        m = {}
        if req.first_token_time is not None:
            m["ttft_s"] = req.first_token_time - req.arrival
        if req.finish_time is not None:
            m["e2e_s"] = req.finish_time - req.arrival
            n = sum(len(s.output_ids) for s in req.seqs)
            decode_s = req.finish_time - (req.first_token_time or req.arrival)
            m["decode_tokens_per_s"] = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        return m

    def pop_output(self, request_id: str) -> RequestOutput:
        """The final output of a finished request, forgetting the request."""
        out = self.output(request_id)
        del self.requests[request_id]
        return out

    def metrics(self) -> dict:
        bm = self.block_manager
        used_slots = sum(len(s) for s in self.scheduler.running)
        alloc_slots = sum(len(s.block_table) for s in self.scheduler.running) * bm.block_size
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "blocks_total": bm.num_blocks,
            "blocks_free": bm.num_free,
            "blocks_used": bm.num_blocks - bm.num_free,
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "kv_slots_allocated": alloc_slots,
            "kv_slots_used": used_slots,
            "preemptions": self.scheduler.num_preemptions,
            **self.stats,
        }

    # ---- scoring (perplexity) ------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Log-probability of each token given the ones before it: [len - 1] float32."""
        self._check_prompt(token_ids[:-1] or token_ids)
        seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
        if self.block_manager.blocks_needed(len(seq)) > self.block_manager.num_free:
            raise ContextLengthError("the KV cache is too small (or busy) for this window")
        # every position needs logits, so cached prefix blocks are of no use here
        self.block_manager.allocate(seq, use_prefix_cache=False)
        out = torch.empty(len(token_ids) - 1)
        try:
            while seq.num_computed_tokens < len(seq) - 1:
                n = min(len(seq) - 1 - seq.num_computed_tokens, self.config.max_num_batched_tokens)
                s = seq.num_computed_tokens
                logits = self.backend.forward([ScheduledSeq(seq, n)], all_logits=True)
                targets = torch.tensor(token_ids[s + 1 : s + n + 1])
                out[s : s + n] = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
                seq.num_computed_tokens += n
        finally:
            self.block_manager.free(seq)
            self.backend.release(seq)
        return out
