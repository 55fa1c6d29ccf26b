"""The engine: `step()` = schedule -> propose -> backend forward -> verify and commit.

Requests can be added and aborted at any time; every step returns the text each
running request gained (streaming), and finished requests are retired at once.
Speculative decoding is part of the same step: the scheduler reserves slots for
drafted tokens, the speculator drafts them onto `seq.spec_token_ids`, one forward
scores them beside plain decodes and prefill chunks, and `_advance` settles every
sequence the same way. Without a speculator nothing is proposed.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from edgellm.backends.base import Backend
from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager, live
from edgellm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from edgellm.engine.scheduler import ScheduledSeq, Scheduler
from edgellm.engine.sequence import Sequence
from edgellm.engine.speculator import Proposal, Speculator
from edgellm.engine.stop import holdback, stop_reason, truncate_at_stop
from edgellm.errors import ContextLengthError, InvalidParameterError
from edgellm.sampling.params import SamplingParams
from edgellm.sampling.sampler import make_generator, process_logits, sample_token, top_logprobs

log = logging.getLogger(__name__)


def _step_checks(
    logits: torch.Tensor, plain: bool, array: np.ndarray | None = None
) -> tuple[bool, list[int]]:
    """Whether every row of the step has a usable maximum, and each row's argmax (when a
    plain greedy row will take it). A row is usable iff its maximum is finite: a NaN
    anywhere makes it NaN, a +inf makes it +inf, and a row of nothing but -inf has -inf.
    A -inf among finite logits is legal (a token ruled out: sampling gives it no mass,
    greedy never picks it). One pass over the logits: the argmax holds each row's maximum
    (or its first NaN). CPU float32 logits go through numpy (`array`, their view, when the
    caller has it), single-threaded: torch's two-thread reductions wait on a barrier, which
    costs milliseconds when llama.cpp's threads hold the cores (0.04 ms against 0.3-1.4 ms
    over a 152k vocabulary)."""
    if array is None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        array = logits.numpy()
    if array is not None:
        if not len(array):
            return True, []
        if plain:  # (indexing row by row: fewer numpy calls than one fancy index)
            idx = array.argmax(-1).tolist()
            return all(math.isfinite(array[r, i]) for r, i in enumerate(idx)), idx
        return bool(np.isfinite(array.max(-1)).all()), []
    if not len(logits):
        return True, []
    return _usable(logits), logits.argmax(-1).tolist() if plain else []


def _usable(rows: torch.Tensor) -> bool:
    """The check of `_step_checks` for one sequence's rows."""
    return bool(torch.isfinite(rows.amax(-1)).all())


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
    hold: int = 0  # characters a stream holds back (`holdback` of its params)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs) and not any(s.pending_forks for s in self.seqs)


class Engine:
    """Drives one backend with the shared block manager, scheduler and sampler, and a
    speculative decoder when one is given."""

    def __init__(
        self,
        backend: Backend,
        tokenizer,
        config: EngineConfig | None = None,
        speculator: Speculator | None = None,
    ):
        self.config = config or EngineConfig()
        self.backend = backend
        self.tokenizer = tokenizer
        self.speculator = speculator
        self.max_model_len = backend.max_model_len
        # the backend hears of prefix-cache changes; it may give a block up through `uncache`
        # offloading: a backend with host swap space (HostSwap) can park preempted K/V
        self.num_host_blocks = getattr(backend, "num_host_blocks", 0)
        # sliding windows in every layer: blocks out of them are freed as sequences grow
        window, sinks = getattr(backend, "attention_window", (0, 0))
        self.block_manager = BlockManager(
            backend.num_blocks,
            backend.block_size,
            self.config.enable_prefix_caching,
            backend,
            self.num_host_blocks,
            window,
            sinks,
        )
        backend.bind(self.block_manager.uncache)
        self.scheduler = Scheduler(
            self.config,
            self.block_manager,
            self.max_model_len,
            speculator.lookahead if speculator is not None else None,
            self._should_swap if self.num_host_blocks else None,
        )
        self.token_seconds: float | None = None  # measured forward time per prefill token
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._view: tuple[torch.Tensor, np.ndarray] | None = None  # see _numpy_view
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
        if params.n > self.config.max_num_seqs:  # its completions must run side by side
            raise InvalidParameterError(
                f"n={params.n} is more than the {self.config.max_num_seqs} sequences that run at "
                "once (max_num_seqs)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidParameterError(f"request id {request_id!r} is already in use")
        stop = set(params.stop_token_ids) | (
            set() if params.ignore_eos else self.tokenizer.stop_ids
        )
        req = Request(
            request_id, text, ids, params, stop_ids=frozenset(stop), hold=holdback(params)
        )
        generator = make_generator(child_seed(params.seed, 0))
        seq = Sequence(request_id, list(ids), params, generator=generator)
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
        bm = self.block_manager
        if not bm.window and bm.blocks_needed(len(ids) + 1) > bm.num_blocks:
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

    def is_finished(self, request_id: str) -> bool:
        """Whether the request has all its completions (unknown ids count as finished)."""
        req = self.requests.get(request_id)
        return req is None or req.finished

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_unfinished_requests(self) -> int:
        return sum(not req.finished for req in self.requests.values())

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One scheduling round; returns the new text of every request that advanced."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self._release(seq)
        if out.swap_out:  # before anything overwrites the device blocks they leave
            self.backend.swap_out(out.swap_out)
        if out.swap_in:
            self.backend.swap_in(out.swap_in)
        if not out.scheduled:
            return []
        self.backend.copy_blocks(out.block_copies)
        proposals = self._propose(out.scheduled)
        all_decode = all(item.is_decode for item in out.scheduled)
        t1 = time.perf_counter()
        logits = self.backend.forward(out.scheduled)
        seconds = time.perf_counter() - t1
        self.stats["forward_s"] += seconds
        if not all_decode:  # only prefill-heavy steps tell what recomputing costs
            self._measure(out.scheduled, seconds)
        self.stats["steps"] += 1
        deltas = self._postprocess(out.scheduled, logits, proposals)
        if self.speculator is not None and all_decode:  # prefill chunks would blur the cost
            drafted = max((len(p.tokens) for p in proposals.values()), default=0)
            self.speculator.record_step(time.perf_counter() - t0, drafted)
        return deltas

    def _measure(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        """Forward seconds per token of prefill-heavy steps: what recomputing costs."""
        tokens = sum(item.num_tokens for item in scheduled)
        if tokens >= 4 * len(scheduled):
            per = seconds / tokens
            prev = self.token_seconds
            self.token_seconds = per if prev is None else 0.8 * prev + 0.2 * per

    def _should_swap(self, seq: Sequence) -> bool:
        """Park a preempted sequence's K/V in host memory rather than recompute them later?"""
        mode = self.config.preemption
        if mode != "auto":
            return mode == "swap"
        if self.token_seconds is None:  # nothing measured yet: recomputing is the safe default
            return False
        swap = self.backend.swap_seconds(len(live(seq.block_table)))
        return swap < seq.num_computed_tokens * self.token_seconds

    def _propose(self, scheduled: list[ScheduledSeq]) -> dict[int, Proposal]:
        """Drafts for the sequences given lookahead slots, onto `seq.spec_token_ids`; keyed by
        seq_id."""
        asks = [(item.seq, item.num_lookahead) for item in scheduled if item.num_lookahead]
        if not asks:
            return {}
        proposals = {}
        for (seq, k), p in zip(asks, self.speculator.propose(asks), strict=True):
            if len(p.tokens) < k:  # slots reserved for drafts that did not come
                self.block_manager.trim(seq, len(seq) + len(p.tokens))
            if p.tokens:
                seq.spec_token_ids = list(p.tokens)
                proposals[seq.seq_id] = p
        return proposals

    def _postprocess(
        self,
        scheduled: list[ScheduledSeq],
        logits: torch.Tensor,  # [sum of logit_rows, V]
        proposals: dict[int, Proposal],
    ) -> list[StreamDelta]:
        sizes = [item.logit_rows for item in scheduled]
        # one sequence (a single stream's every step) has every row: no views to make
        rows = (logits,) if len(sizes) == 1 else torch.split(logits, sizes)
        plain = any(item.seq.params.plain_greedy for item in scheduled)
        finite, argmax = _step_checks(logits, plain, self._numpy_view(logits))
        first_row = itertools.accumulate([0, *sizes])
        touched: dict[str, Request] = {}
        for item, r, first in zip(scheduled, rows, first_row, strict=False):
            seq = item.seq
            computed = item.start + item.num_new  # K/V now hold every real token computed
            if not item.wants_logits:  # a prompt chunk short of its end
                self.block_manager.commit(seq, computed)
                continue
            req = touched[seq.request_id] = self.requests[seq.request_id]
            if not finite and not _usable(r):
                self._fail(seq, _non_finite(seq, r))
                continue
            choice = argmax[first] if seq.params.plain_greedy and argmax else None
            try:
                self._settle(req, item, computed, r, proposals.get(seq.seq_id), choice)
            except Exception as e:  # one request's failure (a sampler error) is its own
                log.exception("request %s failed", seq.request_id)
                self._fail(seq, f"internal error while sampling ({type(e).__name__})")
        return [d for req in touched.values() for d in self._deltas(req)]

    def _numpy_view(self, logits: torch.Tensor) -> np.ndarray | None:
        """A numpy view of CPU float32 logits, kept for the tensor a backend hands back every
        step (llama.cpp's: a view of its output buffer). Right after a forward has streamed
        the weights through the caches each torch call costs 20-40 us (0.5B, 2 cores);
        asking this tensor for its device, dtype, length and numpy view took 0.13 ms."""
        if self._view is not None and self._view[0] is logits:
            return self._view[1]
        if logits.device.type != "cpu" or logits.dtype != torch.float32:
            return None
        self._view = (logits, logits.numpy())
        return self._view[1]

    def _settle(
        self,
        req: Request,
        item: ScheduledSeq,
        computed: int,
        rows: torch.Tensor,
        proposal: Proposal | None,
        choice: int | None = None,  # the row's argmax, for plain greedy sequences
    ) -> None:
        """Choose the sequence's next token(s) from its logits and move it on."""
        seq = item.seq
        if proposal is not None:
            self._settle_drafts(req, seq, computed, rows, proposal)
            return
        for s in [seq, *self._fork(req, seq)]:  # children share the prompt, not its token
            token = choice if choice is not None else self._sample(s, rows[0])
            self._advance(req, s, computed, [token], rows)
        if item.is_decode and self.speculator is not None:
            self.speculator.record(seq, 0, 0, 1)

    def _settle_drafts(
        self, req: Request, seq: Sequence, computed: int, rows: torch.Tensor, p: Proposal
    ) -> None:
        """Keep the drafted tokens the target accepts, plus its own next token."""
        n, extra = self.speculator.verify(seq, rows, p)
        before = len(seq)
        # K/V are valid up to the last accepted drafted token
        self._advance(req, seq, computed + n, [*p.tokens[:n], extra], rows)
        self.speculator.record(seq, len(p.tokens), n, len(seq) - before)

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """After the prompt is computed, n > 1 requests fork children that share its blocks."""
        children = []
        for i in range(1, parent.pending_forks + 1):
            child = Sequence(
                req.request_id,
                list(parent.token_ids),
                req.params,
                parent.num_prompt_tokens,
                index=i,
                generator=make_generator(child_seed(req.params.seed, i)),
            )
            self.block_manager.fork(parent, child)
            child.status = parent.status
            self.scheduler.running.append(child)
            self._track(req, child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _sample(self, seq: Sequence, row: torch.Tensor) -> int:
        processed = process_logits(row, seq.params, seq.prompt_ids, seq.output_ids)
        return sample_token(processed, seq.params, seq.generator)

    def _advance(
        self,
        req: Request,
        seq: Sequence,
        computed: int,
        tokens: list[int],
        rows: torch.Tensor,  # raw logits that chose `tokens`, in order
    ) -> None:
        """The one way a sequence moves on after a forward: its drafts are settled, the chosen
        tokens appended up to a stop, and the K/V of its first `computed` tokens committed."""
        drafted = len(seq.spec_token_ids)
        seq.spec_token_ids = []
        reason = None
        for k, token in enumerate(tokens):  # rows[k] only where logprobs want it
            reason = self._append(req, seq, token, rows, k)
            if reason is not None:  # tokens after a stop are discarded
                break
        self.block_manager.commit(seq, min(computed, len(seq)))
        if reason is not None:
            self._finish(seq, reason)
        elif drafted:  # rejected drafts: their slots are given back, their K/V forgotten
            self.block_manager.trim(seq, computed)
            self.backend.truncate(seq, computed)

    def _append(
        self, req: Request, seq: Sequence, token: int, rows: torch.Tensor, k: int
    ) -> str | None:
        """Append a chosen token (raw logits `rows[k]` gave it); returns why the sequence
        ends."""
        params = seq.params
        if params.logprobs is not None:
            seq.logprobs.append(top_logprobs(rows[k], token, params.logprobs))
        seq.token_ids.append(token)
        self.stats["generated_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        decoder = req.decoders[seq.seq_id]
        reason = stop_reason(seq, token, req.stop_ids, self.max_model_len)
        if reason == "stop":  # the stop token itself is not part of the text
            seq.output_text += decoder.flush()
            return reason
        seq.output_text += decoder.step(token)
        if reason is not None:
            seq.output_text += decoder.flush()
        if params.stop and truncate_at_stop(seq, params):
            return "stop"
        return reason

    def _fail(self, seq: Sequence, error: str) -> None:
        """End a sequence with finish_reason "error" and why; the others run on. This
        step's K/V are not committed (never prefix-cached) and no token is drawn."""
        seq.error = error
        seq.spec_token_ids = []
        seq.pending_forks = 0
        self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Storage kept for a sequence outside the block pool (finished or preempted)."""
        self.backend.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _deltas(self, req: Request) -> list[StreamDelta]:
        """Text gained since last time; text that may still become a stop string is held back."""
        hold = req.hold
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
                        seq.error,
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
                s.error,
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

    def _request_metrics(self, req: Request) -> RequestMetrics:
        m = RequestMetrics()
        if req.first_token_time is not None:
            m.ttft_s = req.first_token_time - req.arrival
        if req.finish_time is not None:
            m.e2e_s = req.finish_time - req.arrival
            n = sum(len(s.output_ids) for s in req.seqs)
            decode_s = req.finish_time - (req.first_token_time or req.arrival)
            m.decode_tokens_per_s = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        if self.speculator is not None:
            m.spec = self.speculator.metrics(req.seqs)
        return m

    def pop_output(self, request_id: str) -> RequestOutput:
        """The final output of a finished request, forgetting the request."""
        out = self.output(request_id)
        req = self.requests.pop(request_id)
        if self.speculator is not None:
            for seq in req.seqs:
                self.speculator.forget(seq)
        return out

    def metrics(self) -> dict:
        bm = self.block_manager
        used_slots = sum(len(s) for s in self.scheduler.running)
        alloc_slots = sum(len(live(s.block_table)) for s in self.scheduler.running) * bm.block_size
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
            "swapped": len(self.scheduler.swapped),
            "swaps": self.scheduler.num_swaps,
            **self.stats,
        }

    # ---- scoring (perplexity) ------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Log-probability of each token given the ones before it: [len - 1] float32."""
        self._check_prompt(token_ids[:-1] or token_ids)
        seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
        bm, chunk = self.block_manager, self.config.max_num_batched_tokens
        # with a window blocks come chunk by chunk (and go behind it), else all at once
        first = min(len(seq), chunk) if bm.window else len(seq)
        if bm.blocks_needed(first) > bm.num_free:
            raise ContextLengthError("the KV cache is too small (or busy) for this window")
        # every position needs logits, so cached prefix blocks are of no use here
        bm.allocate(seq, use_prefix_cache=False, num_new=first)
        out = torch.empty(len(token_ids) - 1)
        try:
            while seq.num_computed_tokens < len(seq) - 1:
                n = min(len(seq) - 1 - seq.num_computed_tokens, chunk)
                s = seq.num_computed_tokens
                if not bm.can_append(seq, 0, s + n):
                    raise ContextLengthError("the KV cache is too small (or busy) for this window")
                bm.append_slots(seq, 0, s + n)
                logits = self.backend.forward([ScheduledSeq(seq, n)], all_logits=True)
                targets = torch.tensor(token_ids[s + 1 : s + n + 1])
                out[s : s + n] = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
                self.block_manager.commit(seq, s + n)
        finally:
            self.block_manager.free(seq)
            self.backend.release(seq)
        return out


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of the `index`-th of n completions (None stays unseeded), reduced mod 2**63
    so that any 64-bit seed, signed or not, fits torch's generator."""
    return None if seed is None else (seed + index) % 2**63


def _non_finite(seq: Sequence, rows: torch.Tensor) -> str:
    """Unusable logits: a NaN row would otherwise sample token 0 or stop at once, silently."""
    if bool(rows.isnan().any()):
        kind = "NaN logits"
    elif bool(rows.isposinf().any()):
        kind = "infinite logits"
    else:
        kind = "-inf for every token"
    return (
        f"the model computed {kind} at token {len(seq)}; its weights or config "
        "produce non-finite values"
    )
