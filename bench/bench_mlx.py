"""edgellm's MLX backend beside mlx-lm on the same exported model, side by side in one run.

Model: SmolLM2-135M-Instruct quantized by edgellm (AWQ W4 g64, symmetric), exported with
`edgellm export mlx` (exactly: same weights), float tensors in the dtype both sides compute
in (float32 on a CPU, bfloat16 on Metal). edgellm runs the edgellm checkpoint (`-b mlx`),
mlx-lm the export; greedy, EOS ignored, the same token ids on both sides.

    single stream   decode tok/s = (N - 1) / (time from the first to the N-th token):
                    edgellm's engine ÷ `mlx_lm.stream_generate` (alternating, best of R)
    16 concurrent   aggregate tok/s = requests x N / wall time (prefill included):
                    `LLM.generate` of all prompts ÷ `mlx_lm.batch_generate`
    shared prefix   the same, every prompt starting with one long system prefix: edgellm's
                    prefix cache computes it once, mlx-lm's batch prefills it per request
    KV memory       the most K/V the run held: our blocks in use x block bytes, vs the
                    `nbytes` of mlx-lm's batch cache (left-padded, grown 256 tokens at a time)

    python bench/bench_mlx.py             # writes bench/results/mlx.{json,md,png}
    python bench/bench_mlx.py --quick     # fewer tokens, one repeat (a smoke run)

On this Linux machine MLX is its CPU build (reference BLAS, about 2 GFLOP/s single-threaded
matmuls), so absolute rates are low on both sides; the ratios are the result. On a Mac the
same script measures Metal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx.core as mx  # noqa: E402
from bench_generate import machine_info  # noqa: E402

from edgellm import LLM, SamplingParams  # noqa: E402
from edgellm.backends.mlx import on_gpu  # noqa: E402
from edgellm.loaders.texts import load_text  # noqa: E402
from edgellm.quantize import QuantizeOptions, quantize  # noqa: E402
from edgellm.quantize.export_mlx import export_mlx  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts(tok, n: int, length: int, prefix_len: int = 0) -> list[list[int]]:
    """n prompts of `length` tokens from held-out State of the Union text, each after the
    same `prefix_len`-token prefix (a system prompt shared by every request)."""
    ids = tok.encode(load_text("sotu")[-200_000:])
    prefix = ids[:prefix_len]
    body = ids[prefix_len:]
    return [prefix + body[i * length : (i + 1) * length] for i in range(n)]


# ---- edgellm -------------------------------------------------------------------------------------
def ours_single(llm: LLM, ids: list[int], n: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(ids, params)
    t1 = None
    while engine.has_unfinished():
        engine.step()
        if t1 is None:
            t1 = time.perf_counter()  # the first token is out
    rate = (n - 1) / (time.perf_counter() - t1)
    engine.pop_output(rid)
    return rate


def ours_batch(llm: LLM, batch: list[list[int]], n: int) -> tuple[float, list, int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    bm = engine.block_manager
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in batch]
    peak_blocks = 0
    while engine.has_unfinished():
        engine.step()
        peak_blocks = max(peak_blocks, bm.num_blocks - bm.num_free)
    wall = time.perf_counter() - t0
    outs = [engine.pop_output(i).outputs[0].token_ids for i in ids]
    return len(batch) * n / wall, outs, peak_blocks


# ---- mlx-lm --------------------------------------------------------------------------------------
def theirs_single(model, tok, ids: list[int], n: int) -> float:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    t1, k = None, 0
    for _ in stream_generate(model, tok, ids, max_tokens=n, sampler=make_sampler(temp=0.0)):
        k += 1
        if t1 is None:
            t1 = time.perf_counter()
    assert k == n, f"mlx-lm stopped after {k} tokens"
    return (n - 1) / (time.perf_counter() - t1)


def theirs_batch(model, tok, batch: list[list[int]], n: int) -> tuple[float, list, int]:
    """`mlx_lm.batch_generate`'s loop (its BatchGenerator, greedy, no stop tokens), watching
    the K/V its batch cache holds after every step (the most it held is returned)."""
    from mlx_lm.generate import BatchGenerator

    t0 = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=[])
    uids = gen.insert(batch, [n] * len(batch))
    toks = {u: [] for u in uids}
    held = 0
    while responses := gen.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                toks[r.uid].append(r.token)
        held = max(held, sum(c.nbytes for c in gen._generation_batch.prompt_cache))
    gen.close()
    wall = time.perf_counter() - t0
    return len(batch) * n / wall, [toks[u] for u in uids], held


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--checkpoint", help="an existing edgellm INT4 checkpoint (default: make one)")
    ap.add_argument("--out", default=str(RESULTS / "mlx"))
    a = ap.parse_args()
    n_single, n_batch, repeats = (16, 8, 1) if a.quick else (48, 16, 3)
    conc, length, prefix_len = 16, 24, 96
    dtype = "bfloat16" if on_gpu() else "float32"
    work = Path(tempfile.mkdtemp(prefix="edgellm-bench-mlx-"))
    ckpt = Path(a.checkpoint) if a.checkpoint else work / "awq"
    if not a.checkpoint:
        log("quantizing SmolLM2 (AWQ W4 g64 sym) ...")
        quantize("smollm2-135m", str(ckpt), QuantizeOptions("awq", group_size=64), progress=False)
    export, weights = export_mlx(ckpt, work / "mlx", dtype=dtype)
    log(f"exported to {export} (floats {dtype}, scales {weights.scale_dtype})")

    from mlx_lm import load

    model, tok = load(str(export))
    tok.eos_token_ids = []  # EOS ignored on both sides: the same work
    llm = LLM(str(ckpt), backend="mlx", dtype=dtype, kv_cache_mb=256)
    ptoks = prompts(llm.tokenizer, conc, length)
    res: dict = {"meta": {**machine_info(1), "mlx": mx.__version__, "device": str(mx.default_device()),
                          "dtype": dtype, "checkpoint": "SmolLM2-135M AWQ W4 g64 sym",
                          "n_single": n_single, "n_batch": n_batch, "concurrency": conc,
                          "prompt_len": length, "prefix_len": prefix_len}}  # fmt: skip

    log("single stream ...")
    ours_s, theirs_s = [], []
    for _ in range(repeats):  # alternating, so drifts of the machine hit both
        ours_s.append(ours_single(llm, ptoks[0], n_single))
        theirs_s.append(theirs_single(model, tok, ptoks[0], n_single))
        log(f"  edgellm {ours_s[-1]:.2f} tok/s, mlx-lm {theirs_s[-1]:.2f} tok/s")
    res["single"] = {"edgellm": max(ours_s), "mlx_lm": max(theirs_s), "runs": [ours_s, theirs_s]}

    per_token = llm.engine.backend.kv.nbytes / (llm.engine.backend.num_blocks * llm.engine.backend.block_size)
    for name, batch in (("concurrent", ptoks),
                        ("shared_prefix", prompts(llm.tokenizer, conc, length, prefix_len))):  # fmt: skip
        log(f"{name}: {conc} requests x {n_batch} tokens ...")
        llm = LLM(str(ckpt), backend="mlx", dtype=dtype, kv_cache_mb=256)  # an empty cache
        mx.reset_peak_memory()
        o_rate, o_toks, o_blocks = ours_batch(llm, batch, n_batch)
        o_peak = mx.get_peak_memory()
        mx.reset_peak_memory()
        t_rate, t_toks, t_kv = theirs_batch(model, tok, batch, n_batch)
        t_peak = mx.get_peak_memory()
        tokens = sum(len(p) for p in batch) + conc * n_batch
        res[name] = {
            "edgellm": o_rate, "mlx_lm": t_rate, "agreement": agreement(o_toks, t_toks),
            "kv_edgellm_bytes": o_blocks * llm.engine.backend.block_size * per_token,
            "kv_mlx_lm_bytes": t_kv, "tokens": tokens,
            "peak_edgellm_bytes": o_peak, "peak_mlx_lm_bytes": t_peak,
            "pool_bytes": llm.engine.backend.kv.nbytes,
        }  # fmt: skip
        log(f"  edgellm {o_rate:.2f} tok/s, mlx-lm {t_rate:.2f} tok/s, same tokens "
            f"{res[name]['agreement']:.0%}")  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    out.with_suffix(".md").write_text(table(res))
    plot(res, out.with_suffix(".png"))
    print(table(res))


def table(res: dict) -> str:
    m = res["meta"]
    rows = [
        "| scenario | edgellm -b mlx | mlx-lm | ratio | greedy tokens equal |",
        "|---|---|---|---|---|",
    ]
    s = res["single"]
    rows.append(f"| single stream decode, {m['n_single']} tokens | {s['edgellm']:.2f} tok/s | "
                f"{s['mlx_lm']:.2f} tok/s | **{s['edgellm'] / s['mlx_lm']:.2f}x** | |")  # fmt: skip
    for key, label in (("concurrent", f"{m['concurrency']} concurrent x {m['n_batch']} tokens"),
                       ("shared_prefix", f"{m['concurrency']} concurrent, {m['prefix_len']}-token "
                                         "shared prefix")):  # fmt: skip
        r = res[key]
        rows.append(f"| {label} | {r['edgellm']:.2f} tok/s | {r['mlx_lm']:.2f} tok/s | "
                    f"**{r['edgellm'] / r['mlx_lm']:.2f}x** | {r['agreement']:.0%} of requests |")  # fmt: skip
    rows += ["", "| KV cache held | edgellm (paged, blocks of 16) | mlx-lm | ratio |", "|---|---|---|---|"]
    for key in ("concurrent", "shared_prefix"):
        r = res[key]
        rows.append(f"| {key.replace('_', ' ')}: {r['tokens']} tokens | "
                    f"{r['kv_edgellm_bytes'] / 2**20:.1f} MiB ({r['kv_edgellm_bytes'] / r['tokens'] / 1024:.1f} KiB/token) | "
                    f"{r['kv_mlx_lm_bytes'] / 2**20:.1f} MiB ({r['kv_mlx_lm_bytes'] / r['tokens'] / 1024:.1f} KiB/token) | "
                    f"{r['kv_edgellm_bytes'] / r['kv_mlx_lm_bytes']:.2f}x |")  # fmt: skip
    rows.append("")
    for key in ("concurrent", "shared_prefix"):
        r = res[key]
        rows.append(f"MLX peak memory, {key.replace('_', ' ')}: edgellm {r['peak_edgellm_bytes'] / 2**20:.0f} MiB "
                    f"(weights + its whole {r['pool_bytes'] / 2**20:.0f} MiB pool, allocated up front), "
                    f"mlx-lm {r['peak_mlx_lm_bytes'] / 2**20:.0f} MiB.")  # fmt: skip
    rows.append("")
    rows.append(f"MLX {m['mlx']} on {m['device']} ({m['cpu']}), {m['dtype']}; {m['checkpoint']}, "
                "exported with `edgellm export mlx`; greedy, EOS ignored; throughput includes "
                "prefill.")  # fmt: skip
    return "\n".join(rows) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("single", "single stream"), ("concurrent", "16 concurrent"),
            ("shared_prefix", "16 concurrent,\nshared prefix")]  # fmt: skip
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [res[k]["edgellm"] for k, _ in keys], 0.4, label="edgellm -b mlx")
    ax.bar([x + 0.2 for x in xs], [res[k]["mlx_lm"] for k, _ in keys], 0.4, label="mlx-lm")
    ax.set_xticks(list(xs), [lbl for _, lbl in keys])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"SmolLM2-135M AWQ W4 g64, MLX on {res['meta']['device']}")
    ax.legend()
    kv = [("concurrent", "16 concurrent"), ("shared_prefix", "shared prefix")]
    ax2.bar([x - 0.2 for x in range(2)], [res[k]["kv_edgellm_bytes"] / 2**20 for k, _ in kv], 0.4,
            label="edgellm (paged)")  # fmt: skip
    ax2.bar([x + 0.2 for x in range(2)], [res[k]["kv_mlx_lm_bytes"] / 2**20 for k, _ in kv], 0.4,
            label="mlx-lm")  # fmt: skip
    ax2.set_xticks(range(2), [lbl for _, lbl in kv])
    ax2.set_ylabel("KV cache held (MiB)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
