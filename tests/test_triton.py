"""Our Triton kernels against their torch twins, and the CUDA backend through the engine.

Without a GPU everything runs on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`,
set in conftest before triton is imported), in float32: the same kernel code, no bf16 math.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import cuda_backend, run_all, tiny_hf_model, triton_runs

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_runs(), reason="needs Triton (a GPU or TRITON_INTERPRET=1)"),
]

if triton_runs():
    from edgellm.backends import cuda as cuda_mod
    from edgellm.backends.torch import TorchBackend
    from edgellm.config import EngineConfig
    from edgellm.engine.engine import Engine
    from edgellm.errors import InvalidParameterError
    from edgellm.kernels.int4_matmul import dequantize_matmul, dequantize_weight
    from edgellm.kernels.paged_attention import AttentionMetadata, paged_attention
    from edgellm.kernels.triton_attention import paged_attention_triton, paged_decode_triton
    from edgellm.kernels.triton_fused import (
        rms_norm,
        rms_norm_ref,
        rope_and_cache,
        rope_and_cache_ref,
        silu_and_mul,
        silu_and_mul_ref,
    )
    from edgellm.kernels.triton_w4a16 import (
        W4A16Weight,
        dequantize_w4a16,
        prepare_w4a16,
        w4a16_matmul,
    )
    from edgellm.quantize.format import QuantConfig, pack_int32
    from edgellm.sampling.params import SamplingParams
    from tests.conftest import byte_tokenizer, ours_from_hf

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_w4(n, k, group, symmetric, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.05 + 0.005
    zero = None if symmetric else torch.randint(-8, 8, (n, k // group), generator=g).to(torch.int8)
    w = prepare_w4a16(pack_int32(q, 4), scale, zero, k, DEV, torch.float32)
    return w, q, scale, zero


# (M, N, K, group, symmetric): K = 576 (SmolLM2), N off the tile, every group, both kinds,
# GEMV rows (M <= 4) and tensor-core tiles (M > 4), a per-channel group
W4_CASES = [
    (1, 100, 576, 64, True),
    (1, 72, 576, 32, False),
    (3, 96, 256, 128, False),
    (4, 40, 576, 576, True),
    (7, 50, 384, 128, True),
    (16, 70, 576, 64, False),
    (33, 24, 128, 32, True),
]


@pytest.mark.parametrize("m,n,k,group,symmetric", W4_CASES)
def test_w4a16_matches_dequantize_then_matmul(m, n, k, group, symmetric):
    w, q, scale, zero = random_w4(n, k, group, symmetric, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEV)
    bias = torch.randn(n).to(DEV)
    got = w4a16_matmul(x, w, bias, force_kernel=True)
    want = dequantize_matmul(x.cpu(), q, scale, zero, bias.cpu())
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got.cpu(), want, atol=2e-4 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("split", [2, 3, 9])
def test_w4a16_split_k_sums_to_the_same(split):
    w, q, scale, zero = random_w4(48, 576, 64, False)
    x = torch.randn(2, 576).to(DEV)
    bias = torch.randn(48).to(DEV)
    one = w4a16_matmul(x, w, bias, split_k=1)
    many = w4a16_matmul(x, w, bias, split_k=split)
    torch.testing.assert_close(many, one, atol=1e-4 * one.abs().max(), rtol=0)
    # deterministic: partial sums are summed in a fixed order, never by atomics
    assert torch.equal(many, w4a16_matmul(x, w, bias, split_k=split))


def test_w4a16_half_activations_and_dequantize_kernel():
    w, q, scale, zero = random_w4(40, 256, 32, False)
    dense = dequantize_w4a16(w, torch.float32)
    assert torch.equal(dense.cpu(), dequantize_weight(q, scale, zero))  # exact
    x = torch.randn(3, 256).to(DEV).half()
    got = w4a16_matmul(x, w)
    assert got.dtype == torch.float16
    want = x.float().cpu() @ dequantize_weight(q, scale, zero).t()
    torch.testing.assert_close(got.float().cpu(), want, atol=5e-3 * want.abs().max(), rtol=0)


def test_w4a16_fused_projection_equals_the_parts():
    parts = [random_w4(n, 192, 64, False, seed=n)[0] for n in (32, 16, 16)]
    fused = W4A16Weight.concat(parts)
    x = torch.randn(2, 192).to(DEV)
    want = torch.cat([w4a16_matmul(x, p) for p in parts], dim=1)
    torch.testing.assert_close(w4a16_matmul(x, fused), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="fuse"):
        W4A16Weight.concat([parts[0], random_w4(8, 192, 64, True)[0]])


def paged_case(ctx, q_lens, block_size=16, heads=6, kv_heads=2, d=32, seed=0):
    """A random pool, block tables (two sequences share prefix blocks) and queries."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in ctx]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n])
        i += n
    if len(tables) > 1 and min(need[0], need[1]) >= 2:
        tables[1][:2] = tables[0][:2]  # a shared prefix
    width = max(need)
    bt = torch.zeros(len(ctx), width, dtype=torch.long)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], heads, d, generator=g)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), qsl, list(ctx), bt)
    return q, k_cache, v_cache, meta


def on_dev(*ts):
    return [t.to(DEV) for t in ts]


@pytest.mark.parametrize(
    "ctx,q_lens,block_size",
    [
        ([37, 5, 100, 64], [1, 5, 17, 4], 16),  # decode, whole prompt, prefill chunk, verify
        ([70, 70, 9], [4, 1, 9], 16),
        ([23, 41], [23, 3], 5),  # a block size that is no power of two
    ],
)
def test_paged_attention_mixed_batch_matches_reference(ctx, q_lens, block_size):
    q, kc, vc, meta = paged_case(ctx, q_lens, block_size)
    want = paged_attention(q, kc, vc, meta, 0.17)
    q2, kc2, vc2 = on_dev(q, kc, vc)
    got = paged_attention_triton(
        q2, kc2, vc2, meta.block_tables.int().to(DEV),
        torch.tensor(ctx, dtype=torch.int32, device=DEV),
        torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEV),
        max(q_lens), 0.17,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_kv_decode_matches_reference(splits):
    ctx = [37, 130, 1, 64]
    q, kc, vc, meta = paged_case(ctx, [1] * len(ctx), heads=6, kv_heads=2)
    want = paged_attention(q, kc, vc, meta, 0.125)
    q2, kc2, vc2 = on_dev(q, kc, vc)
    bt = meta.block_tables.int().to(DEV)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    got = paged_decode_triton(q2, kc2, vc2, bt, lens, 0.125, splits)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
    # a padded row (context 0, as in a CUDA graph's spare slots) computes zeros
    lens[2] = 0
    padded = paged_decode_triton(q2, kc2, vc2, bt, lens, 0.125, splits)
    assert torch.equal(padded[2].cpu(), torch.zeros_like(padded[2].cpu()))
    torch.testing.assert_close(padded[[0, 1, 3]].cpu(), want[[0, 1, 3]], atol=1e-5, rtol=0)


def test_fused_small_ops_match_their_twins():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96)
    r1, r2 = r.clone().to(DEV), r.clone()
    got = rms_norm(x.to(DEV), w.to(DEV), 1e-6, r1)
    torch.testing.assert_close(got.cpu(), rms_norm_ref(x, w, 1e-6, r2), atol=1e-5, rtol=0)
    torch.testing.assert_close(r1.cpu(), r2)  # the residual became x + r
    plain = rms_norm(x.to(DEV), w.to(DEV), 1e-6)
    torch.testing.assert_close(plain.cpu(), rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=0)
    y = torch.randn(4, 140, generator=g)
    torch.testing.assert_close(
        silu_and_mul(y.to(DEV)).cpu(), silu_and_mul_ref(y), atol=1e-6, rtol=0
    )
    heads, kvh, d = 6, 2, 32
    qkv = torch.randn(7, (heads + 2 * kvh) * d, generator=g)
    pos = torch.tensor([0, 1, 2, 50, 51, 9, 300])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    slots = torch.tensor([3, 4, 5, 17, 18, -1, 39])  # -1: a padding row writes nothing
    kc, vc = torch.zeros(10, 4, kvh, d), torch.zeros(10, 4, kvh, d)
    kc2, vc2 = kc.clone().to(DEV), vc.clone().to(DEV)
    want = rope_and_cache_ref(qkv, pos, inv, kc, vc, slots, heads)
    got = rope_and_cache(qkv.to(DEV), pos.to(DEV), inv.to(DEV), kc2, vc2, slots.to(DEV), heads)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(kc2.cpu(), kc, atol=1e-5, rtol=0)
    assert torch.equal(vc2.cpu(), vc)


# ---- the backend ---------------------------------------------------------------------------
GQA = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)  # 3:1, head_dim 16


def quantize_in_place(model, qcfg):
    """Every decoder Linear of `model` becomes a 4-bit QuantLinear (round to nearest)."""
    from edgellm.quantize.linear import swap_linears
    from edgellm.quantize.rtn import quantize_rtn

    linears = {
        n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }
    saved = {n: (quantize_rtn(m.weight.detach(), qcfg), m.bias) for n, m in linears.items()}
    swap_linears(model, qcfg, include=set(linears))
    for name, (qw, bias) in saved.items():
        mod = model.get_submodule(name)
        mod.weight_packed.copy_(pack_int32(qw.q, 4))
        mod.weight_scale.copy_(qw.scale)
        if qw.zero is not None:
            mod.weight_zero_point.copy_(pack_int32(qw.zero, 4, dim=0))
        if bias is not None:
            mod.bias.data.copy_(bias.detach())
    return model


def engine_pair(model_type="qwen2", qcfg=None, **cfg):
    """The same tiny model (GQA 3:1) under the torch reference and the CUDA backend."""
    hf, config = tiny_hf_model(model_type, **GQA)
    config_e = EngineConfig(**{"kv_cache_mb": 1.0, "block_size": 4, **cfg})
    out = []
    for make in (TorchBackend, cuda_backend):
        model = ours_from_hf(hf, config)
        if qcfg is not None:
            quantize_in_place(model, qcfg)
        out.append(Engine(make(model, config_e), byte_tokenizer(), config_e))
    return out


def test_backend_greedy_matches_torch_batched_equals_alone_nothing_left():
    ref, ours = engine_pair()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["hello there", "a", "the quick brown fox jumps"]
    want = [o.outputs[0].token_ids for o in run_all(ref, prompts, greedy)]
    together = [o.outputs[0].token_ids for o in run_all(ours, prompts, greedy)]
    alone = [run_all(ours, [p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert together == want
    assert alone == together
    bm = ours.block_manager
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks


@pytest.mark.parametrize("symmetric", [True, False])
def test_backend_runs_int4_checkpoints_on_the_kernel(symmetric, monkeypatch):
    """A quantized model: every projection on the W4A16 kernel, scores as the reference's
    (torch's dequantize-then-matmul twin in float32, not its bf16 CPU int4 kernel)."""
    from edgellm.quantize.linear import QuantLinear

    monkeypatch.setattr(QuantLinear, "use_fast", False)
    ref, ours = engine_pair("llama", QuantConfig(4, 32, symmetric))
    b = ours.backend
    layers = b.model.layers
    kinds = {
        type(p).__name__
        for layer in layers
        for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    }
    assert kinds == {"QuantProjection"} and not b.fallbacks
    ids = list(b"int4 on the kernel")
    torch.testing.assert_close(ours.score(ids), ref.score(ids), atol=1e-4, rtol=0)


def test_quantized_lm_head_and_widths_the_kernel_cannot_take(monkeypatch):
    from edgellm.quantize.linear import QuantLinear

    monkeypatch.setattr(QuantLinear, "use_fast", False)
    hf, config = tiny_hf_model("llama", **GQA)
    config_e = EngineConfig(kv_cache_mb=1.0, block_size=4, quantize_lm_head=True)
    model = quantize_in_place(ours_from_hf(hf, config), QuantConfig(4, 32, True))
    b = cuda_backend(model, config_e)
    assert type(b.model.lm_head).__name__ == "QuantProjection"
    # the head's INT4 error is small against the float head's logits
    ref = Engine(TorchBackend(model, config_e), byte_tokenizer(), config_e)
    ids = list(b"quantized head")
    got = Engine(b, byte_tokenizer(), config_e).score(ids)
    want = ref.score(ids)
    assert (got - want).abs().mean() < 0.05 * want.abs().mean()
    # 8-bit layers: the kernel takes 4 bits only; dense fallback with a warning, same answer
    model8 = ours_from_hf(hf, config)
    quantize_in_place8 = _quantize8(model8)
    with pytest.warns(UserWarning, match="cannot take"):
        b8 = cuda_backend(quantize_in_place8, EngineConfig(kv_cache_mb=1.0, block_size=4))
    assert b8.fallbacks
    ref8 = Engine(
        TorchBackend(quantize_in_place8, config_e.replace(quantize_lm_head=False)),
        byte_tokenizer(),
        config_e,
    )
    got8 = Engine(b8, byte_tokenizer(), config_e).score(ids)
    torch.testing.assert_close(got8, ref8.score(ids), atol=1e-4, rtol=0)


def _quantize8(model):
    from edgellm.quantize.linear import swap_linears
    from edgellm.quantize.rtn import quantize_rtn

    qcfg = QuantConfig(8, 32, True)
    name = "model.layers.0.mlp.down_proj"
    lin = model.get_submodule(name)
    qw = quantize_rtn(lin.weight.detach(), qcfg)
    swap_linears(model, qcfg, include={name})
    mod = model.get_submodule(name)
    mod.weight_packed.copy_(pack_int32(qw.q, 8))
    mod.weight_scale.copy_(qw.scale)
    return model


def test_cuda_backend_without_cuda_is_a_clear_error():
    from edgellm.backends.registry import resolve_backend

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cuda_mod.unavailable_reason()
    with pytest.raises(InvalidParameterError, match="cuda backend cannot run.*CUDA"):
        resolve_backend("cuda")


def test_speculative_decoding_on_the_backend_keeps_greedy_output():
    """n-gram drafts verified by (k+1)-token forwards through the mixed attention kernel:
    the same tokens as plain decoding."""
    from edgellm.config import SpeculativeConfig
    from edgellm.spec.decoder import SpeculativeDecoder
    from edgellm.spec.proposers import NgramProposer

    hf, config = tiny_hf_model("llama", **GQA)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = "ab ab ab ab ab ab ab"
    plain_cfg = EngineConfig(kv_cache_mb=1.0, block_size=4)
    plain = Engine(cuda_backend(ours_from_hf(hf, config), plain_cfg), byte_tokenizer(), plain_cfg)
    want = run_all(plain, [prompt], greedy)[0].outputs[0].token_ids
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=3, adaptive=False)
    cfg = plain_cfg.replace(speculative=spec)
    engine = Engine(
        cuda_backend(ours_from_hf(hf, config), cfg),
        byte_tokenizer(),
        cfg,
        SpeculativeDecoder(spec, NgramProposer(spec.ngram_max, spec.ngram_min)),
    )
    got = run_all(engine, [prompt], greedy)[0].outputs[0].token_ids
    assert got == want
    assert engine.stats["steps"] < plain.stats["steps"]  # drafts were accepted


def test_head_sizes_the_attention_kernels_cannot_take_fall_back_to_the_reference():
    """head_dim 8 (below a tensor-core tile): a warning, the torch reference attention, and
    the same greedy tokens as the torch backend, never a wrong answer."""
    hf, config = tiny_hf_model("llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cfg = EngineConfig(kv_cache_mb=1.0, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["small heads", "x"]
    ref = Engine(TorchBackend(ours_from_hf(hf, config), cfg), byte_tokenizer(), cfg)
    with pytest.warns(UserWarning, match="head_dim 8"):
        b = cuda_backend(ours_from_hf(hf, config), cfg)
    assert not b.model.kernel_attention and not b.use_graphs
    ours = Engine(b, byte_tokenizer(), cfg)
    want = [o.outputs[0].token_ids for o in run_all(ref, prompts, greedy)]
    assert [o.outputs[0].token_ids for o in run_all(ours, prompts, greedy)] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_the_eager_step():
    hf, config = tiny_hf_model("llama", **GQA)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["graphs", "are replayed", "for decode steps"]
    outs = []
    for graphs in (False, True):
        cfg = EngineConfig(kv_cache_mb=1.0, block_size=4, cuda_graphs=graphs)
        b = cuda_backend(ours_from_hf(hf, config), cfg)
        outs.append([o.outputs[0].token_ids for o in run_all(Engine(b, byte_tokenizer(), cfg), prompts, greedy)])
        assert bool(b.graphs) == graphs
    assert outs[0] == outs[1]


def test_every_kernel_compiles_for_hopper_without_spills():
    """The interpreter checks what the kernels compute; this compiles them for sm_90 (H100 /
    H200) through Triton's real pipeline and ptxas, in the configurations the wrappers
    launch: no compile error, no register spill, shared memory within the SM's."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "edgellm.kernels.triton_aot", "--arch", "90"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "23 kernels compiled for sm_90" in run.stdout


# ---- sliding windows and sinks ----------------------------------------------------------------
@pytest.mark.parametrize(("window", "sinks"), [(8, 0), (20, 4), (70, 3)])
def test_attention_kernels_with_a_window_match_reference(window, sinks):
    """Mixed batches (prefill chunks cross the window's edge) and split-KV decode (1 and 3
    splits of the window) with a window and sink tokens equal the reference."""
    ctx, q_lens = [37, 5, 150, 64], [1, 5, 17, 4]
    q, kc, vc, meta = paged_case(ctx, q_lens, 16)
    want = paged_attention(q, kc, vc, meta, 0.17, window, sinks)
    q2, kc2, vc2 = on_dev(q, kc, vc)
    args = (meta.block_tables.int().to(DEV), torch.tensor(ctx, dtype=torch.int32, device=DEV),
            torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEV))  # fmt: skip
    got = paged_attention_triton(q2, kc2, vc2, *args, max(q_lens), 0.17, window=window, sinks=sinks)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
    dq, dk, dv, dmeta = paged_case([37, 150, 1, 64], [1] * 4, heads=6, kv_heads=2)
    want = paged_attention(dq, dk, dv, dmeta, 0.125, window, sinks)
    dq2, dk2, dv2 = on_dev(dq, dk, dv)
    bt = dmeta.block_tables.int().to(DEV)
    lens = torch.tensor([37, 150, 1, 64], dtype=torch.int32, device=DEV)
    for splits in (1, 3):
        got = paged_decode_triton(dq2, dk2, dv2, bt, lens, 0.125, splits, window=window, sinks=sinks)
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)


def test_backend_with_windows_equals_torch():
    """-b cuda frees the same blocks and masks the same windows: a Mistral with a window of 8,
    and a llama under kv_window 12 + 4 sinks, greedy tokens equal to the torch backend's."""
    hf, config = tiny_hf_model("mistral", sliding_window=8)
    llama_hf, llama_cfg = tiny_hf_model("llama", seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = ["a sliding window of eight tokens", "hello"]
    for (h, c), opts in (((hf, config), {}), ((llama_hf, llama_cfg), dict(kv_window=12, kv_sinks=4))):
        cfg = EngineConfig(kv_cache_mb=1.0, block_size=4, max_num_batched_tokens=8, **opts)
        ref = Engine(TorchBackend(ours_from_hf(h, c), cfg), byte_tokenizer(), cfg)
        ours = Engine(cuda_backend(ours_from_hf(h, c), cfg), byte_tokenizer(), cfg)
        assert ours.block_manager.window == ref.block_manager.window > 0
        want = [o.outputs[0].token_ids for o in run_all(ref, prompts, greedy)]
        got = [o.outputs[0].token_ids for o in run_all(ours, prompts, greedy)]
        assert got == want
        assert ours.block_manager.num_free == ours.block_manager.num_blocks


# ---- int8 K/V ---------------------------------------------------------------------------------
def test_int8_cache_kernels_match_reference():
    """rope + cache write quantizes rows as `quantize_kv` does (codes equal, scales within
    float32 rounding); mixed and split-KV attention decode int8 rows as the reference does."""
    from edgellm.kernels.paged_attention import dequantize_kv, quantize_kv

    g = torch.Generator().manual_seed(3)
    heads, kvh, d = 6, 2, 32
    qkv = torch.randn(7, (heads + 2 * kvh) * d, generator=g)
    pos = torch.tensor([0, 1, 2, 50, 51, 9, 300])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    slots = torch.tensor([3, 4, 5, 17, 18, -1, 39])
    kc, vc = (torch.zeros(10, 4, kvh, d + 4, dtype=torch.int8) for _ in range(2))
    kc2, vc2 = kc.clone().to(DEV), vc.clone().to(DEV)
    rope_and_cache_ref(qkv, pos, inv, kc, vc, slots, heads)
    rope_and_cache(qkv.to(DEV), pos.to(DEV), inv.to(DEV), kc2, vc2, slots.to(DEV), heads)
    for got, want in ((kc2.cpu(), kc), (vc2.cpu(), vc)):
        assert (got[..., :d].int() - want[..., :d].int()).abs().max() <= 1  # ties only
        torch.testing.assert_close(
            dequantize_kv(got, torch.float32), dequantize_kv(want, torch.float32),
            atol=2e-2, rtol=0,
        )  # fmt: skip
    ctx, q_lens = [37, 5, 100, 64], [1, 5, 17, 4]
    q, kf, vf, meta = paged_case(ctx, q_lens, 16)
    k8, v8 = quantize_kv(kf), quantize_kv(vf)
    want = paged_attention(q, k8, v8, meta, 0.17)
    q2, k82, v82 = on_dev(q, k8, v8)
    args = (meta.block_tables.int().to(DEV), torch.tensor(ctx, dtype=torch.int32, device=DEV),
            torch.tensor(meta.query_start_loc, dtype=torch.int32, device=DEV))  # fmt: skip
    got = paged_attention_triton(q2, k82, v82, *args, max(q_lens), 0.17)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
    dq, dk, dv, dmeta = paged_case([37, 130, 1, 64], [1] * 4)
    dk8, dv8 = quantize_kv(dk), quantize_kv(dv)
    want = paged_attention(dq, dk8, dv8, dmeta, 0.125, 20, 4)
    lens = torch.tensor([37, 130, 1, 64], dtype=torch.int32, device=DEV)
    got = paged_decode_triton(*on_dev(dq, dk8, dv8), dmeta.block_tables.int().to(DEV), lens,
                              0.125, 3, window=20, sinks=4)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)


def test_backend_int8_cache_equals_torch_int8():
    """-b cuda with kv_cache_dtype int8: the pool holds the torch backend's tokens, greedy
    tokens equal the torch int8 run, batched equals alone."""
    ref, ours = engine_pair(kv_cache_dtype="int8")
    assert ours.block_manager.num_blocks == ref.block_manager.num_blocks
    assert ours.backend.kv_caches[0][0].dtype == torch.int8
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["hello there", "a", "the quick brown fox jumps"]
    want = [o.outputs[0].token_ids for o in run_all(ref, prompts, greedy)]
    together = [o.outputs[0].token_ids for o in run_all(ours, prompts, greedy)]
    alone = [run_all(ours, [p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert together == want and alone == together
    hf, config = tiny_hf_model("qwen2", **GQA)
    with pytest.raises(InvalidParameterError, match="cuda backend takes auto or int8"):
        cuda_backend(ours_from_hf(hf, config), EngineConfig(kv_cache_dtype="int4"))
