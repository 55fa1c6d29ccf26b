"""Does a request get slower as the llama.cpp backend's prefix cache fills?

llama.cpp keeps K/V in one unified cache: every used cell lies inside every sequence's
attention window (masked off for the others, but computed without flash attention). The
engine's prefix cache keeps the blocks of finished requests in llama.cpp cells ("keepers"),
so without a bound a long-running server attends over more and more dead cells per token.
`EngineConfig.llamacpp_keep_tokens` bounds them (least recently used go first).

Workload: `--requests` short distinct requests (a numbered sentence of the sotu text, ~40
tokens; 16 sampled tokens at temperature 0.8, so outputs differ and are cached too), sent in
batches of 16 to fill the cache quickly. Every `--every` requests, a probe: `--probes` fresh
single requests of the same kind, one at a time; latency = wall time of one `generate` call,
median of the probes. Variants (each a fresh engine, run one after the other in one process):

    before          no bound, no flash attention (main before issue 14)
    keep 1024       a bound of 1024 kept tokens, no flash attention
    fa              flash attention (masked cells skipped by the kernel), no bound
    fa + keep 256   both
    fa + keep 1024  both: the default (`EngineConfig()`)
    fa + keep 4096

    python bench/bench_cache_growth.py            # writes bench/results/cache_growth.{json,md,png}
    python bench/bench_cache_growth.py --requests 160 --every 80   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from edgellm import LLM, SamplingParams
from edgellm.config import EngineConfig
from edgellm.loaders.texts import load_text

VARIANTS = {  # "before": what main did before the bound and flash attention
    "before": dict(llamacpp_keep_tokens=10**9, flash_attn=False),
    "keep 1024": dict(llamacpp_keep_tokens=1024, flash_attn=False),
    "fa": dict(llamacpp_keep_tokens=10**9, flash_attn=True),
    "fa + keep 256": dict(llamacpp_keep_tokens=256, flash_attn=True),
    "fa + keep 1024": dict(llamacpp_keep_tokens=1024, flash_attn=True),  # the default
    "fa + keep 4096": dict(llamacpp_keep_tokens=4096, flash_attn=True),
}


def prompts(n: int, seed: int) -> list[str]:
    words = load_text("sotu").split()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        j = rng.randrange(len(words) - 30)
        out.append(f"Request {seed}-{i}: " + " ".join(words[j : j + 28]))
    return out


def run_variant(name: str, overrides: dict, args, progress, task) -> dict:
    llm = LLM(args.model, backend="llamacpp", threads=args.threads, **overrides)
    fill = SamplingParams(max_tokens=16, temperature=0.8, seed=0)
    probe = SamplingParams(max_tokens=16, temperature=0.8, seed=1)
    llm.generate(prompts(1, 999), probe)  # warm-up
    points = []
    done = 0
    fillers = prompts(args.requests, seed=1)
    while True:
        lat = []
        for p in prompts(args.probes, seed=10_000 + done):
            t = time.perf_counter()
            llm.generate([p], probe)
            lat.append(time.perf_counter() - t)
        cells = llm.engine.backend.cells
        points.append(
            {
                "requests": done,
                "latency_s": statistics.median(lat),
                "kept_tokens": len(cells.kept) * cells.bs,
                "max_cell_pos": max(cells.cell_positions(k.lseq)[1] for k in cells.keepers),
            }
        )
        progress.update(
            task, description=f"{name}: {done} requests, {points[-1]['latency_s']:.3f} s"
        )
        progress.console.log(f"{name}: {points[-1]}")
        if done >= args.requests:
            break
        batch = fillers[done : done + args.every]
        for i in range(0, len(batch), 16):
            llm.generate(batch[i : i + 16], fill)
        done += len(batch) + args.probes
        progress.advance(task, len(batch))
    llm.engine.backend.close()
    first, last = points[0]["latency_s"], points[-1]["latency_s"]
    return {"points": points, "first_s": first, "last_s": last, "growth": last / first}


def markdown(report: dict) -> str:
    names = list(report["variants"])
    lines = [
        f"Probe latency (s, median of {report['probes']}) after N requests, "
        f"{report['model']} on llama.cpp, {report['threads']} threads.",
        "",
        "| requests | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    rows = zip(*(report["variants"][n]["points"] for n in names), strict=True)
    for pts in rows:
        lines.append(
            f"| {pts[0]['requests']} | "
            + " | ".join(f"{p['latency_s']:.3f} ({p['kept_tokens']} kept)" for p in pts)
            + " |"
        )
    lines.append(
        "| last / first | "
        + " | ".join(f"**{report['variants'][n]['growth']:.2f}x**" for n in names)
        + " |"
    )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, v in report["variants"].items():
        xs = [p["requests"] for p in v["points"]]
        ax.plot(xs, [p["latency_s"] for p in v["points"]], marker="o", label=name)
    ax.set_xlabel("requests served before the probe")
    ax.set_ylabel("latency of one short request (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("llama.cpp backend: latency as the prefix cache fills")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_growth.json").write_text(json.dumps(report, indent=2))
    (out / "cache_growth.md").write_text(markdown(report))
    plot(report, out / "cache_growth.png")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=700)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--probes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument(
        "--append", action="store_true", help="add the variants to the existing results file"
    )
    args = ap.parse_args()
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    report = {
        "command": "python " + " ".join(["bench/bench_cache_growth.py", *sys.argv[1:]]),
        "model": args.model or "smollm2-135m",
        "threads": args.threads,
        "probes": args.probes,
        "default_keep_tokens": EngineConfig().keep_tokens,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "variants": {},
    }
    old = Path(args.out) / "cache_growth.json"
    if args.append and old.exists():
        previous = json.loads(old.read_text())
        report["variants"] = previous["variants"]
        report["command"] = previous["command"] + " && " + report["command"]
    with Progress(console=console) as progress:
        for name in args.variants.split(","):
            task = progress.add_task(name, total=args.requests)
            report["variants"][name] = run_variant(name, VARIANTS[name], args, progress, task)
            write(report, Path(args.out))  # after each variant: a long run keeps what it has
    console.print(markdown(report))


if __name__ == "__main__":
    main()
