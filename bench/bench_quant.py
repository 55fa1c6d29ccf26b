"""Quantization quality on SmolLM2: float vs RTN vs AWQ vs GPTQ vs llama.cpp's quantizer.

The float reference is SmolLM2's dequantized weights (they were stored as Q4_1,
group 32 asymmetric, so group-32 asymmetric RTN is artificially near-lossless:
the headline is group 128). Every model is scored by the same evaluator (our
torch backend, strided perplexity, ctx 512) on held-out State of the Union
addresses (2000 on) and on Shakespeare (every other work); calibration (`--calib`, default
`mix`) draws from the addresses before 2000 and the other works.
llama.cpp's own quantizer (`llama_model_quantize`, Q4_0 and Q4_K_M) starts from
an F16 GGUF of the same float weights. Each quantization runs in its own process,
so its time and peak memory are its own.

    python bench/bench_quant.py                 # writes bench/results/quant.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [  # (method, bits, group, symmetric)
    *[(m, b, 128, s) for b in (4, 3) for s in (True, False) for m in ("rtn", "awq", "gptq")],
    *[(m, 4, 32, True) for m in ("rtn", "awq", "gptq")],  # 4.5 bits/weight, beside Q4_0
]
TEXTS = ("sotu", "shakespeare")


def name(method, bits, group, sym) -> str:
    return f"{method}-w{bits}g{group}-{'sym' if sym else 'asym'}"


def run_one(args) -> None:
    """Child process: quantize one configuration and report time and peak memory."""
    from edgellm.quantize import QuantizeOptions, quantize

    method, bits, group, sym = args.one.split(",")
    opts = QuantizeOptions(
        method, int(bits), int(group), sym == "sym", calib=args.calib, n_samples=args.samples,
        seq_len=args.seq_len,
    )
    r = quantize(None, args.out, opts, force=True, progress=False)
    Path(args.out, "bench.json").write_text(
        json.dumps(
            {
                "seconds": r.seconds,
                "peak_rss_mb": r.peak_rss_mb,
                "bits_per_weight": r.bits_per_weight,
            }
        )
    )


def float_gguf(src: Path, out: Path) -> None:
    """The same weights as an F16/F32 GGUF (metadata copied), input for llama.cpp's quantizer."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).reshape(
            [int(s) for s in reversed(t.shape.tolist())]
        )
        writer.add_tensor(t.name, w.astype(np.float16 if w.ndim == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_quantize(src: Path, out: Path, ftype_name: str) -> float:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = os.cpu_count()
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")
    return time.perf_counter() - t0


def linear_bits(path: Path) -> float:
    """Bits per weight over the decoder layers' linear tensors of a GGUF."""
    import gguf

    r = gguf.GGUFReader(path)
    nbits = nparams = 0
    for t in r.tensors:
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            nparams += int(t.n_elements)
            nbits += 8 * int(t.n_bytes)
    return nbits / nparams


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--calib", default="mix", help="calibration text of AWQ and GPTQ")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--work-dir", default="/tmp/edgellm-bench-quant")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--only", help="comma-separated config names (default: all)")
    args = ap.parse_args()
    if args.one:
        return run_one(args)

    from rich.console import Console
    from rich.progress import Progress

    from edgellm.entrypoints.llm import measure_ppl
    from edgellm.registry import resolve_model

    console = Console()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    configs = [c for c in CONFIGS if not args.only or name(*c) in args.only.split(",")]
    rows = []
    with Progress(console=console) as bar:
        task = bar.add_task("quantize + evaluate", total=len(configs) + 3)

        def evaluate(model) -> dict:
            return {t: measure_ppl(str(model), t, args.eval_tokens) for t in TEXTS}

        rows.append(
            {"name": "float (dequantized Q4_1)", "bits": 32.0, **evaluate(resolve_model(None))}
        )
        bar.advance(task)
        f16 = work / "f16.gguf"
        float_gguf(resolve_model(None), f16)
        for ft in ("Q4_0", "Q4_K_M"):
            out = work / f"{ft.lower()}.gguf"
            secs = llama_cpp_quantize(f16, out, ft)
            rows.append(
                {
                    "name": f"llama.cpp {ft}",
                    "bits": linear_bits(out),
                    "seconds": secs,
                    **evaluate(out),
                }
            )
            bar.advance(task)
        for cfg in configs:
            out = work / name(*cfg)
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    ",".join(map(str, cfg[:3])) + ("," + ("sym" if cfg[3] else "asym")),
                    "--out",
                    str(out),
                    "--samples",
                    str(args.samples),
                    "--seq-len",
                    str(args.seq_len),
                    "--calib",
                    args.calib,
                ],
                check=True,
            )
            meta = json.loads((out / "bench.json").read_text())
            rows.append(
                {
                    "name": name(*cfg),
                    "method": cfg[0],
                    "bits": meta["bits_per_weight"],
                    "seconds": meta["seconds"],
                    "peak_rss_mb": meta["peak_rss_mb"],
                    **evaluate(out),
                }
            )
            bar.advance(task)
    report(rows, args, console)


def recovered(rows: list[dict], row: dict, text: str) -> str:
    """Share of RTN's perplexity loss (over float) that a method wins back, same config."""
    if row.get("method") in (None, "rtn"):
        return ""
    base = next((r for r in rows if r["name"] == row["name"].replace(row["method"], "rtn", 1)), None)
    if base is None:  # --only without the RTN row of the same config
        return ""
    fl = rows[0][text]
    loss = base[text] - fl
    return f"{(base[text] - row[text]) / loss:.0%}" if loss > 0 else "n/a"


def report(rows, args, console) -> None:
    head = (
        "| model | bits/weight (linears) | ppl sotu | ppl shakespeare | RTN loss recovered (sotu / shakespeare) "
        "| time s | peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        rec = "/".join(
            x for x in (recovered(rows, r, "sotu"), recovered(rows, r, "shakespeare")) if x
        )
        lines.append(
            f"| {r['name']} | {r['bits']:.2f} | {r['sotu']:.3f} | {r['shakespeare']:.3f} | {rec} | "
            f"{r.get('seconds', float('nan')):.1f} | {r.get('peak_rss_mb', float('nan')):.0f} |"
        )
    md = "\n".join(lines)
    console.print(md)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant.md").write_text(md + "\n")
    (out / "quant.json").write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "calib": args.calib,
                "samples": args.samples,
                "seq_len": args.seq_len,
                "eval_tokens": args.eval_tokens,
                "rows": rows,
            },
            indent=2,
        )
    )
    plot(rows, out / "quant.png")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"rtn": "tab:gray", "awq": "tab:blue", "gptq": "tab:orange"}
    for r in rows[1:]:
        c = colors.get(r.get("method"), "tab:red")
        ax.scatter(r["bits"], r["sotu"], color=c, marker="o" if "asym" not in r["name"] else "^")
        ax.annotate(
            r["name"], (r["bits"], r["sotu"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.axhline(rows[0]["sotu"], color="k", ls="--", lw=1, label="float")
    ax.set_xlabel("bits per weight (decoder linears)")
    ax.set_ylabel("perplexity, held-out SOTU (lower is better)")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M: quantizers at equal bits")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
