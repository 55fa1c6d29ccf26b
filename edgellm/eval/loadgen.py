"""`edgellm bench`: a load generator for the in-process engine or any OpenAI-compatible URL.

Requests arrive at a fixed concurrency (closed loop) or as a Poisson process at a
given rate (open loop); each one records time to first token, time per output
token and end-to-end latency. A sweep over concurrency levels gives the
throughput / P99 curves.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.progress import Progress

from edgellm.engine.outputs import RequestOutput
from edgellm.loaders.texts import load_text
from edgellm.sampling.params import SamplingParams


@dataclass(slots=True)
class Workload:
    prompts: list[str]
    max_tokens: list[int]


@dataclass(slots=True)
class Record:
    ttft_s: float
    e2e_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)


@dataclass
class LevelResult:
    concurrency: int | None
    rate: float | None
    duration_s: float
    records: list[Record] = field(default_factory=list)

    def summary(self) -> dict:
        out = {"concurrency": self.concurrency, "rate": self.rate, "requests": len(self.records)}
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            values = [getattr(r, name) for r in self.records]
            for q in (50, 90, 99):
                out[f"{name[:-2]}_p{q}_ms"] = float(np.percentile(values, q)) * 1000
        tokens = sum(r.output_tokens for r in self.records)
        out["output_tokens_per_s"] = tokens / self.duration_s
        out["requests_per_s"] = len(self.records) / self.duration_s
        return out


def _lengths(rng: random.Random, n: int, mean: int, dist: str) -> list[int]:
    draw = {
        "fixed": lambda: mean,
        "uniform": lambda: rng.randint(max(1, mean // 2), mean * 3 // 2),
        "exponential": lambda: round(rng.expovariate(1 / mean)),
    }
    if dist not in draw:
        raise ValueError(f"unknown length distribution {dist!r} (fixed | uniform | exponential)")
    return [max(1, draw[dist]()) for _ in range(n)]


def make_workload(
    tokenizer,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    dist: str = "fixed",
    seed: int = 0,
    prompt_file: str | None = None,
) -> Workload:
    """Prompts of `prompt_len` tokens (mean) cut from the SOTU text, or one per line of a file."""
    rng = random.Random(seed)
    outputs = _lengths(rng, num_requests, output_len, dist)
    if prompt_file:
        lines = [ln for ln in Path(prompt_file).read_text().splitlines() if ln.strip()]
        return Workload([lines[i % len(lines)] for i in range(num_requests)], outputs)

    ids = tokenizer.encode(load_text("sotu"), add_special_tokens=False)
    prompts = []
    for n in _lengths(rng, num_requests, prompt_len, dist):
        start = rng.randrange(0, len(ids) - n)
        prompts.append(tokenizer.decode(ids[start : start + n]))
    return Workload(prompts, outputs)


# ---- targets -----------------------------------------------------------------------------------
class EngineTarget:
    """The in-process engine, through the AsyncEngine."""

    def __init__(self, aeng):
        self.aeng = aeng

    async def send(self, prompt: str, max_tokens: int) -> Record:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0, first, n = time.perf_counter(), None, 0
        async for item in self.aeng.generate(prompt, params):
            if isinstance(item, RequestOutput):
                n = len(item.outputs[0].token_ids)
            elif first is None and item.token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        return Record((first or end) - t0, end - t0, n)


class HTTPTarget:
    """Any OpenAI-compatible server: streaming /v1/completions with usage."""

    def __init__(self, url: str, model: str, api_key: str | None = None):

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=600)

    async def send(self, prompt: str, max_tokens: int) -> Record:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0, first, n = time.perf_counter(), None, 0
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        return Record((first or end) - t0, end - t0, n)


# ---- running -----------------------------------------------------------------------------------
async def run_level(
    target, work: Workload, concurrency: int | None, rate: float | None, seed: int = 0, tick=None
) -> LevelResult:
    """All requests of `work`, at fixed `concurrency` or Poisson arrivals at `rate` per second."""
    jobs = list(zip(work.prompts, work.max_tokens, strict=True))
    result = LevelResult(concurrency, rate, 0.0)

    async def one(prompt: str, n: int) -> None:
        result.records.append(await target.send(prompt, n))
        if tick:
            tick()

    t0 = time.perf_counter()
    if rate:
        rng, tasks = random.Random(seed), []
        for prompt, n in jobs:
            tasks.append(asyncio.create_task(one(prompt, n)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    else:
        queue = iter(jobs)

        async def worker():
            for prompt, n in queue:
                await one(prompt, n)

        await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
    result.duration_s = time.perf_counter() - t0
    return result


def sweep(target, work: Workload, concurrencies: list[int], rate: float | None = None) -> list:
    """Run every level with a rich progress bar; returns the LevelResults."""

    levels = [None] if rate else concurrencies

    async def main(bar):
        results = []
        for c in levels:
            label = f"rate {rate}/s" if rate else f"concurrency {c}"
            task = bar.add_task(label, total=len(work.prompts))
            tick = lambda task=task: bar.advance(task)  # noqa: E731
            results.append(await run_level(target, work, c, rate, tick=tick))
        return results

    with Progress() as bar:
        return asyncio.run(main(bar))


# ---- reports -----------------------------------------------------------------------------------
def write_report(results: list[LevelResult], meta: dict, json_path: Path) -> Path:
    """JSON with the summary per level and every request's record; PNG plots beside it."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "meta": meta,
        "levels": [r.summary() for r in results],
        "records": [[asdict(x) for x in r.records] for r in results],
    }
    json_path.write_text(json.dumps(data, indent=2))
    png = json_path.with_suffix(".png")
    plot(results, png, meta.get("title", "edgellm bench"))
    return png


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, thr, p99) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in results:
        e2e = np.sort([x.e2e_s for x in r.records])
        label = f"c={r.concurrency}" if r.concurrency else f"{r.rate}/s"
        cdf.plot(e2e, np.arange(1, len(e2e) + 1) / len(e2e), label=label)
    cdf.set(xlabel="end-to-end latency (s)", ylabel="fraction of requests", title="latency CDF")
    cdf.legend()
    xs = [r.concurrency or 0 for r in results]
    sums = [r.summary() for r in results]
    thr.plot(xs, [s["output_tokens_per_s"] for s in sums], marker="o")
    thr.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    for key, label in (("e2e_p99_ms", "e2e"), ("ttft_p99_ms", "TTFT")):
        p99.plot(xs, [s[key] for s in sums], marker="o", label=label)
    p99.plot(xs, [s["tpot_p99_ms"] for s in sums], marker="o", label="TPOT")
    p99.set(xlabel="concurrency", ylabel="P99 (ms)", title="P99 latency", yscale="log")
    p99.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(results: list[LevelResult]) -> str:
    rows = ["| conc | req | TTFT p50/p99 ms | TPOT p50/p99 ms | e2e p50/p90/p99 ms | tok/s |"]
    rows.append("|---|---|---|---|---|---|")
    for s in (r.summary() for r in results):
        rows.append(
            f"| {s['concurrency'] or s['rate']} | {s['requests']} "
            f"| {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} "
            f"| {s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f} "
            f"| {s['e2e_p50_ms']:.0f} / {s['e2e_p90_ms']:.0f} / {s['e2e_p99_ms']:.0f} "
            f"| {s['output_tokens_per_s']:.1f} |"
        )
    return "\n".join(rows)
