"""Engine benchmark on SmolLM2: continuous batching vs transformers' static batching.

Side by side in one run, same prompts, same dtype (--dtype, float32 by default), same threads:
  1. throughput (generated tokens/s) at 1, 4, 16, 32 concurrent requests with
     mixed output lengths (16-256 tokens), edgellm vs transformers' batched generate;
  2. KV memory waste (allocated but unused token slots / allocated) of the paged
     cache on that workload, beside what max-length reservation would waste;
  3. time to first token of a request whose 1,000-token prefix is cached vs not.

    python bench/bench_engine.py            # writes bench/results/engine.{json,md,png}
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from edgellm import LLM, SamplingParams
from edgellm.loaders.texts import load_text


def workload(tok, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: real text slices of 32-128 tokens, outputs 16-256."""
    rng = random.Random(seed)
    ids = tok.encode(load_text("sotu"), add_special_tokens=False)
    out = []
    for _ in range(n):
        plen, start = rng.randint(32, 128), rng.randrange(0, len(ids) - 200)
        out.append((ids[start : start + plen], rng.randint(16, 256)))
    return out


def run_edgellm(llm: LLM, reqs, concurrency: int) -> dict:
    eng = llm.engine
    eng.scheduler.config.max_num_seqs = concurrency
    rids = [
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        for p, m in reqs
    ]
    waste_alloc = waste_used = 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        m = eng.metrics()
        waste_alloc += m["kv_slots_allocated"]
        waste_used += m["kv_slots_used"]
    dt = time.perf_counter() - t0
    outs = [eng.pop_output(r) for r in rids]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tokens": tokens,
        "seconds": dt,
        "tok_s": tokens / dt,
        "kv_waste": 1 - waste_used / waste_alloc if waste_alloc else 0.0,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def run_transformers(hf, reqs, concurrency: int, pad_id: int) -> dict:
    """Static batches of `concurrency` prompts (left-padded); each batch runs to its longest output."""
    useful = 0
    t0 = time.perf_counter()
    for i in range(0, len(reqs), concurrency):
        batch = reqs[i : i + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        longest = max(m for _, m in batch)
        with torch.no_grad():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
        useful += sum(m for _, m in batch)  # tokens past a request's own length are thrown away
    dt = time.perf_counter() - t0
    return {"tokens": useful, "seconds": dt, "tok_s": useful / dt}


def reservation_waste(reqs, reserve: int | None) -> float:
    """Waste if every request reserved `reserve` slots (None: prompt + its max_tokens) for its
    whole life, averaged over decode steps like the paged figure."""
    alloc = used = 0
    for p, m in reqs:
        for t in range(m):
            alloc += reserve or (len(p) + m)
            used += len(p) + t + 1
    return 1 - used / alloc


def ttft_cached(llm: LLM, prefix_len: int = 1000) -> dict:
    tok = llm.tokenizer
    ids = tok.encode(load_text("shakespeare"), add_special_tokens=False)
    prefix = ids[:prefix_len]
    params = SamplingParams(temperature=0, max_tokens=1)

    def ttft(prompt):
        out = llm.generate([prompt], params)[0]
        return out.metrics.ttft_s, out.num_cached_tokens

    llm.engine.block_manager.enable_prefix_caching = False
    cold = min(ttft(prefix + ids[2000 + 30 * i : 2024 + 30 * i])[0] for i in range(2))
    llm.engine.block_manager.enable_prefix_caching = True
    ttft(prefix + ids[3000:3024])  # warm the cache with the shared prefix
    hits = [ttft(prefix + ids[4000 + 30 * i : 4024 + 30 * i]) for i in range(3)]
    warm = min(h[0] for h in hits)
    return {
        "prefix_tokens": prefix_len,
        "uncached_s": cold,
        "cached_s": warm,
        "ratio": warm / cold,
        "cached_tokens": hits[0][1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument(
        "--requests-per-slot", type=int, default=2, help="requests = max(4, this x concurrency)"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and KV cache, the same for both engines",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]

    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    llm = LLM(backend="torch", dtype=args.dtype, kv_cache_mb=1024, max_num_batched_tokens=1024)
    work = {c: workload(llm.tokenizer, max(4, args.requests_per_slot * c), seed=c) for c in levels}
    results: dict = {"edgellm": {}, "transformers": {}}
    with Progress(console=console) as bar:
        task = bar.add_task("edgellm", total=len(levels))
        run_edgellm(llm, work[levels[0]][:1], 1)  # warm-up
        for c in levels:
            results["edgellm"][c] = run_edgellm(llm, work[c], c)
            bar.advance(task)
        results["ttft"] = ttft_cached(llm)
        del llm
        gc.collect()
        if not args.skip_transformers:
            from transformers import AutoModelForCausalLM

            from edgellm.registry import resolve_model

            path = resolve_model(None)
            hf = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=getattr(torch, args.dtype)
            ).eval()
            task = bar.add_task("transformers", total=len(levels))
            for c in levels:
                results["transformers"][c] = run_transformers(hf, work[c], c, pad_id=2)
                bar.advance(task)
    report(results, work, levels, args, console)


def report(results, work, levels, args, console) -> None:
    ours, hf = results["edgellm"], results["transformers"]
    single = ours[levels[0]]["tok_s"]
    lines = [
        "| concurrent | requests | edgellm tok/s | transformers tok/s | edgellm / transformers | edgellm / own single stream | KV waste (paged) | KV waste (reserve prompt+max_tokens) | KV waste (reserve 8192 ctx) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in levels:
        o = ours[c]
        h = hf.get(c, {}).get("tok_s")
        lines.append(
            f"| {c} | {len(work[c])} | {o['tok_s']:.1f} | {h or float('nan'):.1f} | "
            f"{(o['tok_s'] / h) if h else float('nan'):.2f}x | {o['tok_s'] / single:.2f}x | "
            f"{o['kv_waste']:.1%} | {reservation_waste(work[c], None):.1%} | {reservation_waste(work[c], 8192):.1%} |"
        )
    t = results["ttft"]
    lines += [
        "",
        f"Time to first token with a {t['prefix_tokens']}-token prefix: uncached "
        f"{t['uncached_s'] * 1000:.0f} ms, cached {t['cached_s'] * 1000:.0f} ms "
        f"({t['cached_tokens']} tokens from the cache): **{t['ratio']:.3f}x**",
    ]
    md = "\n".join(lines)
    console.print(md)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"engine-{args.dtype}.md").write_text(md + "\n")
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "model": f"SmolLM2-135M-Instruct {args.dtype}",
    }
    slim = {
        k: {c: {kk: vv for kk, vv in r.items() if kk != "outputs"} for c, r in v.items()}
        for k, v in results.items()
        if k != "ttft"
    }
    (out / f"engine-{args.dtype}.json").write_text(
        json.dumps({"meta": meta, **slim, "ttft": results["ttft"]}, indent=2)
    )
    plot(ours, hf, levels, out / f"engine-{args.dtype}.png", args.dtype)
    console.print(f"wrote {out}/engine-{args.dtype}.md, .json, .png")


def plot(ours, hf, levels, path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, [ours[c]["tok_s"] for c in levels], "o-", label="edgellm (continuous batching)")
    if hf:
        ax.plot(
            levels,
            [hf[c]["tok_s"] for c in levels],
            "s--",
            label="transformers generate (static batches)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"SmolLM2-135M {dtype}, mixed output lengths 16-256")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
