"""`edgellm serve` through the official openai client and raw HTTP, on a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from edgellm.entrypoints.async_engine import AsyncEngine, QueueFullError
from edgellm.entrypoints.serve import ServerConfig, ServerThread, build_app, classify
from edgellm.errors import ContextLengthError, InvalidParameterError
from edgellm.sampling.params import SamplingParams
from tests.conftest import run_all, tiny_engine

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    aeng = AsyncEngine(tiny_engine(kv_cache_mb=4.0, block_size=4))
    with ServerThread(build_app(aeng, ServerConfig(model_name=MODEL))) as srv:
        srv.aeng = aeng
        yield srv
    aeng.shutdown()


@pytest.fixture(scope="module")
def reference():
    """The same tiny model in a plain synchronous engine: the oracle for greedy content."""
    eng = tiny_engine()

    def complete(prompt: str | list[int], max_tokens: int, **kw):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
        return run_all(eng, [prompt], params)[0]

    def chat(messages: list[dict], max_tokens: int):
        text = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return complete(eng.tokenizer.encode(text, add_special_tokens=False), max_tokens)

    complete.chat = chat
    return complete


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def wait_idle(aeng: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = aeng.metrics()
        if (m["running"] == 0 and m["waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


# ---- content equals the engine's ---------------------------------------------------------------
def test_models_and_health(server):
    assert [m.id for m in client(server).models.list()] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_text_completion_non_streaming(server, reference):
    ref = reference("The quick brown fox", 12)
    r = client(server).completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0
    )
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (19, 12)
    assert r.usage.total_tokens == 31


def test_text_completion_streaming_with_usage(server, reference):
    ref = reference("Once upon a time", 15)
    chunks = list(
        client(server).completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=15,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15


def test_chat_completion_non_streaming_and_streaming(server, reference):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    ref = reference.chat(messages, 10)
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 10
    stream = c.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_n_seed_and_logprobs(server, reference):
    ref = reference("abc", 20)
    stop = ref.outputs[0].text[5:7]  # a string the greedy answer is known to contain
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.outputs[0].text[: ref.outputs[0].text.find(stop)]
    kw = dict(model=MODEL, prompt="abc", max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=3)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seeded
    assert a.usage.completion_tokens == 24
    lp = c.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, logprobs=3)
    want = reference("abc", 4, logprobs=3).outputs[0].logprobs
    assert lp.choices[0].logprobs.token_logprobs == pytest.approx([x for x, _ in want], abs=1e-4)
    # keyed by token text, so tokens decoding to the same text (bytes of one character) merge
    for top, (_, alts) in zip(lp.choices[0].logprobs.top_logprobs, want, strict=True):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(max(alts.values()), abs=1e-4)
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob >= t.top_logprobs[0].logprob - 1e-5 or t.logprob <= 0 for t in content)


# ---- errors ------------------------------------------------------------------------------------
def post(srv, path: str, body, **kw) -> httpx.Response:
    if not isinstance(body, dict):  # raw bytes, or an iterator of them (sent chunked)
        return httpx.post(
            srv.url + path, content=body, headers={"content-type": "application/json"}, **kw
        )
    return httpx.post(srv.url + path, json=body, **kw)


@pytest.mark.parametrize(
    "path, body, status, needle",
    [
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "JSON"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n:"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 600}, 400, "context"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 9999}, 400, "context"),
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, needle):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert err["type"] == "invalid_request_error"


def test_context_overflow_through_the_client(server):
    with pytest.raises(openai.BadRequestError, match="context"):
        client(server).completions.create(model=MODEL, prompt="y" * 700, max_tokens=4)


def test_api_key():
    aeng = AsyncEngine(tiny_engine())
    try:
        with ServerThread(build_app(aeng, ServerConfig(model_name=MODEL, api_key="s3cret"))) as srv:
            body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
            assert post(srv, "/v1/completions", body).status_code == 401
            bad = {"authorization": "Bearer nope"}
            assert post(srv, "/v1/completions", body, headers=bad).status_code == 401
            good = {"authorization": "Bearer s3cret"}
            assert post(srv, "/v1/completions", body, headers=good).status_code == 200
            assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        aeng.shutdown()


def test_full_queue_is_429():
    """One running slot and room for two waiting: of 8 simultaneous long requests, the
    ones that find the queue full get 429, the others complete."""
    aeng = AsyncEngine(tiny_engine(max_num_seqs=1), max_waiting=2)
    body = {"model": MODEL, "prompt": "a", "max_tokens": 500, "ignore_eos": True}

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(
                *(http.post("/v1/completions", json=body) for _ in range(8))
            )

    try:
        with ServerThread(build_app(aeng, ServerConfig(model_name=MODEL))) as srv:
            replies = asyncio.run(main(srv.url))
            m = wait_idle(aeng)
    finally:
        aeng.shutdown()
    codes = sorted(r.status_code for r in replies)
    assert 429 in codes and 200 in codes and set(codes) == {200, 429}, codes
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert m["blocks_used"] == 0


# ---- hostile input ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", 1e9),
        ("temperature", 2.5),
        ("top_k", 2**63),
        ("top_k", -2),
        ("top_p", 1.5),
        ("min_p", 1.5),
        ("n", 129),
        ("n", 65),  # more than the engine's max_num_seqs (64)
        ("max_tokens", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.5),
        ("logprobs", 21),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", "x" * 300),
    ],
)
def test_out_of_range_fields_are_400(server, field, value):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field.split("_")[0] in err["message"] and err["type"] == "invalid_request_error"


CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": %s}]}'


@pytest.mark.parametrize(
    "path, raw, needle",
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', "temp"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temp"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": -Infinity}', "top_p"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', "stop.0"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": "\\udfff"}', "stop"),
        ("/v1/chat/completions", CHAT % b'"hi \\ud800"', "messages.0.content"),
        ("/v1/chat/completions", CHAT % b'[{"type": "text", "text": "\\udc00"}]', "messages.0"),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "\\ud800": 1}', "Unicode"),
    ],
)
def test_non_finite_numbers_and_lone_surrogates_are_400(server, path, raw, needle):
    r = post(server, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_extreme_seeds_with_n_work_beside_a_stream(server, reference):
    """n > 1 with the largest and smallest 64-bit seeds (the first overflowed the children's
    seeds and failed every stream in the step); a concurrent stream completes correctly."""
    ref = reference("Once upon a time", 40)
    stream = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    msgs = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 6, "n": 2, "temperature": 1.0}

    async def streamed(http: httpx.AsyncClient) -> str:
        text = ""
        async with http.stream("POST", "/v1/completions", json=stream | {"stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            seeded = [chat | {"seed": s} for s in (2**64 - 1, 2**64 - 1, -(2**63))]
            return await asyncio.gather(
                streamed(http), *(http.post("/v1/chat/completions", json=b) for b in seeded)
            )

    text, *replies = asyncio.run(main(server.url))
    assert text == ref.outputs[0].text
    assert [r.status_code for r in replies] == [200, 200, 200], replies[0].text
    texts = [[c["message"]["content"] for c in r.json()["choices"]] for r in replies]
    assert texts[0] == texts[1] and len(texts[0]) == 2  # seeded: reproducible


def test_large_bodies_are_413_before_parsing(server):
    aeng = server.aeng  # a second app on the same engine, with a 64 KiB limit
    with ServerThread(build_app(aeng, ServerConfig(model_name=MODEL, max_body_mb=1 / 16))) as srv:
        big = json.dumps({"model": MODEL, "prompt": "x" * 70_000}).encode()
        r = post(srv, "/v1/completions", big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunks = (big[i : i + 8192] for i in range(0, len(big), 8192))  # no Content-Length
        r = post(srv, "/v1/completions", chunks)
        assert r.status_code == 413
        small = {"model": MODEL, "prompt": "x" * 60_000}  # under the limit, over the context
        r = post(srv, "/v1/completions", small)
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert post(srv, "/v1/completions", ok).status_code == 200


def test_errors_are_4xx_for_the_client_and_bare_500_otherwise():
    assert classify(InvalidParameterError("top_k is bad")) == (
        400,
        "top_k is bad",
        "invalid_request_error",
        "invalid_parameter",
    )
    assert classify(QueueFullError("full"))[0] == 429
    assert classify(ContextLengthError("too long"))[:2] == (400, "too long")
    secret = RuntimeError("CUDA error at /home/build/kernels.cu:42")
    assert classify(secret) == (500, "internal server error", "server_error", None)
    assert classify(ValueError("numpy said no"))[0] == 500  # not one of ours: not the client's


# ---- disconnects and load ----------------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 450, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert server.aeng.metrics()["blocks_used"] > 0
    assert any(line.startswith("data: ") for line in got)
    m = wait_idle(server.aeng)
    assert (m["running"], m["waiting"], m["blocks_used"]) == (0, 0, 0)


def test_client_disconnect_non_streaming_frees_blocks(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 450, "ignore_eos": True}
    # 450 engine steps take well over 50 ms (the fused tiny model did them in under 0.5 s)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.05)
    m = wait_idle(server.aeng)
    assert (m["running"], m["waiting"], m["blocks_used"]) == (0, 0, 0)


def test_64_concurrent_streams_complete_correctly(server, reference):
    prompts = [f"request {i}: " + "xyz"[: i % 3 + 1] * (i % 7) for i in range(64)]
    lengths = [4 + i % 13 for i in range(64)]
    refs = [reference(p, n).outputs[0].text for p, n in zip(prompts, lengths, strict=True)]
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def one(prompt: str, n: int) -> tuple[str, str, int]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, used = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, finish, used

    async def main():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))

    results = asyncio.run(main())
    assert [r[0] for r in results] == refs
    assert all(r[1] == "length" for r in results)
    assert [r[2] for r in results] == lengths
    m = wait_idle(server.aeng)
    assert m["blocks_used"] == 0


def test_metrics_are_prometheus_text(server):
    client(server).completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["edgellm_requests_running"] == 0
    assert values["edgellm_kv_blocks_used"] == 0
    assert values["edgellm_generation_tokens_total"] >= 3
    assert 0 <= values["edgellm_prefix_cache_hit_rate"] <= 1
    for name in ("edgellm_requests_waiting", "edgellm_generation_tokens_per_second"):
        assert f"# TYPE {name} gauge" in text


# ---- the real model ----------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_chat_equals_llm_chat():
    from edgellm.entrypoints.llm import LLM

    llm = LLM("smollm2-135m", backend="torch", kv_cache_mb=64)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0]
    aeng = AsyncEngine(llm.engine)
    try:
        with ServerThread(build_app(aeng, ServerConfig(model_name="smollm2-135m"))) as srv:
            r = client(srv).chat.completions.create(
                model="smollm2-135m", messages=messages, max_tokens=24, temperature=0
            )
    finally:
        aeng.shutdown()
    assert r.choices[0].message.content == want.outputs[0].text
    assert "Paris" in r.choices[0].message.content
    assert json.loads(r.model_dump_json())["usage"]["completion_tokens"] == len(
        want.outputs[0].token_ids
    )


@pytest.mark.slow
def test_serve_command_binds_loopback_and_requires_key(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = str(Path(sys.executable).with_name("edgellm"))
    env = os.environ | {"EDGELLM_API_KEY": "k1"}
    proc = subprocess.Popen(
        [exe, "serve", "--port", str(port), "--kv-cache-mb", "32"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        assert [m.id for m in c.models.list()] == ["smollm2-135m"]
        r = c.completions.create(model="smollm2-135m", prompt="1, 2, 3,", max_tokens=4)
        assert r.usage.completion_tokens == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_model_computing_nan_fails_that_request_with_a_500_only():
    """Non-finite logits (here: byte 7's embedding is NaN) end that request with a 500 and
    our own message, streamed or not; a request that never meets the NaN is served."""
    import torch

    engine = tiny_engine(kv_cache_mb=4.0, block_size=4)
    with torch.no_grad():
        engine.backend.model.model.embed_tokens.weight[7] = float("nan")
    aeng = AsyncEngine(engine)
    try:
        with ServerThread(build_app(aeng, ServerConfig(model_name=MODEL))) as srv:
            bad = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4}
            r = post(srv, "/v1/completions", bad)
            assert r.status_code == 500
            assert r.json()["error"]["code"] == "request_failed"
            assert "NaN logits" in r.json()["error"]["message"]
            with httpx.stream(
                "POST", srv.url + "/v1/completions", json={**bad, "stream": True}
            ) as s:
                events = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert any("NaN logits" in e for e in events)
            good = post(srv, "/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 3})
            assert good.status_code == 200 and good.json()["choices"][0]["text"] is not None
            assert wait_idle(aeng)["blocks_used"] == 0
    finally:
        aeng.shutdown()
