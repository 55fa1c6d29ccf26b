"""An asyncio front for the engine: one thread owns the engine, coroutines send it messages.

The engine is single-threaded, and only the stepping thread ever touches it.
Coroutines put commands (add, abort) into a thread-safe inbox that the thread
drains before each step; results travel back to the event loop through
per-request asyncio queues (`loop.call_soon_threadsafe`). So the event loop never
waits for a step: `add` awaits a future the thread settles, and `metrics()` reads
the snapshot the thread publishes after each step.

A failure inside one request fails that request alone: an error while adding it
goes to its `add`; a sequence the engine ends with finish_reason "error" (its
logits were not finite, its sampling raised) ends its request's stream with a
`RequestFailedError`, and the engine keeps serving the others. Only an error a
step raises outside any sequence (scheduling the batch, the forward pass) fails
every request in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from edgellm.engine.engine import Engine
from edgellm.engine.outputs import RequestOutput, StreamDelta
from edgellm.errors import InvalidParameterError, RequestFailedError
from edgellm.sampling.params import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(InvalidParameterError):
    """Too many sequences are in flight (a server answers 429)."""


@dataclass(slots=True)
class _Stream:
    """The event-loop end of one request, as the stepping thread sees it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    n: int  # sequences the request runs
    sent: dict[int, int] = field(default_factory=dict)  # completion index -> characters sent
    ended: set[int] = field(default_factory=set)  # completions whose finish was sent

    def put(self, item: StreamDelta | RequestOutput | BaseException) -> None:
        if isinstance(item, StreamDelta):
            self.sent[item.index] = self.sent.get(item.index, 0) + len(item.text)
            if item.finish_reason is not None:
                self.ended.add(item.index)
        _call(self.loop, self.queue.put_nowait, item)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: _Stream
    accepted: asyncio.Future  # settled by the stepping thread: None, or the error


class AsyncEngine:
    """`async for delta in engine.generate(prompt, params)`; abort on cancel or disconnect.

    With `max_waiting`, a request is refused (QueueFullError) when its n sequences would
    bring those in flight beyond max_num_seqs running plus max_waiting queued."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[_Add | str] = queue.SimpleQueue()  # str: abort that id
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # the stepping thread's own
        self._queues: dict[str, asyncio.Queue] = {}  # the event loop's own
        self._snapshot = engine.metrics()
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="edgellm-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def add(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Register a request (raises on bad input) and return its id; stream with `stream`."""
        request_id = request_id or f"areq-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), params.n)
        accepted = loop.create_future()
        self._send(_Add(request_id, prompt, params, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the caller left while the request was being added
            self._send(request_id)
            raise
        self._queues[request_id] = stream.queue
        return request_id

    async def stream(self, request_id: str) -> AsyncIterator[StreamDelta | RequestOutput]:
        """Deltas of a request as they come, then its final `RequestOutput` (usage, finish
        reasons, metrics). Leaving early (cancel, client gone) aborts the request."""
        queue_ = self._queues[request_id]
        try:
            while True:
                item = await queue_.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, RequestOutput):
                    return
        finally:
            self.abort(request_id)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[StreamDelta | RequestOutput]:
        rid = await self.add(prompt, params, request_id)
        async for item in self.stream(rid):
            yield item

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; finished requests are just forgotten."""
        self._queues.pop(request_id, None)
        self._send(request_id)

    def metrics(self) -> dict:
        """`Engine.metrics()` as of the end of the last step (never waits for one)."""
        return self._snapshot

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _send(self, message: _Add | str) -> None:
        self._inbox.put(message)
        self._wake.set()

    # ---- the stepping thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()  # before draining: a message sent after this wakes the wait
            try:
                self._drain()
                if self.engine.has_unfinished():
                    self._step()
            except Exception as e:  # a bug of ours: fail what is in flight, keep serving
                self._recover(e)
            self._snapshot = self.engine.metrics()
            if not self.engine.has_unfinished():
                self._wake.wait()

    def _drain(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Add):
                self._admit(message)
            else:
                self._abort(message)

    def _admit(self, add: _Add) -> None:
        try:
            self._check_room(add.params.n)
            self.engine.add_request(add.prompt, add.params, add.request_id)
        except Exception as e:
            _call(add.stream.loop, _settle, add.accepted, e)
            return
        self._streams[add.request_id] = add.stream
        _call(add.stream.loop, _settle, add.accepted, None)

    def _check_room(self, n: int) -> None:
        if self.max_waiting is None:
            return
        in_flight = sum(s.n for s in self._streams.values())
        room = self.engine.config.max_num_seqs + self.max_waiting - in_flight
        if n > room:
            raise QueueFullError(
                f"{in_flight} sequences are in flight; the server takes "
                f"{self.engine.config.max_num_seqs} running plus {self.max_waiting} waiting"
            )

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _step(self) -> None:
        deltas = self.engine.step()
        self._snapshot = self.engine.metrics()  # before the outputs: a caller sees it current
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is not None:
                stream.put(d)
        for rid in {d.request_id: None for d in deltas}:  # after all of this step's deltas
            if self.engine.is_finished(rid):
                self._finish(rid)

    def _finish(self, request_id: str) -> None:
        """Hand a finished request's output to its stream (with any text the stream missed)."""
        out = self.engine.pop_output(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
        if failed is not None:
            stream.put(RequestFailedError(failed.error))
            return
        for c in out.outputs:
            tail = c.text[stream.sent.get(c.index, 0) :]
            if tail or c.index not in stream.ended:
                stream.put(StreamDelta(request_id, c.index, tail, c.token_ids, c.finish_reason))
        stream.put(out)

    def _recover(self, error: Exception) -> None:
        """A step raised outside any one sequence (the engine ends those itself): fail every
        request in flight, keep serving new ones."""
        culprits = set(self.engine.requests)
        log.error("engine step failed for %s", sorted(culprits), exc_info=error)
        for rid in culprits:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)
            _logged(self.engine.abort, rid)


def _logged(fn, request_id: str) -> None:
    try:
        fn(request_id)
    except Exception:
        log.exception("cleaning up request %s failed", request_id)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # cancelled: the caller left
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """`fn(*args)` on `loop`'s thread; a closed loop (its caller is gone) is ignored."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
