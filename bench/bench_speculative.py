"""Speculative decoding benchmark: plain decoding vs n-gram (and draft-model) speculation.

Side by side in one run, same input-grounded prompts (summarize a passage, rewrite or
edit code given in the prompt), greedy, same threads, modes interleaved per prompt and
the best of --repeats runs kept (the machine is shared; contention only adds time). For every prompt and mode:
generated tokens/s, speedup over plain decoding, acceptance rate, tokens per target
forward, and whether the tokens equal plain decoding's.

    python bench/bench_speculative.py                  # SmolLM2-135M, torch backend
    python bench/bench_speculative.py --qwen --backend llamacpp   # opt-in, never in CI:
        # Qwen2.5-Coder-1.5B target + 0.5B draft GGUFs (pip parts, see MODELS.md)

Writes bench/results/speculative[-qwen].{json,png}.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from edgellm import LLM, SamplingParams
from edgellm.config import SpeculativeConfig
from edgellm.engine import block_manager
from edgellm.engine.outputs import RequestMetrics
from edgellm.loaders.texts import load_text
from edgellm.sampling import sampler
from edgellm.spec import controller, proposers

# mode name -> SpeculativeConfig arguments (None: plain decoding)
SMOL_MODES = {
    "off": None,
    "ngram": dict(method="ngram", num_draft_tokens=6),
    "ngram-fixed-k": dict(method="ngram", num_draft_tokens=6, adaptive=False),
}
QWEN_MODES = {
    "off": None,
    "ngram": dict(method="ngram", num_draft_tokens=6),
    "draft": dict(method="draft", num_draft_tokens=4, draft_model="qwen2.5-coder-0.5b"),
}


def code_sample(fn) -> str:
    return inspect.getsource(fn)


def workload(n_chars: int = 900) -> list[tuple[str, str]]:
    """(kind, user message) pairs whose answers mostly copy from the prompt."""
    text = load_text("sotu")
    passage = text[20000 : 20000 + n_chars]
    return [
        ("summarize", f"Summarize this passage in three sentences:\n\n{passage}"),
        (
            "rewrite-code",
            "Rewrite this Python function with clearer variable names. Return only the code.\n\n"
            + code_sample(sampler.filter_logits),
        ),
        (
            "edit-code",
            "Add a docstring line to every function below and return the full code unchanged "
            "otherwise.\n\n" + code_sample(proposers.find_last) + code_sample(controller.choose_k),
        ),
        (
            "rename",
            "In this code rename `block_id` to `bid`. Return the complete code.\n\n"
            + code_sample(block_manager.BlockManager.trim),
        ),
        ("copy-edit", f"Fix any typos in this text and return it in full:\n\n{passage[:500]}"),
        # open-ended: nothing to copy from the prompt (the draft model's case, n-gram's worst)
        ("write-code", "Write a Python function that merges overlapping intervals, with tests."),
        ("explain", "Explain in a paragraph why the sky is blue and why sunsets are red."),
    ]


# prompt kind -> group reported in the tables (the goals are per group)
GROUPS = {
    "summarize": "prose",
    "rewrite-code": "code",
    "edit-code": "code",
    "rename": "code",
    "copy-edit": "prose",
    "write-code": "code",
    "explain": "prose",
}


def run_one(llm: LLM, ids: list[int], max_tokens: int, repeats: int) -> dict:
    """One prompt alone (single stream), best of `repeats`: tokens, seconds, statistics."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate([ids], params)[0]
        dt = time.perf_counter() - t0
        if best is None or dt < best["seconds"]:
            toks = out.outputs[0].token_ids
            best = {"tokens": len(toks), "seconds": dt, "token_ids": toks, **flat(out.metrics)}
    return best


def flat(m: RequestMetrics) -> dict:
    """The metrics as the JSON results store them (spec_* keys when speculating)."""
    out = {"ttft_s": m.ttft_s, "e2e_s": m.e2e_s, "decode_tokens_per_s": m.decode_tokens_per_s}
    if m.spec is not None:
        out |= {
            "spec_proposed": m.spec.proposed,
            "spec_accepted": m.spec.accepted,
            "spec_acceptance_rate": m.spec.acceptance_rate,
            "spec_tokens_per_forward": m.spec.tokens_per_forward,
        }
    return out


def make_llm(args, mode: dict | None) -> LLM:
    spec = SpeculativeConfig(**mode) if mode else "off"
    return LLM(args.model, backend=args.backend, dtype=args.dtype, speculative=spec)


def summarize(results: dict, kinds: list[str]) -> dict:
    """Per mode: total tokens/s, speedup over "off", acceptance; per prompt too."""
    base = results["off"]
    out = {}

    def rate(rows) -> float:
        return sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)

    for mode, rows in results.items():
        tps = sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)
        base_tps = sum(r["tokens"] for r in base) / sum(r["seconds"] for r in base)
        proposed = sum(r.get("spec_proposed", 0) for r in rows)
        out[mode] = {
            "tokens_per_s": tps,
            "speedup": tps / base_tps,
            "acceptance": sum(r.get("spec_accepted", 0) for r in rows) / proposed
            if proposed
            else None,
            "same_tokens_as_off": sum(
                r["token_ids"] == b["token_ids"] for r, b in zip(rows, base, strict=True)
            ),
            "per_group": {
                g: {
                    "speedup": rate(sel(rows, kinds, g)) / rate(sel(base, kinds, g)),
                    "acceptance": acceptance(sel(rows, kinds, g)),
                }
                for g in sorted({GROUPS[k] for k in kinds})
            },
            "per_prompt": {
                k: {
                    "speedup": (r["tokens"] / r["seconds"]) / (b["tokens"] / b["seconds"]),
                    "acceptance": r.get("spec_acceptance_rate") if r.get("spec_proposed") else None,
                    "proposed": r.get("spec_proposed", 0),
                    "tokens_per_forward": r.get("spec_tokens_per_forward"),
                    "tokens": r["tokens"],
                }
                for k, r, b in zip(kinds, rows, base, strict=True)
            },
        }
    return out


def sel(rows: list[dict], kinds: list[str], group: str) -> list[dict]:
    return [r for r, k in zip(rows, kinds, strict=True) if GROUPS[k] == group]


def acceptance(rows: list[dict]) -> float | None:
    proposed = sum(r.get("spec_proposed", 0) for r in rows)
    return sum(r.get("spec_accepted", 0) for r in rows) / proposed if proposed else None


def markdown(report: dict, kinds: list[str]) -> str:
    """Per mode: speedup per group and per prompt (acceptance in brackets)."""
    modes = [m for m in report["summary"] if m != "off"]
    groups = list(report["summary"]["off"]["per_group"])

    def cell(d: dict) -> str:
        acc = "" if d["acceptance"] is None else f" ({d['acceptance']:.0%})"
        return f"{d['speedup']:.2f}×{acc}"

    head = ["mode", *groups, *kinds, "same tokens as off"]
    lines = [
        f"`{report['command']}`: {report['model']} on {report['backend']}, greedy, "
        f"{report['max_tokens']} tokens, 1 stream, best of {report['repeats']}, "
        f"{report['threads']} threads; plain decoding {report['summary']['off']['tokens_per_s']:.1f} "
        "tok/s. Speedup over plain decoding (acceptance).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for m in modes:
        s = report["summary"][m]
        row = [m, *(cell(s["per_group"][g]) for g in groups)]
        row += [cell(s["per_prompt"][k]) for k in kinds]
        row.append(f"{s['same_tokens_as_off']}/{len(kinds)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="target model (default SmolLM2-135M)")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=7, help="how many of the workload's prompts")
    ap.add_argument("--qwen", action="store_true", help="Qwen2.5-Coder 1.5B + 0.5B draft (opt-in)")
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs per prompt and mode")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.qwen:
        args.model = args.model or "qwen2.5-coder-1.5b"
    modes = QWEN_MODES if args.qwen else SMOL_MODES
    from rich.console import Console

    console = Console()
    work = workload()[: args.prompts]
    kinds = [k for k, _ in work]
    llms = {}
    for name, mode in modes.items():
        with console.status(f"loading {name}"):
            llms[name] = make_llm(args, mode)
    first = next(iter(llms.values()))
    prompts = [first.format_chat([{"role": "user", "content": m}]) for _, m in work]
    for llm in llms.values():  # warm-up
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4))
    # prompt-major, modes interleaved: load from other processes drifts over minutes
    results = {name: [] for name in modes}
    for kind, ids in zip(kinds, prompts, strict=True):
        for name, llm in llms.items():
            with console.status(f"{kind}: {name}"):
                results[name].append(run_one(llm, ids, args.max_tokens, args.repeats))
        console.print(
            f"{kind}: " + ", ".join(f"{n} {r[-1]['seconds']:.1f}s" for n, r in results.items())
        )
    report = {
        "command": "python " + " ".join(["bench/bench_speculative.py", *sys.argv[1:]]),
        "model": args.model or "smollm2-135m",
        "backend": args.backend,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "modes": {k: v for k, v in modes.items()},
        "summary": summarize(results, kinds),
    }
    write(
        report, kinds, Path(args.out), "speculative-qwen" if args.qwen else "speculative", console
    )


def write(report: dict, kinds: list[str], out: Path, stem: str, console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text(markdown(report, kinds))
    for mode, s in report["summary"].items():
        acc = "-" if s["acceptance"] is None else f"{s['acceptance']:.0%}"
        console.print(
            f"{mode:>14}: {s['tokens_per_s']:6.1f} tok/s  speedup {s['speedup']:.2f}x  "
            f"acceptance {acc}  same tokens as off: {s['same_tokens_as_off']}/{len(kinds)}"
        )
    plot(report, kinds, out / f"{stem}.png")
    console.print(f"wrote {out}/{stem}.json, .png")


def plot(report: dict, kinds: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in report["summary"] if m != "off"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        per = report["summary"][mode]["per_prompt"]
        xs = [j + i * width for j in range(len(kinds))]
        ax.bar(xs, [per[k]["speedup"] for k in kinds], width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.95, color="red", linewidth=0.6, linestyle="--", label="0.95x floor")
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(
        f"Speculative decoding, {report['model']} on {report['backend']} (greedy, 1 stream)"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
