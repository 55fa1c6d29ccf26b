"""edgellm's llama.cpp backend beside llama-cpp-python's own generation, and the quality of
our exact INT4 -> GGUF exports beside llama.cpp's own quantizer, in one run.

Speed (SmolLM2-135M-Instruct: the packaged Q4_1 GGUF and edgellm's AWQ w4g128 export to
Q4_0; greedy, EOS ignored, same thread count):
    single stream:  decode tok/s = (N - 1) / (time from the first to the N-th token),
                    edgellm (engine + llama.cpp backend) ÷ `Llama.generate` on the same file;
                    both loaded once, taking turns, llama.cpp's buffers in huge pages
    concurrency C:  C requests of N tokens submitted at once; aggregate tok/s =
                    C·N / wall time, ÷ edgellm's single-stream decode tok/s; beside it
                    llama.cpp's own ceiling: bare `llama_decode` of C sequences per call
Quality (perplexity computed by llama.cpp through our backend's logits, strided windows
of 512 on held-out State of the Union text):
    edgellm AWQ and GPTQ (w4 g128 and g32, exported exactly to Q4_0) vs llama.cpp's
    `llama_model_quantize` Q4_0 and Q4_K_M of the same float (F16) weights.

    python bench/bench_llamacpp.py                     # writes bench/results/llamacpp.{json,md,png}
    python bench/bench_llamacpp.py --skip-quality      # speed only (a few minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import machine_info  # noqa: E402
from bench_quant import float_gguf, linear_bits, llama_cpp_quantize  # noqa: E402


# ---- speed -----------------------------------------------------------------------------------
def llama_llm(path: Path, threads: int):
    from llama_cpp import Llama

    return Llama(
        str(path),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,  # as the backend: the same kernels on both sides
        verbose=False,
    )


def generate_rate(llm, ids: list[int], n: int) -> float:
    """`Llama.generate`'s tokens/s after its first token (its prompt evaluated anew: reset)."""
    t1 = time.perf_counter()
    for k, _tok in enumerate(llm.generate(ids, temp=0, reset=True), start=1):
        if k == 1:
            t1 = time.perf_counter()
        if k == n:
            break
    return (n - 1) / (time.perf_counter() - t1)


def llama_decode(path: Path, ids: list[int], n: int, threads: int, repeats: int) -> list[float]:
    llm = llama_llm(path, threads)
    rates = [generate_rate(llm, ids, n) for _ in range(repeats)]
    llm.close()
    return rates


def edgellm_llm(path: Path, threads: int, max_num_seqs: int = 64):
    from edgellm import LLM

    # no prefix caching: repeats of one prompt must recompute it, as Llama.generate(reset=True) does
    return LLM(
        str(path),
        backend="llamacpp",
        llamacpp_type="file",  # the very file Llama.generate runs
        threads=threads,
        kv_cache_mb=256,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
    )


def edgellm_decode(llm, ids: list[int], n: int, repeats: int) -> list[float]:
    from edgellm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        out = llm.generate([ids], params)[0]
        m = out.metrics
        rates.append((n - 1) / (m.e2e_s - m.ttft_s))
    return rates


def edgellm_concurrent(llm, prompts: list[list[int]], n: int) -> float:
    from edgellm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return len(prompts) * n / wall


def raw_batch_decode(path: Path, c: int, n: int, threads: int, prompt_len: int) -> float:
    """llama.cpp's own ceiling: C sequences decoded together with bare `llama_decode` calls
    (one token each per call, no engine), after a prompt of `prompt_len`; aggregate tok/s."""
    import llama_cpp as ll

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    cp = ll.llama_context_default_params()
    cp.n_ctx = c * (prompt_len + n) + 256
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max, cp.kv_unified = max(c, 1), True
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED  # as the backend
    ctx = ll.llama_init_from_model(model, cp)
    batch = ll.llama_batch_init(512, 0, 1)

    def decode(rows: list[tuple[int, int, int]]) -> None:  # (seq, pos, token)
        for i, (seq, pos, tok) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, 1
        batch.n_tokens = len(rows)
        assert ll.llama_decode(ctx, batch) == 0

    for seq in range(c):  # prompts, one sequence at a time
        decode([(seq, p, 100 + (seq * 7 + p) % 1000) for p in range(prompt_len)])
    t0 = time.perf_counter()
    for p in range(prompt_len, prompt_len + n):
        decode([(seq, p, 200 + (seq + p) % 1000) for seq in range(c)])
    rate = c * n / (time.perf_counter() - t0)
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return rate


def speed(args, path: Path, bar, task) -> dict:
    from edgellm.loaders.texts import load_text

    llm = edgellm_llm(path, args.threads)
    words = load_text("sotu").split()
    prompts = [
        llm.tokenizer.encode(" ".join(words[i * 300 : i * 300 + 40]), add_special_tokens=False)[:32]
        for i in range(max(args.concurrency))
    ]
    res = {"llama_cpp": [], "edgellm": []}
    peer = llama_llm(path, args.threads)  # loaded once and kept, as our engine is
    for i in range(args.rounds):  # alternate, so a noisy neighbour hurts both sides alike
        for side in ("edgellm", "llama_cpp") if i % 2 == 0 else ("llama_cpp", "edgellm"):
            if side == "edgellm":
                res["edgellm"] += edgellm_decode(llm, prompts[0], args.tokens, 1)
            else:
                res["llama_cpp"].append(generate_rate(peer, prompts[0], args.tokens))
            bar.advance(task)
    peer.close()
    single = statistics.median(res["edgellm"])
    conc, raw = {}, {}
    for c in args.concurrency:
        conc[c] = edgellm_concurrent(llm, prompts[:c], args.tokens)
        raw[c] = raw_batch_decode(path, c, args.tokens, args.threads, len(prompts[0]))
        bar.advance(task)
    llm.engine.backend.close()
    raw1 = raw_batch_decode(path, 1, args.tokens, args.threads, len(prompts[0]))
    return {
        "gguf": path.name,
        "decode_tok_s": {k: statistics.median(v) for k, v in res.items()},
        "raw_decode_tok_s": res,
        "ratio_vs_llama_cpp": single / statistics.median(res["llama_cpp"]),
        "aggregate_tok_s": conc,
        "aggregate_vs_single": {c: v / single for c, v in conc.items()},
        "bare_llama_decode_tok_s": {1: raw1, **raw},
        "bare_llama_decode_vs_single": {c: v / raw1 for c, v in raw.items()},
    }


# ---- quality ---------------------------------------------------------------------------------
def quality(args, bar, task) -> list[dict]:
    from edgellm.registry import resolve_model

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / "float-f16.gguf"
    if not f16.exists():
        float_gguf(resolve_model(None), f16)
    files = {"float (F16)": f16}
    for ftype in ("Q4_0", "Q4_K_M"):
        out = work / f"llamacpp-{ftype}.gguf"
        if not out.exists():
            llama_cpp_quantize(f16, out, ftype)
        files[f"llama.cpp {ftype}"] = out
        bar.advance(task)
    for method in ("awq", "gptq"):
        for group in (128, 32):
            label = f"edgellm {method.upper()} w4g{group} -> Q4_0"
            files[label] = edgellm_gguf(args, method, group)
            bar.advance(task)
    rows = []
    for label, path in files.items():
        rows.append(
            {"model": label, "bits_per_weight": linear_bits(path), **perplexity(path, args)}
        )
        bar.advance(task)
    return rows


def edgellm_gguf(args, method: str, group: int) -> Path:
    """SmolLM2 quantized by edgellm (symmetric INT4), exported exactly to Q4_0 (cached)."""
    from edgellm.quantize import QuantizeOptions, quantize
    from edgellm.quantize.export_gguf import export_gguf

    work = Path(args.work_dir)
    ckpt, out = work / f"{method}-g{group}", work / f"{method}-g{group}.gguf"
    if not ckpt.exists():
        opts = QuantizeOptions(method, 4, group, True, n_samples=args.samples)
        quantize(None, ckpt, opts, force=True, progress=False)
    if not out.exists():
        export_gguf(ckpt, out, force=True)
    return out


def perplexity(path: Path, args) -> dict:
    from edgellm import LLM
    from edgellm.eval.perplexity import perplexity as ppl
    from edgellm.loaders.texts import load_text

    llm = LLM(
        str(path),
        backend="llamacpp",
        llamacpp_type="file",
        threads=args.threads,
        kv_cache_mb=64,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    text = load_text("sotu")  # held out: calibration uses the addresses before 2000
    tokens = llm.tokenizer.encode(text, add_special_tokens=False)[: args.eval_tokens]
    r = ppl(llm.score, tokens, ctx=512)
    llm.engine.backend.close()
    return {"ppl_sotu": r.ppl, "tokens_scored": r.tokens_scored}


# ---- report ----------------------------------------------------------------------------------
def markdown(result: dict, command: str) -> str:
    m = result["machine"]
    lines = [f"`{command}` ({m['cpu']}, {m['threads']} threads, {m['date']})", ""]
    if "huge_pages" in result:
        lines += [("llama.cpp's buffers in 2 MiB pages for both engines (`GLIBC_TUNABLES="
                   "glibc.malloc.hugetlb=1`); " if result["huge_pages"] else "4 KiB pages; ")
                  + "`Llama` loaded once and kept; who runs first alternates by round.", ""]
    for s in result["speed"]:
        lines += [
            f"**{s['gguf']}**",
            "",
            "| single stream, decode | tok/s | ratio |",
            "|---|---|---|",
            f"| llama-cpp-python `Llama.generate` | {s['decode_tok_s']['llama_cpp']:.1f} | 1.00 |",
            f"| edgellm engine + llama.cpp backend | {s['decode_tok_s']['edgellm']:.1f} | "
            f"{s['ratio_vs_llama_cpp']:.2f} |",
            "",
            "| concurrent requests | edgellm aggregate tok/s | ÷ single stream "
            "| bare `llama_decode` batch ÷ its single |",
            "|---|---|---|---|",
        ]
        for c, v in s["aggregate_tok_s"].items():
            lines.append(
                f"| {c} | {v:.1f} | {s['aggregate_vs_single'][c]:.2f}× "
                f"| {s['bare_llama_decode_vs_single'][c]:.2f}× |"
            )
        lines.append("")
    if result.get("quality"):
        lines += [
            "| model (all run by llama.cpp) | bits/weight | perplexity (sotu) |",
            "|---|---|---|",
        ]
        for r in result["quality"]:
            lines.append(f"| {r['model']} | {r['bits_per_weight']:.2f} | {r['ppl_sotu']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 2 if result.get("quality") else 1
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4), squeeze=False)
    ax = axes[0][0]
    for s, color in zip(result["speed"], ("tab:blue", "tab:orange"), strict=False):
        cs = [1, *s["aggregate_tok_s"]]
        ys = [s["decode_tok_s"]["edgellm"], *s["aggregate_tok_s"].values()]
        ax.plot([str(c) for c in cs], ys, "o-", color=color, label=f"edgellm, {s['gguf']}")
        bare = list(s["bare_llama_decode_tok_s"].values())
        ax.plot([str(c) for c in cs], bare, "x:", color=color, label="bare llama_decode")
        ax.axhline(s["decode_tok_s"]["llama_cpp"], color=color, ls="--", lw=0.8)
    ax.set(
        xlabel="concurrent requests",
        ylabel="aggregate decode tok/s",
        title="SmolLM2-135M (dashed: Llama.generate, 1 stream)",
    )
    ax.legend(fontsize=7)
    if n == 2:
        ax = axes[0][1]
        rows = result["quality"]
        ax.barh([r["model"] for r in rows], [r["ppl_sotu"] for r in rows], color="tab:green")
        ax.set(xlabel="perplexity (lower is better)", title="computed by llama.cpp")
        lo = min(r["ppl_sotu"] for r in rows)
        ax.set_xlim(lo * 0.95, max(r["ppl_sotu"] for r in rows) * 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=5, help="single-stream repeats per engine")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="run without GLIBC_TUNABLES=glibc.malloc.hugetlb=1")
    ap.add_argument("--samples", type=int, default=32, help="calibration samples (AWQ/GPTQ)")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--work-dir", default="/tmp/edgellm-bench-llamacpp")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    from bench_scale import thp_on, with_thp

    if not args.no_huge_pages and not thp_on():
        # llama.cpp's buffers in huge pages for both engines, set before the process starts
        # (see bench_scale.step_decode: without them the model loaded first decodes slower)
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, __file__, *argv], with_thp(os.environ))
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.progress import Progress

    command = "python " + shlex.join(["bench/bench_llamacpp.py", *(argv or sys.argv[1:])])
    from edgellm.registry import resolve_model

    total = 2 * (2 * args.rounds + len(args.concurrency)) + (0 if args.skip_quality else 13)
    with Progress() as bar:
        task = bar.add_task("benchmark", total=total)
        result = {}
        if not args.skip_quality:
            result["quality"] = quality(args, bar, task)
        # the packaged Q4_1 file and our symmetric AWQ export (Q4_0), each beside `Llama`
        files = [resolve_model(None), edgellm_gguf(args, "awq", 128)]
        result["speed"] = [speed(args, f, bar, task) for f in files]
    result["machine"] = machine_info(args.threads)
    result["command"] = command
    result["huge_pages"] = not args.no_huge_pages
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "llamacpp.json").write_text(json.dumps(result, indent=2))
    md = markdown(result, command)
    (args.out_dir / "llamacpp.md").write_text(md)
    plot(result, args.out_dir / "llamacpp.png")
    Console().print(Markdown(md))


if __name__ == "__main__":
    main()
