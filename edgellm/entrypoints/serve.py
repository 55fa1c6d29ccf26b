"""`edgellm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the AsyncEngine.

Every request goes through the engine's continuous batching; a stream that the
client leaves is cancelled by Starlette, which aborts the request and frees its
KV blocks (`AsyncEngine.stream`'s `finally`). Non-streaming requests poll for a
disconnect while they wait.

The event loop never blocks: tokenization and chat-template rendering run in worker
threads, the engine runs in its own (`AsyncEngine`), and bodies over
`max_body_mb` are refused (413) before they are parsed. Every error becomes an
OpenAI-style JSON body: 4xx for the client's fault, a bare 500 (traceback in the
server's log) for ours.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from edgellm.engine.outputs import RequestOutput
from edgellm.entrypoints import openai_api as oa
from edgellm.entrypoints.async_engine import AsyncEngine, QueueFullError
from edgellm.errors import (
    ContextLengthError,
    EdgeLLMError,
    InvalidParameterError,
    RequestFailedError,
    TokenizerError,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8000
    model_name: str = "edgellm"
    api_key: str | None = None
    max_waiting: int = 256  # sequences queued beyond max_num_seqs running; more get 429
    max_body_mb: float = 8.0  # larger request bodies get 413, unread
    # special-token text inside chat messages becomes control tokens (transformers' and
    # vLLM's way, which lets a user forge a system turn); off: only the template's markup does
    parse_special_tokens: bool = False


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


# ---- the app -----------------------------------------------------------------------------------
def build_app(aeng: AsyncEngine, config: ServerConfig | str) -> FastAPI:
    """The FastAPI app serving `aeng` as `config` says (a str: the model id, else defaults)."""
    if isinstance(config, str):
        config = ServerConfig(model_name=config)
    app = FastAPI(title="edgellm", docs_url=None, redoc_url=None)
    state = _State(aeng, config)
    auth = [Depends(_auth_dependency(config.api_key))]
    _add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=int(config.max_body_mb * 2**20))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return prometheus_text(aeng.metrics(), state.rate)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = {"id": config.model_name, "object": "model", "created": state.created}
        return {"object": "list", "data": [card | {"owned_by": "edgellm"}]}

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: oa.ChatCompletionRequest, request: Request):
        return await state.chat(body, request)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: oa.CompletionRequest, request: Request):
        return await state.complete(body, request)

    return app


class _State:
    """The handlers' shared state: the engine, the config, the token-rate meter."""

    def __init__(self, aeng: AsyncEngine, config: ServerConfig):
        self.aeng, self.config, self.model_name = aeng, config, config.model_name
        self.created = int(time.time())
        self.rate = TokenRate()
        self.max_model_len = aeng.engine.max_model_len
        if not config.parse_special_tokens:  # build the plain-text encoder now, not in a request
            aeng.tokenizer.encode("", parse_special=False)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist (this server has {self.model_name!r})",
                "invalid_request_error",
                "model_not_found",
            )

    async def chat(self, body: oa.ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        tok = self.aeng.tokenizer
        parse = self.config.parse_special_tokens
        ids = await asyncio.to_thread(tok.encode_chat, body.text_messages(), True, parse)
        params = oa.sampling_params(body, len(ids), self.max_model_len)
        rid = await self.aeng.add(ids, params, oa.new_id("chatcmpl"))
        if body.stream:
            return _sse(self._chat_events(rid, body))
        out = await _collect(self.aeng, rid, request)
        return oa.chat_response(rid, self.model_name, out, tok)

    async def complete(self, body: oa.CompletionRequest, request: Request):
        self._check_model(body.model)
        tok = self.aeng.tokenizer
        prompt = body.prompt
        ids = await asyncio.to_thread(tok.encode, prompt) if isinstance(prompt, str) else prompt
        params = oa.sampling_params(body, len(ids), self.max_model_len)
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(tok.decode, ids)
        rid = await self.aeng.add(ids, params, oa.new_id("cmpl"))
        if body.stream:
            return _sse(self._completion_events(rid, body, echo))
        out = await _collect(self.aeng, rid, request)
        return oa.completion_response(rid, self.model_name, out, tok, echo)

    async def _chat_events(self, rid: str, body: oa.ChatCompletionRequest) -> AsyncIterator[dict]:
        name = self.model_name
        for i in range(body.n):
            yield oa.chat_chunk(rid, name, i, {"role": "assistant", "content": ""}, None)
        async for item in self.aeng.stream(rid):
            if isinstance(item, RequestOutput):
                if body.include_usage:
                    yield oa.usage_chunk(rid, "chat.completion.chunk", name, item)
            elif item.text or item.finish_reason:
                delta = {"content": item.text} if item.text else {}
                yield oa.chat_chunk(rid, name, item.index, delta, item.finish_reason)

    async def _completion_events(
        self, rid: str, body: oa.CompletionRequest, echo: str
    ) -> AsyncIterator[dict]:
        name = self.model_name
        if echo:
            for i in range(body.n):
                yield oa.completion_chunk(rid, name, i, echo, None)
        async for item in self.aeng.stream(rid):
            if isinstance(item, RequestOutput):
                if body.include_usage:
                    yield oa.usage_chunk(rid, "text_completion", name, item)
            elif item.text or item.finish_reason:
                yield oa.completion_chunk(rid, name, item.index, item.text, item.finish_reason)


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except Exception as e:  # headers are sent: report the failure in the stream
            status, message, kind, code = classify(e)
            if status >= 500:
                log.error("a streamed request failed", exc_info=e)
            yield f"data: {json.dumps(oa.error_body(message, kind, code))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _collect(aeng: AsyncEngine, rid: str, request: Request) -> RequestOutput:
    """The final output of a non-streaming request; a client that leaves aborts it."""

    async def last():
        async for item in aeng.stream(rid):
            if isinstance(item, RequestOutput):
                return item
        raise RuntimeError(f"request {rid} ended without an output")

    task = asyncio.create_task(last())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            aeng.abort(rid)
            raise APIError(499, "the client closed the connection", "invalid_request_error")


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before anything parses it
    (at once when Content-Length says so, else as soon as the streamed bytes pass it)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, size, more = [], 0, True
        while more:  # read it all first (FastAPI would anyway), counting
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            body.append(message.get("body", b""))
            size, more = size + len(body[-1]), message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
        whole = {"type": "http.request", "body": b"".join(body), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"the request body is larger than {self.max_bytes} bytes"
        body = oa.error_body(message, "invalid_request_error", "request_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()

    return replayed


# ---- auth and errors ---------------------------------------------------------------------------
def _auth_dependency(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        # constant time: the comparison must not tell how much of a guess was right
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(
                401, "invalid or missing API key", "authentication_error", "invalid_api_key"
            )

    return check


_STATUS = [  # most specific first: QueueFullError is also an InvalidParameterError
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (ContextLengthError, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidParameterError, 400, "invalid_request_error", "invalid_parameter"),
    (TokenizerError, 400, "invalid_request_error", "invalid_messages"),  # the chat template's
    (RequestFailedError, 500, "server_error", "request_failed"),  # our own words, no internals
]


def classify(e: Exception) -> tuple[int, str, str, str | None]:
    """(status, message, type, code) of an error in a request: 4xx with its message when the
    client caused it (one of ours that is a ValueError, or listed), else a bare 500."""
    if isinstance(e, APIError):
        return e.status, str(e), e.kind, e.code
    for cls, status, kind, code in _STATUS:
        if isinstance(e, cls):
            return status, str(e), kind, code
    if isinstance(e, EdgeLLMError) and isinstance(e, ValueError):
        return 400, str(e), "invalid_request_error", None
    return 500, "internal server error", "server_error", None


def _add_error_handlers(app: FastAPI) -> None:
    def reply(status: int, message: str, kind: str, code: str | None) -> JSONResponse:
        return JSONResponse(oa.error_body(message, kind, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        return reply(400, _validation_message(e), "invalid_request_error", "invalid_request")

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return reply(e.status_code, str(e.detail), "invalid_request_error", None)

    async def ours(_, e: Exception):
        status, message, kind, code = classify(e)
        if status >= 500:
            log.error("a request failed", exc_info=e)
        return reply(status, message, kind, code)

    async def unexpected(_, e: Exception):  # Starlette re-raises it: uvicorn logs the traceback
        return reply(*classify(e))

    app.add_exception_handler(APIError, ours)
    app.add_exception_handler(EdgeLLMError, ours)
    app.add_exception_handler(Exception, unexpected)


def _validation_message(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


# ---- metrics -----------------------------------------------------------------------------------
class TokenRate:
    """Generated tokens per second between two scrapes (at least `min_window_s` apart)."""

    def __init__(self, min_window_s: float = 1.0):
        self.min_window_s = min_window_s
        self.last: tuple[float, int] | None = None
        self.value = 0.0

    def update(self, total_tokens: int) -> float:
        now = time.perf_counter()
        if self.last is None:
            self.last = (now, total_tokens)
        elif now - self.last[0] >= self.min_window_s:
            self.value = (total_tokens - self.last[1]) / (now - self.last[0])
            self.last = (now, total_tokens)
        return self.value


_GAUGES = [  # (metric name, key of Engine.metrics(), help)
    ("edgellm_requests_running", "running", "Requests being decoded or prefilled."),
    ("edgellm_requests_waiting", "waiting", "Requests queued for admission."),
    ("edgellm_kv_blocks_used", "blocks_used", "KV-cache blocks in use."),
    ("edgellm_kv_blocks_total", "blocks_total", "KV-cache blocks in all."),
    ("edgellm_prefix_cache_hit_rate", "prefix_cache_hit_rate", "Prompt blocks found cached."),
    ("edgellm_preemptions_total", "preemptions", "Sequences preempted for lack of blocks."),
    ("edgellm_prompt_tokens_total", "prompt_tokens", "Prompt tokens processed."),
    ("edgellm_generation_tokens_total", "generated_tokens", "Tokens generated."),
]


def prometheus_text(m: dict, rate: TokenRate) -> str:
    """Engine metrics in the Prometheus text exposition format."""
    lines = []
    values = [(name, m.get(key, 0), text) for name, key, text in _GAUGES]
    tps = rate.update(int(m.get("generated_tokens", 0)))
    values.append(("edgellm_generation_tokens_per_second", tps, "Recent generation throughput."))
    for name, value, text in values:
        kind = "counter" if name.endswith("_total") and "blocks" not in name else "gauge"
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
    return "\n".join(lines) + "\n"


# ---- running it --------------------------------------------------------------------------------
def run_server(llm, config: ServerConfig) -> None:
    """Serve `llm` until interrupted (blocking)."""

    aeng = AsyncEngine(llm.engine, max_waiting=config.max_waiting)
    app = build_app(aeng, config)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="info")
    finally:
        aeng.shutdown()


class ServerThread:
    """uvicorn serving `app` from a background thread on a free port (tests, benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
