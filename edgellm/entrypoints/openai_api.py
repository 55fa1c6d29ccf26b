"""OpenAI wire format: request models (pydantic), their SamplingParams, response bodies.

Only the fields edgellm implements are declared; unknown fields are ignored, as
OpenAI-compatible servers commonly do, so that clients sending extras still work.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgellm.engine.outputs import RequestOutput
from edgellm.errors import ContextLengthError
from edgellm.sampling.params import LIMITS, MAX_STOP, MAX_STOP_CHARS, SamplingParams


def _limit(name: str, open_low: bool = False) -> Any:
    """The bounds of SamplingParams' field `name` as a pydantic constraint."""
    lo, hi = LIMITS[name]
    low = {"gt": lo} if open_low else {"ge": lo}
    return Field(**low, le=hi, **({"allow_inf_nan": False} if isinstance(lo, float) else {}))


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None
Logprobs = Annotated[int, _limit("logprobs")] | None
PositiveInt = Annotated[int, Field(ge=1)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields of both endpoints, with SamplingParams' bounds (`LIMITS`)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: Annotated[int, _limit("n")] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    max_tokens: PositiveInt = None
    temperature: Annotated[float, _limit("temperature")] = 1.0
    top_p: Annotated[float, _limit("top_p", open_low=True)] = 1.0
    seed: Annotated[int, _limit("seed")] | None = None
    presence_penalty: Annotated[float, _limit("presence_penalty")] = 0.0
    frequency_penalty: Annotated[float, _limit("frequency_penalty")] = 0.0
    # extensions (vLLM spells them the same way)
    top_k: Annotated[int, _limit("top_k")] = 0
    min_p: Annotated[float, _limit("min_p")] = 0.0
    repetition_penalty: Annotated[float, _limit("repetition_penalty", open_low=True)] = 1.0
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where or 'the body'} is not valid Unicode (a lone surrogate)")
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _lone_surrogate(data: Any) -> str | None:
    """Where in parsed JSON a string (key or value) holds a lone surrogate, which JSON's
    `\\ud800` escapes allow but UTF-8 cannot encode; None when there is none. (A loop, not
    recursion: the nesting is the client's to choose.)"""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str) and not _encodes(item):
            return path
        if isinstance(item, dict):
            if not all(_encodes(k) for k in item if isinstance(k, str)):
                return path
            pairs = item.items()
        elif isinstance(item, list):
            pairs = enumerate(item)
        else:
            continue
        todo += [
            (f"{path}.{k}" if path else str(k), v)
            for k, v in pairs
            if isinstance(v, str | dict | list)
        ]
    return None


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt = None
    logprobs: bool = False
    top_logprobs: Logprobs = None

    def text_messages(self) -> list[dict]:
        """Messages as the chat template wants them (text parts of multi-part content joined)."""
        return [{"role": _role(m.role), "content": _text(m.content)} for m in self.messages]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | Annotated[list[int], Field(min_length=1)]
    logprobs: Logprobs = None
    echo: bool = False

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """SamplingParams of a request; raises ContextLengthError when the output cannot fit."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} (prompt plus at least one generated token must fit)"
        )
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if asked is not None and asked > room:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and {asked} more were requested ({prompt_len + asked} in all)"
        )
    default = 16 if isinstance(req, CompletionRequest) else room
    return SamplingParams(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        max_tokens=asked if asked is not None else default,
        stop=req.stop or [],
        ignore_eos=req.ignore_eos,
        logprobs=req.num_logprobs,
    )


# ---- responses ---------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out: RequestOutput) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def chat_response(rid: str, model: str, out: RequestOutput, tokenizer) -> dict:
    choices = []
    for c in out.outputs:
        choice = {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "logprobs": None,
        }
        if c.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprobs(c.token_ids, c.logprobs, tokenizer)}
        choices.append(choice)
    return _body(rid, "chat.completion", model, choices) | {"usage": usage(out)}


def completion_response(
    rid: str, model: str, out: RequestOutput, tokenizer, echo: str = ""
) -> dict:
    choices = []
    for c in out.outputs:
        choice = {
            "index": c.index,
            "text": echo + c.text,
            "finish_reason": c.finish_reason,
            "logprobs": None,
        }
        if c.logprobs is not None:
            choice["logprobs"] = completion_logprobs(c.token_ids, c.logprobs, tokenizer)
        choices.append(choice)
    return _body(rid, "text_completion", model, choices) | {"usage": usage(out)}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: str | None) -> dict:
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
    return _body(rid, "chat.completion.chunk", model, [choice])


def completion_chunk(rid: str, model: str, index: int, text: str, finish: str | None) -> dict:
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    return _body(rid, "text_completion", model, [choice])


def usage_chunk(rid: str, obj: str, model: str, out: RequestOutput) -> dict:
    return _body(rid, obj, model, []) | {"usage": usage(out)}


def _body(rid: str, obj: str, model: str, choices: list) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def chat_logprobs(token_ids: list[int], logprobs: list, tokenizer) -> list[dict]:
    """`logprobs.content` of a chat choice: each token with its alternatives."""

    def entry(tid: int, lp: float) -> dict:
        text = tokenizer.decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return [
        entry(tid, lp) | {"top_logprobs": [entry(t, v) for t, v in top.items()]}
        for tid, (lp, top) in zip(token_ids, logprobs, strict=False)
    ]


def completion_logprobs(token_ids: list[int], logprobs: list, tokenizer) -> dict:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs)."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [_by_text(top, tokenizer) for _, top in logprobs],
        "text_offset": offsets,
    }


def _by_text(top: dict[int, float], tokenizer) -> dict[str, float]:
    """Alternatives keyed by their text; where two decode alike the likelier one is kept."""
    out: dict[str, float] = {}
    for t, v in sorted(top.items(), key=lambda kv: -kv[1]):
        out.setdefault(tokenizer.decode([t]), v)
    return out


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
