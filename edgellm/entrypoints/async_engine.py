"""An asyncio front for the engine: a background thread steps it, coroutines stream.

The engine itself is single-threaded; every call into it happens on the stepping
thread or under `self._lock`, and results travel to the event loop through
per-request asyncio queues (`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator

from edgellm.engine.engine import Engine
from edgellm.engine.outputs import RequestOutput, StreamDelta
from edgellm.errors import InvalidParameterError
from edgellm.sampling.params import SamplingParams


class AsyncEngine:
    """`async for delta in engine.generate(prompt, params)`; abort on cancel or disconnect."""

    def __init__(self, engine: Engine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="edgellm-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def queue_full(self) -> bool:
        return self.max_waiting is not None and self.engine.num_waiting >= self.max_waiting

    def add(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Register a request (raises on bad input) and return its id; stream with `stream`."""
        request_id = request_id or f"areq-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.queue_full():
                raise QueueFullError(f"{self.engine.num_waiting} requests are already waiting")
            self._queues[request_id] = (loop, asyncio.Queue())
            try:
                self.engine.add_request(prompt, params, request_id)
            except Exception:
                del self._queues[request_id]
                raise
        self._wake.set()
        return request_id

    async def stream(self, request_id: str) -> AsyncIterator[StreamDelta | RequestOutput]:
        """Deltas of a request as they come, then its final `RequestOutput` (usage, finish
        reasons, metrics). Leaving early (cancel, client gone) aborts the request."""
        _, queue = self._queues[request_id]
        try:
            while True:
                item = await queue.get()
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
        rid = self.add(prompt, params, request_id)
        async for item in self.stream(rid):
            yield item

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; finished requests are just forgotten."""
        with self._lock:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)

    def metrics(self) -> dict:
        with self._lock:
            return self.engine.metrics()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the stepping thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait(timeout=0.5)
            with self._lock:
                busy = self.engine.has_unfinished()
                if not busy:
                    self._wake.clear()
                    continue
                try:
                    deltas = self.engine.step()
                except Exception as e:  # a failed step fails the requests in it, not the server
                    self._fail_all(e)
                    continue
                self._dispatch(deltas)

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        finished = []
        for d in deltas:
            target = self._queues.get(d.request_id)
            if target is None:
                continue
            target[0].call_soon_threadsafe(target[1].put_nowait, d)
            if self.engine.is_finished(d.request_id) and d.request_id not in finished:
                finished.append(d.request_id)
        for rid in finished:  # after all of the request's deltas of this step
            loop, queue = self._queues[rid]
            loop.call_soon_threadsafe(queue.put_nowait, self.engine.pop_output(rid))

    def _fail_all(self, error: Exception) -> None:
        for rid, (loop, queue) in list(self._queues.items()):
            loop.call_soon_threadsafe(queue.put_nowait, error)
            self.engine.abort(rid)


class QueueFullError(InvalidParameterError):
    """Too many requests are waiting (a server answers 429)."""
