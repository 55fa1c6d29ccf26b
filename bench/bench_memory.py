"""The KV-cache memory wall on SmolLM2, side by side in one run.

1. Capacity: how many concurrent 2,048-token sequences a fixed KV budget (`--kv-mb`, 512
   MiB) holds with 16-bit K/V (torch bf16, llama.cpp f16), int8 (ours; llama.cpp q8_0) and
   4-bit (llama.cpp q4_0), then all of them run at once (prompts of real text, 32 tokens
   generated each): no preemption allowed, throughput recorded.
2. Quality: held-out perplexity (sotu from 2000, `--ppl-tokens`, windows of 2,048 so the
   cache is long) and greedy agreement with the same backend's 16-bit cache (8 prompts, 64
   tokens: prompts identical all the way, and the mean agreed prefix).
3. llama.cpp flash attention: throughput at 16 and 32 concurrent requests (64-token prompts,
   128 tokens out), flash attention on vs off.
4. With `--qwen` (opt-in: the Qwen2.5-Coder-1.5B package): a process with
   `--memory-budget 4GB` on its Q4_K_M GGUF, 16 concurrent chats: planned vs peak RSS.

    python bench/bench_memory.py            # writes bench/results/memory.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from edgellm import LLM, SamplingParams
from edgellm.eval.perplexity import perplexity
from edgellm.loaders.texts import load_text

# (label, backend, engine options)
CACHES = [
    ("torch bf16", "torch", dict(dtype="bfloat16")),
    ("torch int8", "torch", dict(dtype="bfloat16", kv_cache_dtype="int8")),
    ("llama.cpp f16", "llamacpp", dict()),
    ("llama.cpp q8_0", "llamacpp", dict(kv_cache_dtype="int8")),
    ("llama.cpp q4_0", "llamacpp", dict(kv_cache_dtype="int4")),
]
FLOAT_OF = {"torch": "torch bf16", "llamacpp": "llama.cpp f16"}


def text_ids(tok, name: str) -> list[int]:
    return tok.encode(load_text(name), add_special_tokens=False)


def capacity(llm: LLM, ids: list[int], seq_len: int, gen: int) -> dict:
    """Every 2k sequence the pool holds, at once; fails loudly if the engine preempts."""
    bm = llm.engine.block_manager
    per_seq = -(-seq_len // bm.block_size)
    n = bm.num_blocks // per_seq
    rng = random.Random(0)
    starts = [rng.randrange(0, len(ids) - seq_len) for _ in range(n)]
    prompts = [ids[s : s + seq_len - gen] for s in starts]
    eng = llm.engine
    eng.scheduler.config.max_num_seqs = n + 4
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    most = 0
    while eng.has_unfinished():
        eng.step()
        most = max(most, sum(1 for r in eng.requests.values() for s in r.seqs if s.block_table))
    dt = time.perf_counter() - t0
    for r in rids:
        eng.pop_output(r)
    return {
        "blocks": bm.num_blocks, "tokens": bm.num_blocks * bm.block_size, "seqs": n,
        "peak_running": most, "preemptions": eng.scheduler.num_preemptions,
        "seconds": dt, "tok_s": n * seq_len / dt,
    }  # fmt: skip


def greedy(llm: LLM, prompts: list[list[int]], n: int = 64) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(ref, got, strict=True):
        d = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix.append(d)
    return {
        "identical": sum(p == len(a) for p, a in zip(prefix, ref, strict=True)),
        "prompts": len(ref),
        "mean_prefix": sum(prefix) / len(prefix),
    }


def throughput(model, flash: bool, concurrency: int, threads: int) -> float:
    llm = LLM(model, backend="llamacpp", kv_cache_mb=256, flash_attn=flash, threads=threads,
              max_num_seqs=concurrency)  # fmt: skip
    ids = text_ids(llm.tokenizer, "sotu")
    rng = random.Random(1)
    prompts = [ids[s : s + 64] for s in (rng.randrange(0, len(ids) - 64) for _ in range(concurrency))]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    llm.engine.backend.close()
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


QWEN_PROBE = r"""
import json, sys
from edgellm import LLM, SamplingParams
from edgellm.loaders.texts import load_text
llm = LLM(sys.argv[1], backend="llamacpp", memory_budget="4GB", llamacpp_type="file")
plan = llm.memory_plan
text = load_text("shakespeare")
chats = [[{"role": "user", "content": "Summarise, briefly: " + text[i * 3000: i * 3000 + 2500]}]
         for i in range(16)]
outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=128))
with open("/proc/self/status") as f:
    hwm = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")) * 1024
print(json.dumps({"planned": plan.total, "kv_dtype": plan.kv_dtype, "tokens": plan.tokens,
                  "peak_rss": hwm, "chats": len(outs)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-mb", type=float, default=512)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-flash", action="store_true")
    ap.add_argument("--qwen", action="store_true", help="also the 4 GB budget on Qwen 1.5B")
    ap.add_argument("--only-qwen", action="store_true",
                    help="just the Qwen run, added to the results already written")  # fmt: skip
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()

    from rich.console import Console

    console = Console()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "caches": [], "flash": []}
    greedy_ref: dict[str, list[list[int]]] = {}
    if args.only_qwen:
        res = json.loads((Path(args.out_dir) / "memory.json").read_text())
        args.qwen = True
    for label, backend, opts in [] if args.only_qwen else CACHES:
        console.print(f"[bold]{time.strftime('%H:%M:%S')}[/] {label}")
        llm = LLM(None, backend=backend, kv_cache_mb=args.kv_mb, threads=args.threads,
                  max_num_batched_tokens=args.seq_len, **opts)  # fmt: skip
        tok = llm.tokenizer
        calib = text_ids(tok, "sotu-calib")
        row = {"label": label, "backend": backend, **capacity(llm, calib, args.seq_len, 32)}
        held = text_ids(tok, "sotu")[: args.ppl_tokens]
        llm.engine.block_manager.enable_prefix_caching = False
        row["ppl"] = perplexity(llm.score, held, args.seq_len).ppl
        rng = random.Random(2)
        prompts = [held[s : s + 256] for s in (rng.randrange(0, len(held) - 256) for _ in range(8))]
        got = greedy(llm, prompts)
        if label == FLOAT_OF[backend]:
            greedy_ref[backend] = got
        row["greedy"] = agreement(greedy_ref[backend], got)
        llm.engine.backend.close()
        res["caches"].append(row)
        _write(res, args, console)
    if not (args.skip_flash or args.only_qwen):
        for flash in (True, False):
            for conc in (16, 32):
                console.print(f"[bold]{time.strftime('%H:%M:%S')}[/] llama.cpp flash={flash} x{conc}")
                tps = throughput(None, flash, conc, args.threads)
                res["flash"].append({"flash_attn": flash, "concurrency": conc, "tok_s": tps})
                _write(res, args, console)
    if args.qwen:
        from edgellm.registry import resolve_model

        console.print(f"[bold]{time.strftime('%H:%M:%S')}[/] Qwen2.5-Coder-1.5B, 4 GB budget")
        done = subprocess.run(
            [sys.executable, "-c", QWEN_PROBE, str(resolve_model("qwen2.5-coder-1.5b"))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        res["qwen"] = json.loads(done.stdout.strip().splitlines()[-1])
        _write(res, args, console)


def markdown(res: dict) -> str:
    rows = res["caches"]
    base = {r["backend"]: r for r in rows if r["label"] in FLOAT_OF.values()}
    out = [
        f"| K/V cache | tokens in {res['args']['kv_mb']:.0f} MiB | x 16-bit | concurrent 2k seqs (ran at once) | preemptions | prefill+decode tok/s | ppl sotu (ctx {res['args']['seq_len']}) | greedy = 16-bit (mean agreed prefix of 64) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = base[r["backend"]]
        g = r["greedy"]
        out.append(
            f"| {r['label']} | {r['tokens']:,} | {r['tokens'] / b['tokens']:.2f} | {r['seqs']} ({r['peak_running']}) "
            f"| {r['preemptions']} | {r['tok_s']:.0f} | {r['ppl']:.3f} ({r['ppl'] / b['ppl'] - 1:+.2%}) "
            f"| {g['identical']}/{g['prompts']} ({g['mean_prefix']:.1f}) |"
        )
    if res["flash"]:
        out += ["", "| llama.cpp | 16 concurrent tok/s | 32 concurrent tok/s | 32 / 16 |", "|---|---:|---:|---:|"]
        for flash in (True, False):
            t = {r["concurrency"]: r["tok_s"] for r in res["flash"] if r["flash_attn"] == flash}
            if len(t) == 2:
                out.append(f"| flash attention {'on' if flash else 'off'} | {t[16]:.0f} | {t[32]:.0f} | {t[32] / t[16]:.2f} |")
    if "qwen" in res:
        q = res["qwen"]
        out += [
            "",
            f"Qwen2.5-Coder-1.5B Q4_K_M, `--memory-budget 4GB`, 16 chats: planned {q['planned'] / 2**20:,.0f} MiB "
            f"(KV {q['kv_dtype']}, {q['tokens']:,} tokens), peak RSS {q['peak_rss'] / 2**20:,.0f} MiB.",
        ]
    return "\n".join(out)


def _write(res: dict, args, console) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    console.print(md)
    (out / "memory.md").write_text(md + "\n")
    (out / "memory.json").write_text(json.dumps(res, indent=2))
    plot(res, out / "memory.png")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["caches"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [r["label"] for r in rows]
    a.bar(labels, [r["seqs"] for r in rows], color=["C0", "C1", "C2", "C3", "C4"][: len(rows)])
    a.set_ylabel(f"2k-token sequences in {res['args']['kv_mb']:.0f} MiB of KV")
    a.tick_params(axis="x", rotation=20)
    b.bar(labels, [r["ppl"] for r in rows], color=["C0", "C1", "C2", "C3", "C4"][: len(rows)])
    b.set_ylabel(f"perplexity, sotu 2000+ (ctx {res['args']['seq_len']})")
    lo = min(r["ppl"] for r in rows)
    b.set_ylim(lo * 0.95, max(r["ppl"] for r in rows) * 1.02)
    b.tick_params(axis="x", rotation=20)
    fig.suptitle("SmolLM2-135M, 2 CPU cores: KV-cache storage, capacity and quality")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
