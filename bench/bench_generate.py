"""Prefill and decode speed of edgellm's torch backend beside transformers and llama.cpp.

One run loads each engine once (freeing it before the next), measures on the same real
text with the same thread count, and reports edgellm/peer ratios: absolute times on shared
machines are noise, ratios from one run are not.

    python bench/bench_generate.py                      # defaults: P=128,512; decode 128
    python bench/bench_generate.py --repeats 5 --threads 4

Definitions (single stream, greedy, EOS ignored):
    prefill tok/s = P / (time to the first token of a P-token prompt)
    decode tok/s  = (N - 1) / (time from the first to the N-th token), 16-token prompt

Writes <out-dir>/generate.{json,png,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

DECODE_PROMPT_LEN = 16
TEXT = "sotu"


@dataclass(slots=True)
class Result:
    """Median speeds of one engine, with the raw per-repeat times behind them."""

    engine: str
    weights: str  # what the engine actually multiplies with
    prefill_tok_s: dict[int, float] = field(default_factory=dict)  # P -> tok/s
    decode_tok_s: float = 0.0
    raw: dict[str, list[float]] = field(default_factory=dict)  # label -> seconds per repeat


# ---- engines: each is (load, prefill_s(ids), decode_s(ids, n) -> (ttft_s, total_s)) --------------
class EdgeLLM:
    name, weights = "edgellm torch fp32", "dequantized Q4_1 GGUF"

    def __init__(self, threads: int):
        from edgellm import LLM, SamplingParams

        self.params = SamplingParams
        # No prefix caching: repeats of the same prompt must recompute it.
        self.llm = LLM(
            backend="torch", dtype="float32", threads=threads, enable_prefix_caching=False
        )

    def prefill_s(self, ids: list[int]) -> float:
        out = self.llm.generate([ids], self.params(temperature=0, max_tokens=1, ignore_eos=True))[0]
        return out.metrics.ttft_s

    def decode_s(self, ids: list[int], n: int) -> tuple[float, float]:
        params = self.params(temperature=0, max_tokens=n, ignore_eos=True)
        out = self.llm.generate([ids], params)[0]
        assert len(out.outputs[0].token_ids) == n, "edgellm stopped early"
        return out.metrics.ttft_s, out.metrics.e2e_s


class Transformers:
    name, weights = "transformers fp32", "dequantized Q4_1 GGUF"

    def __init__(self, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        from edgellm.registry import resolve_model

        self.torch = torch
        path = resolve_model(None)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()

    def _generate_s(self, ids: list[int], n: int) -> float:
        x = self.torch.tensor([ids])  # [1, P]
        kwargs = dict(
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            attention_mask=self.torch.ones_like(x),
            pad_token_id=0,
        )
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(x, **kwargs)
            t = time.perf_counter() - t0
        assert out.shape[1] == len(ids) + n, "transformers stopped early"
        return t

    def prefill_s(self, ids: list[int]) -> float:
        return self._generate_s(ids, 1)

    def decode_s(self, ids: list[int], n: int) -> tuple[float, float]:
        # generate() has no first-token hook: time a 1-token generate for the TTFT.
        return self._generate_s(ids, 1), self._generate_s(ids, n)


class LlamaCpp:
    name, weights = "llama.cpp Q4_1", "native Q4_1 kernels on the GGUF"

    def __init__(self, threads: int):
        from llama_cpp import Llama

        from edgellm.registry import resolve_model

        self.llm = Llama(
            model_path=str(resolve_model(None)),
            n_ctx=2048,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            verbose=False,
        )

    def prefill_s(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        t = time.perf_counter() - t0
        self.llm.sample(temp=0)  # first token, as the others do (not the prefill cost)
        return t

    def decode_s(self, ids: list[int], n: int) -> tuple[float, float]:
        # The bare generate() iterator never stops on EOS: N tokens exactly.
        t0 = time.perf_counter()
        ttft, k = 0.0, 0
        for k, _ in enumerate(self.llm.generate(ids, temp=0, reset=True), start=1):
            if k == 1:
                ttft = time.perf_counter() - t0
            if k == n:
                break
        assert k == n, "llama.cpp stopped early"
        return ttft, time.perf_counter() - t0


ENGINES = (EdgeLLM, Transformers, LlamaCpp)


# ---- measuring ------------------------------------------------------------------------------
def prompt_ids(lengths: list[int]) -> list[int]:
    """The first max(lengths) tokens of a real text, with the default model's tokenizer."""
    from edgellm.loaders.model import load_model
    from edgellm.loaders.texts import load_text

    tokenizer = load_model(None).tokenizer
    ids = tokenizer.encode(load_text(TEXT)[: 20 * max(lengths)], add_special_tokens=False)
    assert len(ids) >= max(lengths), "text too short for the longest prompt"
    return ids


def measure(engine, ids: list[int], args, advance: Callable[[str], None]) -> Result:
    res = Result(engine.name, engine.weights)
    # Warm-up at every shape: first calls pay for thread pools, allocators, GEMM plans.
    for p in args.prompt_lengths:
        engine.prefill_s(ids[:p])
    engine.decode_s(ids[:DECODE_PROMPT_LEN], min(args.decode_tokens, 16))
    advance("warm-up")
    for p in args.prompt_lengths:
        times = []
        for _ in range(args.repeats):
            times.append(engine.prefill_s(ids[:p]))
            advance(f"prefill P={p}")
        res.raw[f"prefill_{p}_s"] = times
        res.prefill_tok_s[p] = p / statistics.median(times)
    speeds = []
    for _ in range(args.repeats):
        ttft, total = engine.decode_s(ids[:DECODE_PROMPT_LEN], args.decode_tokens)
        res.raw.setdefault("decode_ttft_s", []).append(ttft)
        res.raw.setdefault("decode_total_s", []).append(total)
        speeds.append((args.decode_tokens - 1) / (total - ttft))
        advance(f"decode N={args.decode_tokens}")
    res.decode_tok_s = statistics.median(speeds)
    return res


def run_all(args) -> list[Result]:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    torch.set_num_threads(args.threads)
    ids = prompt_ids(args.prompt_lengths)
    per_engine = 2 + args.repeats * (len(args.prompt_lengths) + 1)  # load, warm-up, measurements
    results = []
    columns = (
        TextColumn("{task.description:<36}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as bar:
        task = bar.add_task("", total=per_engine * len(ENGINES))
        for cls in ENGINES:

            def advance(what: str, name=cls.name) -> None:
                bar.update(task, advance=1, description=f"{name}: {what}")

            bar.update(task, description=f"{cls.name}: loading")
            engine = cls(args.threads)
            advance("loaded")
            results.append(measure(engine, ids, args, advance))
            del engine
            gc.collect()
    return results


# ---- reporting ------------------------------------------------------------------------------
def ratio_header(args, sep: str = " ") -> list[str]:
    return [f"prefill{sep}P={p}" for p in args.prompt_lengths] + [
        f"decode{sep}N={args.decode_tokens}"
    ]


def table_rows(results: list[Result], args) -> list[list[str]]:
    """Per engine: name, weights, tok/s columns, then edgellm/engine ratio columns."""
    base = results[0]
    rows = []
    for r in results:
        speeds = [r.prefill_tok_s[p] for p in args.prompt_lengths] + [r.decode_tok_s]
        ours = [base.prefill_tok_s[p] for p in args.prompt_lengths] + [base.decode_tok_s]
        rows.append(
            [
                r.engine,
                r.weights,
                *(f"{s:,.0f}" if s >= 100 else f"{s:.1f}" for s in speeds),
                *(f"{o / s:.2f}x" for o, s in zip(ours, speeds, strict=True)),
            ]
        )
    return rows


def header(args, sep: str = " ") -> list[str]:
    cols = ratio_header(args, sep)
    return [
        "engine",
        "weights",
        *(f"{c}{sep}tok/s" for c in cols),
        *(f"edgellm/{sep.strip()}peer{sep}{c}" for c in cols),
    ]


def print_rich_table(results: list[Result], args, machine: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"SmolLM2-135M-Instruct, {machine['threads']} threads, median of {args.repeats}"
    caption = (
        "edgellm torch is the reference backend: Q4_1 weights dequantized to fp32, as in "
        "transformers; llama.cpp runs the native Q4_1 weights. ratio = edgellm tok/s / peer "
        "tok/s (> 1: edgellm faster)."
    )
    table = Table(title=title, caption=caption)
    cols = ratio_header(args, sep="\n")
    table.add_column("engine", min_width=14)  # weights: in the caption, to fit 80 columns
    for h in [*(f"{c}\ntok/s" for c in cols), *(f"ratio\n{c}" for c in cols)]:
        table.add_column(h, justify="right")
    for row in table_rows(results, args):
        table.add_row(row[0], *row[2:])
    Console().print(table)


def markdown(results: list[Result], args, machine: dict, command: str) -> str:
    head = header(args)
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results, args)]
    note = (
        f"SmolLM2-135M-Instruct on {machine['cpu']} ({machine['threads']} threads), "
        f"single stream, greedy, median of {args.repeats}; {machine['date']}. "
        "edgellm's torch backend is the fp32 reference (Q4_1 weights dequantized); "
        "llama.cpp runs the native Q4_1 weights. Ratios > 1: edgellm faster."
    )
    return "\n".join([note, "", *lines, "", f"Reproduce: `{command}`", ""])


def plot(results: list[Result], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_d) = plt.subplots(
        1, 2, figsize=(11, 4.5), width_ratios=[len(args.prompt_lengths), 1]
    )
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        label = f"{r.engine} ({r.weights})"
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(args.prompt_lengths))]
        bars = ax_p.bar(xs, [r.prefill_tok_s[p] for p in args.prompt_lengths], width, label=label)
        ax_p.bar_label(bars, fmt="%.0f", fontsize=8)
        bars = ax_d.bar(
            [(i - (len(results) - 1) / 2) * width], [r.decode_tok_s], width, label=label
        )
        ax_d.bar_label(bars, fmt="%.1f", fontsize=8)
    ax_p.set_xticks(range(len(args.prompt_lengths)), [f"P = {p}" for p in args.prompt_lengths])
    ax_p.set(title="prefill", ylabel="tokens / s (higher is better)")
    ax_d.set_xticks([0], [f"N = {args.decode_tokens}"])
    ax_d.set(title=f"decode ({DECODE_PROMPT_LEN}-token prompt, 1 stream)")
    for ax in (ax_p, ax_d):
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = ax_p.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(results), fontsize=9, frameon=False)
    fig.suptitle(f"SmolLM2-135M-Instruct, {args.threads} CPU threads")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_info(threads: int) -> dict:
    import llama_cpp
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp": llama_cpp.__version__,
        "edgellm_commit": commit,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_1_5_15min_at_end": os.getloadavg(),  # > 0 before the run ends: others were busy too
    }


def report(results: list[Result], args, command: str) -> None:
    machine = machine_info(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print_rich_table(results, args, machine)
    md = markdown(results, args, machine, command)
    (args.out_dir / "generate.md").write_text(md)
    data = {
        "machine": machine,
        "command": command,
        "text": TEXT,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "decode_prompt_len": DECODE_PROMPT_LEN,
        "results": [asdict(r) for r in results],
    }
    (args.out_dir / "generate.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(results, args, args.out_dir / "generate.png")
    print("\n" + md)
    print(f"wrote {args.out_dir}/generate.json, generate.md, generate.png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--decode-tokens", type=int, default=128, help="N tokens decoded after a 16-token prompt"
    )
    ap.add_argument(
        "--prompt-lengths", type=int, nargs="+", default=[128, 512], help="prefill prompt lengths P"
    )
    ap.add_argument("--repeats", type=int, default=3, help="repeats per measurement (median taken)")
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="CPU threads for every engine"
    )
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    if args.decode_tokens < 2 or min(args.prompt_lengths) < 1 or args.repeats < 1:
        ap.error("need --decode-tokens >= 2, prompt lengths >= 1, --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join(
        ["python", "bench/bench_generate.py", *(sys.argv[1:] if argv is None else argv)]
    )
    print(f"threads: {args.threads} (torch.set_num_threads and llama.cpp n_threads)")
    t0 = time.perf_counter()
    results = run_all(args)
    report(results, args, command)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
