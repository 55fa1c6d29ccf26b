"""Soak test of `edgellm serve`: Poisson load for minutes, with clients that disconnect,
bad requests, n > 1 and speculative decoding; afterwards nothing may be left in use.

Opt-in (not part of `make test`): it runs for `--minutes` (10 by default) against a real
server subprocess on the default model.

Traffic (Poisson arrivals at `--rate` requests/s), each request drawn at random:

    greedy      chat, temperature 0, streamed or not: the answer must equal the one the
                idle server gave to the same prompt before the load (exact: one numeric path)
    sampled     chat, temperature 0.8, n = 1 or 2, streamed or not: must complete
    disconnect  a stream the client drops after its first chunks (the engine must abort it)
    bad         a request the server must refuse with a 4xx and an OpenAI-style error body:
                temperature 5, seed 2**64, n above max_num_seqs, a lone surrogate, malformed
                JSON, a body over the size limit, a prompt over the context, an unknown model

At the end (load stopped, streams drained) the script reads /metrics and the server's RSS:
KV blocks in use must be 0, the running and waiting counts 0, and RSS growth (after the
warm-up) under `--rss-bound-mb`. Exit status 1 when any check fails.

    python bench/soak_serve.py                                 # 10 min, torch, ngram speculation
    python bench/soak_serve.py --minutes 2 --backend llamacpp  # the llama.cpp backend
Results: bench/results/soak-<backend>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Give me a short tip for learning to code.",
    "Who wrote Romeo and Juliet?",
]
KINDS = {"greedy": 0.35, "sampled": 0.3, "disconnect": 0.15, "bad": 0.2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(edgellm_\w+) ([-+0-9.eE]+|nan|inf)", line.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def chat_body(q: str, **kw) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": q}], **kw}


def bad_request(rng: random.Random, max_num_seqs: int, body_mb: float) -> tuple[str, dict]:
    """(kind, httpx.post kwargs) of a request the server must refuse with a 4xx."""
    q = rng.choice(QUESTIONS)
    cases = {
        "temperature": {"json": chat_body(q, temperature=5)},
        "seed": {"json": chat_body(q, seed=2**64)},
        "n": {"json": chat_body(q, n=max_num_seqs + 1)},
        "surrogate": {
            "content": b'{"model": "default", "messages": [{"role": "user", "content": "a\\ud800"}]}',
            "headers": {"content-type": "application/json"},
        },
        "malformed": {"content": b'{"model": ', "headers": {"content-type": "application/json"}},
        "body_size": {
            "content": b'{"prompt": "' + b"a" * int(body_mb * 2**20 + 1024) + b'"}',
            "headers": {"content-type": "application/json"},
        },
        "context": {"json": {"model": "default", "prompt": [31] * 100_000, "max_tokens": 1}},
        "model": {"json": {**chat_body(q), "model": "no-such-model"}},
    }
    kind = rng.choice(list(cases))
    return kind, cases[kind]


class Soak:
    def __init__(self, args, url: str, references: dict[str, str]):
        self.args, self.url, self.refs = args, url, references
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.latencies: list[float] = []

    def fail(self, what: str) -> None:
        self.counts["failed"] += 1
        if len(self.failures) < 20:
            self.failures.append(what)

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        q = rng.choice(QUESTIONS)
        stream = rng.random() < 0.5
        t0 = time.perf_counter()
        try:
            if kind == "bad":
                sub, kw = bad_request(rng, self.args.max_num_seqs, self.args.max_body_mb)
                path = (
                    "/v1/completions" if sub in ("body_size", "context") else "/v1/chat/completions"
                )
                r = await client.post(path, **kw)
                body = r.json()
                ok = 400 <= r.status_code < 500 and "message" in body.get("error", {})
                self.counts[f"bad:{sub}:{'refused' if ok else r.status_code}"] += 1
                if not ok:
                    self.fail(f"bad {sub}: {r.status_code} {r.text[:200]}")
                return
            if kind == "disconnect":
                async with client.stream(
                    "POST", "/v1/chat/completions", json=chat_body(q, stream=True, max_tokens=64)
                ) as r:
                    n = 0
                    async for _ in r.aiter_lines():
                        n += 1
                        if n >= rng.randint(1, 6):
                            break
                self.counts["disconnect"] += 1
                return
            params = {"max_tokens": self.args.max_tokens}
            if kind == "greedy":
                params["temperature"] = 0
            else:
                params.update(temperature=0.8, n=rng.choice([1, 2]), seed=rng.randrange(2**63))
            texts = await self.complete(client, chat_body(q, **params), stream)
            if texts is None:
                return
            if kind == "greedy" and texts[0] != self.refs[q]:
                self.fail(f"greedy answer to {q!r} differs: {texts[0]!r} vs {self.refs[q]!r}")
            elif len(texts) != params.get("n", 1) or not all(texts):
                self.fail(f"{kind}: {len(texts)} answers, expected {params.get('n', 1)}")
            else:
                self.counts[f"{kind}:{'stream' if stream else 'plain'}:ok"] += 1
                self.latencies.append(time.perf_counter() - t0)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            self.fail(f"{kind}: {type(e).__name__}: {e}")

    def refused(self, r: httpx.Response, text: str) -> bool:
        """Whether a good request got no answer: a full queue (counted) or a failure."""
        if r.status_code == 429:
            self.counts["queue_full"] += 1
        elif r.status_code != 200:
            self.fail(f"{r.status_code}: {text[:200]}")
        return r.status_code != 200

    async def complete(self, client, body: dict, stream: bool) -> list[str] | None:
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            if self.refused(r, r.text):
                return None
            return [
                c["message"]["content"]
                for c in sorted(r.json()["choices"], key=lambda c: c["index"])
            ]
        parts: dict[int, list[str]] = {}
        async with client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as r:
            if r.status_code != 200 and self.refused(r, (await r.aread()).decode()):
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.fail(f"stream error event: {event['error']}")
                    return None
                for c in event["choices"]:
                    parts.setdefault(c["index"], []).append(c["delta"].get("content") or "")
        return ["".join(parts[i]) for i in sorted(parts)]

    async def run(self) -> None:
        rng = random.Random(self.args.seed)
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:
            tasks = set()
            end = time.monotonic() + self.args.minutes * 60
            from rich.progress import Progress

            with Progress() as bar:
                task = bar.add_task("soak", total=self.args.minutes * 60)
                start = time.monotonic()
                while time.monotonic() < end:
                    await asyncio.sleep(rng.expovariate(self.args.rate))
                    t = asyncio.create_task(self.one(client, random.Random(rng.random())))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    self.counts["sent"] += 1
                    bar.update(
                        task,
                        completed=time.monotonic() - start,
                        description=f"soak: {self.counts['sent']} sent, {len(tasks)} open, "
                        f"{self.counts['failed']} failed",
                    )
            await asyncio.gather(*tasks)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--rate", type=float, default=1.0, help="mean requests per second")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--speculative", default="ngram")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-body-mb", type=float, default=1.0)
    ap.add_argument("--rss-bound-mb", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    port = free_port()
    edgellm = str(Path(sys.executable).with_name("edgellm"))
    cmd = [
        edgellm, "serve", "--backend", args.backend, "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs), "--max-body-mb", str(args.max_body_mb),
        "--speculative", args.speculative, "--served-model-name", "default",
    ]  # fmt: skip
    log = open(Path(args.out) / f"soak-{args.backend}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            for _ in range(600):
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    sys.exit(f"server exited with {server.returncode}; see {log.name}")
                time.sleep(0.5)
            refs = {}
            for q in QUESTIONS:  # the idle server's greedy answers, also the warm-up
                r = client.post(
                    "/v1/chat/completions",
                    json=chat_body(q, temperature=0, max_tokens=args.max_tokens),
                )
                refs[q] = r.json()["choices"][0]["message"]["content"]
            rss0 = rss_mb(server.pid)
            soak = Soak(args, url, refs)
            t0 = time.perf_counter()
            asyncio.run(soak.run())
            wall = time.perf_counter() - t0
            time.sleep(1.0)  # aborted streams are reaped by the engine thread
            m = metrics(client)
            rss1 = rss_mb(server.pid)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    checks = {
        "no KV blocks in use": m.get("edgellm_kv_blocks_used", -1) == 0,
        "no request running or waiting": m.get("edgellm_requests_running", 0) == 0
        and m.get("edgellm_requests_waiting", 0) == 0,
        f"RSS growth under {args.rss_bound_mb:.0f} MB": rss1 - rss0 < args.rss_bound_mb,
        "every good request answered correctly": soak.counts["failed"] == 0,
    }
    for key, value in m.items():  # backend-specific gauges of storage still in use
        if key.endswith("_in_use"):
            checks[f"{key} == 0"] = value == 0
    lat = sorted(soak.latencies)
    report = {
        "command": "python " + " ".join(["bench/soak_serve.py", *sys.argv[1:]]),
        "server": " ".join(cmd[1:]),
        "backend": args.backend,
        "minutes": args.minutes,
        "wall_s": wall,
        "rate": args.rate,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "counts": dict(sorted(soak.counts.items())),
        "failures": soak.failures,
        "latency_s": {
            "p50": lat[len(lat) // 2] if lat else None,
            "p95": lat[int(len(lat) * 0.95)] if lat else None,
        },
        "rss_mb": {"start": rss0, "end": rss1},
        "metrics_at_end": m,
        "checks": checks,
    }
    out = Path(args.out)
    (out / f"soak-{args.backend}.json").write_text(json.dumps(report, indent=2))
    (out / f"soak-{args.backend}.md").write_text(markdown(report))
    print(markdown(report))
    sys.exit(0 if all(checks.values()) else 1)


def markdown(r: dict) -> str:
    lines = [
        f"Soak of `edgellm {r['server']}`: {r['minutes']:g} min of Poisson load at "
        f"{r['rate']:g} requests/s.",
        "",
        "| outcome | count |",
        "|---|---:|",
        *(f"| {k} | {v} |" for k, v in r["counts"].items()),
        "",
        f"Good requests' latency: p50 {r['latency_s']['p50'] or 0:.2f} s, "
        f"p95 {r['latency_s']['p95'] or 0:.2f} s. RSS {r['rss_mb']['start']:.0f} MB after "
        f"warm-up, {r['rss_mb']['end']:.0f} MB at the end.",
        "",
        "| check at the end | |",
        "|---|---|",
        *(f"| {k} | {'yes' if v else '**NO**'} |" for k, v in r["checks"].items()),
    ]
    if r["failures"]:
        lines += ["", "First failures:", "", *(f"- {f}" for f in r["failures"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
