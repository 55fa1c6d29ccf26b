"""Sliding-window attention with attention sinks (`--kv-window N --kv-sinks S`) on SmolLM2,
side by side in one run.

1. Quality: held-out perplexity (sotu from 2000, `--ppl-tokens`, windows of `--ctx` 2,048
   tokens) with full attention, and with every layer attending to its last N tokens
   (N = 1024, 512, 256, 128), with 4 sink tokens and without: what the window costs, and
   what the sinks buy back.
2. Memory and speed over a long generation: one stream generating `--gen` tokens (past the
   window many times) with full attention and with `--kv-window 256`: the KV blocks the
   sequence holds and decode tok/s per segment of 256 tokens. With a window both stay flat;
   with full attention the cache grows with every token.

    python bench/bench_window.py            # writes bench/results/window.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edgellm import LLM, SamplingParams
from edgellm.engine.block_manager import live
from edgellm.eval.perplexity import perplexity
from edgellm.loaders.texts import load_text

WINDOWS = [(0, 0), (1024, 4), (1024, 0), (512, 4), (512, 0), (256, 4), (256, 0), (128, 4), (128, 0)]


def label(window: int, sinks: int) -> str:
    return "full attention" if not window else f"window {window}" + (f" + {sinks} sinks" if sinks else "")


def encode(tok, text: str, limit: int) -> list[int]:
    """The first `limit` tokens of a text, encoded a piece at a time (bounded memory)."""
    ids: list[int] = []
    for i in range(0, len(text), 20000):
        ids += tok.encode(text[i : i + 20000], add_special_tokens=False)
        if len(ids) >= limit:
            break
    return ids[:limit]


def long_generation(llm: LLM, prompt: list[int], gen: int, segment: int = 256) -> dict:
    """One greedy stream: held blocks and tok/s for each `segment` generated tokens."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    eng.add_request(prompt, params)
    rates, held = [], []
    done, t0, mark = 0, time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step()
        seqs = [s for r in eng.requests.values() for s in r.seqs if s.block_table]
        if seqs:
            held.append(len(live(seqs[0].block_table)))
            done = len(seqs[0].output_ids)
        if done - mark >= segment:
            now = time.perf_counter()
            rates.append((done - mark) / (now - t0))
            t0, mark = now, done
    return {"tok_s": rates, "held_blocks": held[::segment] + held[-1:], "peak_blocks": max(held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--gen", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()

    from rich.console import Console

    console = Console()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "ppl": [], "long": {}}
    held = None
    for window, sinks in WINDOWS:
        console.print(f"[bold]{time.strftime('%H:%M:%S')}[/] perplexity, {label(window, sinks)}")
        llm = LLM(None, backend="torch", threads=args.threads, dtype=args.dtype,
                  max_num_batched_tokens=args.ctx, kv_window=window, kv_sinks=sinks)  # fmt: skip
        if held is None:
            held = encode(llm.tokenizer, load_text("sotu"), args.ppl_tokens)
        llm.engine.block_manager.enable_prefix_caching = False
        t0 = time.perf_counter()
        ppl = perplexity(llm.score, held, args.ctx).ppl
        res["ppl"].append({"window": window, "sinks": sinks, "ppl": ppl,
                           "seconds": time.perf_counter() - t0})  # fmt: skip
        llm.engine.backend.close()
        _write(res, args)
    base = res["ppl"][0]["ppl"]
    for row in res["ppl"]:
        row["vs_full"] = row["ppl"] / base - 1
    prompt = held[:64]
    for name, window in (("full attention", 0), ("window 256 + 4 sinks", 256)):
        console.print(f"[bold]{time.strftime('%H:%M:%S')}[/] {args.gen} tokens, {name}")
        llm = LLM(None, backend="torch", threads=args.threads, dtype=args.dtype,
                  max_num_batched_tokens=256, kv_window=window, kv_sinks=4)  # fmt: skip
        res["long"][name] = long_generation(llm, prompt, args.gen)
        res["long"][name]["block_size"] = llm.engine.block_manager.block_size
        llm.engine.backend.close()
        _write(res, args)
    console.print(markdown(res))


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [
        f"SmolLM2-135M, torch backend (dtype {a['dtype']}), {a['threads']} threads; "
        f"perplexity on sotu from 2000 ({a['ppl_tokens']} tokens, windows of {a['ctx']}).",
        "",
        "| attention | perplexity | vs full |",
        "|---|---:|---:|",
    ]
    for r in res["ppl"]:
        lines.append(f"| {label(r['window'], r['sinks'])} | {r['ppl']:.3f} | {r.get('vs_full', 0):+.2%} |")
    if res["long"]:
        lines += ["", f"| one stream, {a['gen']} tokens | KV blocks held at the end (peak) | "
                  "decode tok/s, first / last 256 |", "|---|---:|---:|"]  # fmt: skip
        for name, r in res["long"].items():
            rates = r["tok_s"] or [0.0]
            lines.append(f"| {name} | {r['held_blocks'][-1]} ({r['peak_blocks']}) | "
                         f"{rates[0]:.1f} / {rates[-1]:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _write(res: dict, args) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "window.json").write_text(json.dumps(res, indent=2))
    (out / "window.md").write_text(markdown(res))
    if res["long"]:
        plot(res, out / "window.png")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for sinks, marker in ((4, "o"), (0, "x")):
        rows = [r for r in res["ppl"] if r["window"] and r["sinks"] == sinks]
        ax1.plot([r["window"] for r in rows], [r["ppl"] for r in rows], marker=marker,
                 label=f"{sinks} sinks")  # fmt: skip
    ax1.axhline(res["ppl"][0]["ppl"], color="gray", ls="--", label="full attention")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("window (tokens)")
    ax1.set_ylabel("perplexity (sotu, ctx 2048)")
    ax1.legend()
    ax1.set_title("what a window costs")
    for name, r in res["long"].items():
        xs = [256 * (i + 1) for i in range(len(r["tok_s"]))]
        ax2.plot(xs, r["tok_s"], marker="o", label=name)
    ax2.set_xlabel("tokens generated")
    ax2.set_ylabel("decode tok/s (per 256 tokens)")
    ax2.legend()
    ax2.set_title("one long stream")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
