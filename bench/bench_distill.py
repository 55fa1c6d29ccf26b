"""Distillation on SmolLM2, side by side in one run: INT4 distilled vs AWQ / GPTQ / RTN /
llama.cpp Q4_0 and Q4_K_M, and pruned students after pruning alone, after logit
distillation and after plain cross-entropy fine-tuning on the same tokens.

Every model is scored by the same evaluator as `bench_quant.py` (our torch backend,
strided perplexity, ctx 512) on held-out State of the Union addresses (2000 on) and on
Shakespeare; training uses the addresses before 2000. Each quantization and each training
run is its own process, so its time and peak memory (VmHWM) are its own. The distilled
INT4 run starts from the AWQ checkpoint made in the same run (what `edgellm distill --bits
4 --init awq` does), so its recipe time is AWQ's plus the distillation's. Curves are the
student's perplexity on the first `--curve-tokens` of sotu (2000 on) in `--seq-len` windows
(no context across windows, so higher than the strided numbers) against tokens seen.

    python bench/bench_distill.py                                # every part
    python bench/bench_distill.py --parts int4-sym,prune-both    # a subset
    python bench/bench_distill.py --parts int4-sym --merge       # redo one, keep the others
    # writes bench/results/distill.{json,md,png}

Parts: int4-sym, int4-asym (W4 g128), prune-depth (8 of 30 layers), prune-width (MLP
1536 -> 1024), prune-both (4 layers and MLP 1280): each about 20% of the parameters.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_quant  # noqa: E402  (float GGUF, llama.cpp's quantizer, bits per weight)

TEXTS = ("sotu", "shakespeare")
PRUNES = {
    "prune-depth": dict(drop_layers=8),
    "prune-width": dict(mlp_width=1024),
    "prune-both": dict(drop_layers=4, mlp_width=1280),
}
PARTS = ("int4-sym", "int4-asym", *PRUNES)


def child(args) -> None:
    """One training / pruning job in its own process; writes its report as JSON."""
    from edgellm.distill import DistillOptions, PruneOptions, distill, prune
    from edgellm.quantize.pipeline import peak_rss_mb

    job = json.loads(args.child)
    t0 = time.perf_counter()
    if job["kind"] == "prune":
        prune(None, job["out"], PruneOptions(**job["options"]), force=True)
        result = {"seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}
    else:
        r = distill(
            None, job["out"], DistillOptions(**job["options"]), force=True,
            eval_text="sotu", eval_tokens=args.curve_tokens,
        )  # fmt: skip
        result = {
            "seconds": r.seconds, "peak_rss_mb": r.peak_rss_mb, "tokens": r.tokens,
            "kl_before": r.kl_before, "kl_after": r.kl_after, "evals": r.evals,
        }  # fmt: skip
    Path(job["out"], "bench.json").write_text(json.dumps(result))


def run_child(job: dict, args) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(job), "--curve-tokens"]
    subprocess.run([*cmd, str(args.curve_tokens)], check=True)
    return json.loads(Path(job["out"], "bench.json").read_text())


def quantize_child(method: str, sym: bool, out: Path) -> dict:
    kind = "sym" if sym else "asym"
    cmd = [sys.executable, bench_quant.__file__, "--one", f"{method},4,128,{kind}", "--out", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "bench.json").read_text())


def llama_decode_rates(ggufs: dict[str, Path], tokens: int = 256, rounds: int = 3) -> dict:
    """Single-stream greedy decode tokens/s of llama.cpp itself (llama-cpp-python, 2 threads)
    for each file: rounds interleaved across the files (so drifts of a shared machine hit all
    of them alike), the median kept."""
    from llama_cpp import Llama

    llms = {k: Llama(str(g), n_ctx=512, n_threads=2, verbose=False) for k, g in ggufs.items()}
    rates: dict[str, list[float]] = {k: [] for k in ggufs}
    for llm in llms.values():
        llm.create_completion("The", max_tokens=8, temperature=0.0)  # warm up
    for _ in range(rounds):
        for k, llm in llms.items():
            llm.reset()
            t0 = time.perf_counter()
            out = llm.create_completion(
                "The President said", max_tokens=tokens, temperature=0.0, logit_bias={2: -100.0}
            )
            rates[k].append(out["usage"]["completion_tokens"] / (time.perf_counter() - t0))
    return {k: sorted(v)[len(v) // 2] for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--steps", type=int, default=120, help="INT4 distillation steps")
    ap.add_argument("--steps-asym", type=int, help="INT4 asym distillation steps (default --steps)")
    ap.add_argument("--prune-steps", type=int, default=120, help="pruned-student training steps")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--curve-tokens", type=int, default=2048)
    ap.add_argument("--work-dir", default="/tmp/edgellm-bench-distill")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument(
        "--merge", action="store_true",
        help="keep the rows of parts not run from the earlier results in --out-dir",
    )  # fmt: skip
    args = ap.parse_args()
    if args.child:
        return child(args)

    from rich.console import Console

    from edgellm.entrypoints.llm import measure_ppl
    from edgellm.quantize.export_gguf import export_gguf
    from edgellm.registry import resolve_model

    console = Console()
    parts = [p for p in args.parts.split(",") if p]
    if bad := set(parts) - set(PARTS):
        raise SystemExit(f"unknown parts {bad} (choose from {PARTS})")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    def evaluate(model) -> dict:
        return {t: measure_ppl(str(model), t, args.eval_tokens) for t in TEXTS}

    def log(msg: str) -> None:
        console.print(f"[bold]{time.strftime('%H:%M:%S')}[/] {msg}")

    train = dict(batch=args.batch, seq_len=args.seq_len)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "rows": [], "curves": []}
    log("float teacher")
    res["rows"].append({"group": "float", "name": "float (dequantized Q4_1)", "bits": 16.0, **evaluate(resolve_model(None))})
    float_row = res["rows"][0]
    earlier = Path(args.out_dir, "distill.json")
    if args.merge and earlier.exists():
        old = json.loads(earlier.read_text())
        redo = {*parts, "float"} | ({"int4"} if any(p.startswith("int4") for p in parts) else set())
        res["kept"] = {"date": old["date"], "args": old["args"]}
        res["rows"] += [r for r in old["rows"] if r["group"] not in redo]
        res["curves"] += [c for c in old["curves"] if c["part"] not in redo]
    if any(p.startswith("int4") for p in parts):
        f16 = work / "f16.gguf"
        bench_quant.float_gguf(resolve_model(None), f16)
        for ft in ("Q4_0", "Q4_K_M"):
            out = work / f"{ft.lower()}.gguf"
            secs = bench_quant.llama_cpp_quantize(f16, out, ft)
            log(f"llama.cpp {ft}")
            res["rows"].append({"group": "int4", "name": f"llama.cpp {ft}", "bits": bench_quant.linear_bits(out), "seconds": secs, **evaluate(out)})  # fmt: skip
    for part in parts:
        if part.startswith("int4"):
            sym = part == "int4-sym"
            kind = "sym" if sym else "asym"
            made = {}
            for method in ("rtn", "awq", "gptq"):
                out = work / f"{method}-{kind}"
                log(f"{method} W4 g128 {kind}")
                meta = quantize_child(method, sym, out)
                made[method] = meta
                res["rows"].append({"group": part, "name": f"{method} W4 g128 {kind}", "method": method, "bits": meta["bits_per_weight"], "seconds": meta["seconds"], "peak_rss_mb": meta["peak_rss_mb"], **evaluate(out)})  # fmt: skip
            out = work / f"distilled-{kind}"
            steps = args.steps if sym or not args.steps_asym else args.steps_asym
            log(f"distil W4 g128 {kind} from AWQ, {steps} steps")
            job = {"kind": "distill", "out": str(out), "options": dict(student=str(work / f"awq-{kind}"), steps=steps, **train)}  # fmt: skip
            meta = run_child(job, args)
            recipe = made["awq"]["seconds"] + meta["seconds"]
            res["rows"].append({"group": part, "name": f"distilled W4 g128 {kind} (AWQ init, {meta['tokens'] // 1000}k tokens)", "method": "distilled", "bits": made["awq"]["bits_per_weight"], "seconds": recipe, "peak_rss_mb": max(meta["peak_rss_mb"], made["awq"]["peak_rss_mb"]), "kl": [meta["kl_before"], meta["kl_after"]], **evaluate(out)})  # fmt: skip
            res["curves"].append({"part": part, "name": f"KD W4 {kind}", "evals": meta["evals"]})
        else:
            pruned = work / part
            log(f"{part}: prune {PRUNES[part]}")
            meta = run_child({"kind": "prune", "out": str(pruned), "options": PRUNES[part]}, args)
            params = _params(pruned)
            ggufs = {}
            for tag, model in (("teacher", resolve_model(None)), ("pruned", pruned)):
                ggufs[tag] = work / f"{part}-{tag}-q8.gguf"
                export_gguf(str(model), ggufs[tag], "q8_0", force=True)
            rates = llama_decode_rates(ggufs)
            res["rows"].append({"group": part, "name": f"{part} (no training)", "method": "pruned", "params_m": params / 1e6, "seconds": meta["seconds"], "decode_tok_s": rates["pruned"], "teacher_decode_tok_s": rates["teacher"], **evaluate(pruned)})  # fmt: skip
            for loss in ("kl", "ce"):
                out = work / f"{part}-{loss}"
                log(f"{part}: {loss} training, {args.prune_steps} steps")
                job = {"kind": "distill", "out": str(out), "options": dict(student=str(pruned), loss=loss, steps=args.prune_steps, **train)}  # fmt: skip
                m = run_child(job, args)
                res["rows"].append({"group": part, "name": f"{part} + {'distillation (KL)' if loss == 'kl' else 'cross-entropy fine-tune'}", "method": loss, "params_m": params / 1e6, "seconds": m["seconds"], "peak_rss_mb": m["peak_rss_mb"], "tokens": m["tokens"], **evaluate(out)})  # fmt: skip
                res["curves"].append({"part": part, "name": f"{part} {loss.upper()}", "evals": m["evals"]})
        _write(res, float_row, args, console)


def _params(path: Path) -> int:
    import math

    from safetensors import safe_open

    n = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            n += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())
    return n


def recovered(rows: list[dict], row: dict, text: str) -> str:
    """INT4: share of RTN's loss over float won back. Pruned: share of the pruned-vs-float gap
    closed by training."""
    fl = rows[0][text]
    same = [r for r in rows if r["group"] == row["group"]]
    if row.get("method") in ("awq", "gptq", "distilled"):
        base = next(r for r in same if r.get("method") == "rtn")
    elif row.get("method") in ("kl", "ce"):
        base = next(r for r in same if r.get("method") == "pruned")
    else:
        return ""
    loss = base[text] - fl
    return f"{(base[text] - row[text]) / loss:.0%}" if loss > 0 else "n/a"


def markdown(res: dict, float_row: dict) -> str:
    rows = res["rows"]
    out = []
    int4 = [r for r in rows if r["group"] in ("float", "int4") or r["group"].startswith("int4")]
    if len(int4) > 1:
        out += [
            "| INT4 model | bits/weight (linears) | ppl sotu | ppl shakespeare | RTN loss recovered (sotu / shakespeare) | time s | peak RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in int4:
            rec = "/".join(x for x in (recovered(rows, r, t) for t in TEXTS) if x)
            out.append(f"| {r['name']} | {r['bits']:.2f} | {r['sotu']:.3f} | {r['shakespeare']:.3f} | {rec} | {r.get('seconds', float('nan')):.0f} | {r.get('peak_rss_mb', float('nan')):.0f} |")
    pr = [r for r in rows if r["group"].startswith("prune")]
    if pr:
        out += [
            "",
            "| pruned model | params M | ppl sotu | ppl shakespeare | gap closed (sotu / shakespeare) | training tokens | time s | llama.cpp decode tok/s (teacher) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            f"| float teacher | {134.5:.1f} | {float_row['sotu']:.3f} | {float_row['shakespeare']:.3f} | | | | |",
        ]
        for r in pr:
            rec = "/".join(x for x in (recovered(rows, r, t) for t in TEXTS) if x)
            dec = f"{r['decode_tok_s']:.0f} ({r['teacher_decode_tok_s']:.0f})" if "decode_tok_s" in r else ""
            out.append(f"| {r['name']} | {r['params_m']:.1f} | {r['sotu']:.3f} | {r['shakespeare']:.3f} | {rec} | {r.get('tokens', '')} | {r['seconds']:.0f} | {dec} |")
    return "\n".join(out)


def _write(res: dict, float_row: dict, args, console) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    order = ["float", "int4", *PARTS]
    res["rows"].sort(key=lambda r: order.index(r["group"]))  # stable: order within a part kept
    res["curves"].sort(key=lambda c: order.index(c["part"]))
    md = markdown(res, float_row)
    console.print(md)
    (out / "distill.md").write_text(md + "\n")
    (out / "distill.json").write_text(json.dumps(res, indent=2))
    plot(res, out / "distill.png")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({c["part"].split("-")[0] for c in res["curves"]})
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
    for ax, g in zip(axes[0], groups, strict=True):
        for c in (c for c in res["curves"] if c["part"].startswith(g)):
            pts = [(e["tokens"], e["ppl_sotu"]) for e in c["evals"] if "ppl_sotu" in e]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c["name"])
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel("perplexity, sotu 2000+ (windows of --seq-len)")
        ax.set_title("distillation into INT4" if g == "int4" else "pruned students: KL vs CE")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M on 2 CPU cores: perplexity while training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
