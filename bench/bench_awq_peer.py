"""Our AWQ against the reference AWQ (vLLM's llm-compressor) on the same float weights, the
same calibration tokens and the same evaluator: is a shortfall of AWQ ours or AWQ's?

Opt-in (never in CI): llm-compressor lives in its own virtual environment
(`make peers-llmcompressor`: it pins transformers <= 5.17 and compressed-tensors 0.19), and
the Qwen pair is a large download (../shared/MODELS.md). Per model, W4 symmetric group 128:

- float: the GGUF dequantized (F16), as in bench_scale.py;
- ours: `edgellm quantize` RTN and AWQ, each in its own process (seconds, peak RSS);
- llm-compressor: AWQ with its defaults (mappings inferred from the architecture, duo
  scaling, a grid of 20, the parent module's output error on every calibration token; no
  clipping search) and, as a control, its plain RTN (`bench/peer_awq.py`, in the peer's
  environment), from transformers' float32 dequantization of the same GGUF and on our own
  calibration windows (`calibration_tokens`, the mix, seed 0);
- every checkpoint exported to GGUF by `edgellm export gguf` (Q4_0 blocks, Q8_0 dense) and
  scored by one evaluator: our llama.cpp backend, windows of 512 over held-out State of the
  Union and Shakespeare (bench_scale.py's `step_ppl`).

The control (their RTN against ours) shows that the two float sources, the export and the
scoring agree, so the AWQ rows differ by the algorithm alone. llm-compressor's AWQ takes
about 7x our AWQ's time here (0.5B: 1,300 s; 1.5B: 4,579 s), so `--samples` defaults to 16
(ours: 32).

    python bench/bench_awq_peer.py --model qwen2.5-coder-0.5b   # bench/results/awq_peer.*
    python bench/bench_awq_peer.py --model qwen2.5-coder-1.5b   # awq_peer-qwen2.5-coder-1.5b.*

Each model has its own work directory (the steps' cache) and, other than the default, its
own result files.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_scale import TEXTS, Ctx, measured, step_export, step_float, step_ppl  # noqa: E402

PEER_PYTHON = Path.home() / ".cache/edgellm/peers/llm-compressor/bin/python"


def step_calib(ctx) -> dict:
    from edgellm.loaders.model import load_model
    from edgellm.quantize.calibration import calibration_tokens
    from edgellm.quantize.pipeline import QuantizeOptions

    opts = QuantizeOptions(calib=ctx.args.calib, n_samples=ctx.args.samples)
    tok = load_model(str(ctx.src)).tokenizer
    ids = calibration_tokens(
        tok, opts.calib, opts.n_samples, opts.seq_len, opts.seed, opts.chat_template
    )  # exactly the windows `edgellm quantize --samples N` calibrates on
    path = ctx.work / "calib.json"
    path.write_text(json.dumps({"calib": opts.calib, "seed": opts.seed,
                                "input_ids": [[int(t) for t in w] for w in ids]}))  # fmt: skip
    return {"path": str(path), "n_samples": len(ids), "seq_len": len(ids[0])}


def step_ours(ctx, method: str) -> dict:
    ckpt = ctx.work / f"ours-{method}"
    extra = ["--calib", ctx.args.calib, "--samples", str(ctx.args.samples)] if method != "rtn" else []
    q = measured(
        ctx.work / f"ours-{method}.json", "edgellm", "quantize", str(ctx.src), "-o", str(ckpt),
        "--method", method, "--group-size", "128", *extra, "--force",
    )  # fmt: skip
    return {"checkpoint": str(ckpt), **q}


def step_peer(ctx, method: str, calib: str) -> dict:
    ckpt = ctx.work / f"llmcompressor-{method}"
    cmd = [str(ctx.args.peer_python), str(Path(__file__).parent / "peer_awq.py"), str(ctx.src),
           calib, str(ckpt), "--method", method]  # fmt: skip
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return {"checkpoint": str(ckpt), **json.loads(ckpt.with_suffix(".json").read_text())}


def recovered(rows: dict, name: str, text: str) -> float | None:
    fl, rtn = rows["float (F16, dequantized Q4_K_M)"][text], rows["ours RTN"][text]
    return None if name.startswith("float") or rtn <= fl else (rtn - rows[name][text]) / (rtn - fl)


def run(args) -> dict:
    if not Path(args.peer_python).exists():
        raise SystemExit(f"no {args.peer_python}: make peers-llmcompressor first")
    args.seed, args.redo = None, args.redo or []
    ctx = Ctx(args)
    calib = ctx.step("calib", step_calib)
    rows = {"float (F16, dequantized Q4_K_M)": ctx.step("float", step_float)}
    for method in ("rtn", "awq"):
        rows[f"ours {method.upper()}"] = ctx.step(f"ours {method}", step_ours, method)
    for method in ("rtn", "awq"):  # the slow one last: the others' figures land first
        rows[f"llm-compressor {method.upper()}"] = ctx.step(
            f"llm-compressor {method}", step_peer, method, calib["path"]
        )
    for name, row in rows.items():
        if "checkpoint" in row:
            row.update(ctx.step(f"export {name}", step_export, row["checkpoint"]))
        row.update(ctx.step(f"ppl {name}", step_ppl, row["path"]))
    return {"model": args.model, "calibration": calib, "rows": rows}


def markdown(res: dict, command: str) -> str:
    rows, c = res["rows"], res["calibration"]
    lines = [
        f"{res['model']}, W4 symmetric group 128, {c['n_samples']} x {c['seq_len']} calibration "
        f"tokens (the mix) for both AWQs; `{command}` ({res['machine']['cpu']}, "
        f"{os.cpu_count()} cores).",
        "",
        "| row | ppl sotu | ppl shakespeare | our RTN's loss recovered (sotu / shakespeare) "
        "| quantize s | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        rec = [recovered(rows, name, t) for t in TEXTS]
        rec_s = " / ".join(f"{x:.0%}" for x in rec) if None not in rec else ""
        secs = r.get("seconds")
        lines.append(
            f"| {name} | {r['sotu']:.3f} | {r['shakespeare']:.3f} | {rec_s} | "
            + (" |  |" if name.startswith("float") else f"{secs:.0f} | {r['peak_rss_mb']:.0f} |")
        )
    v = rows["llm-compressor AWQ"].get("versions", {})
    lines += ["", "llm-compressor " + ", ".join(f"{k} {x}" for k, x in v.items()) + ". Seconds "
              "and peak RSS are each quantizer's whole process: ours `edgellm quantize` from the "
              "GGUF; llm-compressor's from its float32 copy of the same weights (saved once by "
              "transformers' GGUF loader) through `oneshot` to the saved checkpoint."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = [n for n in rows if not n.startswith("float")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, text in zip(axes, TEXTS, strict=True):
        vals = [rows[n][text] for n in names]
        colors = ["tab:gray" if "RTN" in n else "tab:blue" if n.startswith("ours") else
                  "tab:red" for n in names]  # fmt: skip
        ax.barh(names, vals, color=colors)
        ax.axvline(rows["float (F16, dequantized Q4_K_M)"][text], color="k", ls="--", lw=1,
                   label="float")  # fmt: skip
        lo = min(vals + [rows["float (F16, dequantized Q4_K_M)"][text]])
        ax.set_xlim(lo * 0.97, max(vals) * 1.01)
        ax.set_xlabel(f"perplexity, {text} (lower is better)")
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{res['model']} W4 g128: our AWQ vs llm-compressor's, same weights and tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--samples", type=int, default=16, help="calibration windows of 512 tokens")
    ap.add_argument("--calib", default="mix")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--eval-tokens", type=int, default=4096, help="tokens scored per text")
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--redo", nargs="*", default=[], help="steps to run again (name contains)")
    ap.add_argument("--work-dir", help="the steps' cache (default: per model, under /tmp)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    suffix = "" if args.model == ap.get_default("model") else f"-{args.model}"
    args.work_dir = args.work_dir or f"/tmp/edgellm-bench-awq-peer{suffix}"
    stem = f"awq_peer{suffix}"
    command = "python " + shlex.join(["bench/bench_awq_peer.py", *argv])
    t0 = time.perf_counter()
    res = run(args)
    from bench_generate import machine_info

    res["machine"] = machine_info(args.threads)
    res["command"], res["wall_s"] = command, time.perf_counter() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2))
    md = markdown(res, command)
    (args.out_dir / f"{stem}.md").write_text(md)
    plot(res, args.out_dir / f"{stem}.png")
    print(md)


if __name__ == "__main__":
    main()
