"""The int8 KV cache (`kv_cache_dtype="int8"`): its rows, its kernels, its bytes, and the
engine's exactness guarantees with it (one numeric path: batched vs alone, cached vs not,
forked, preempted, swapped, speculated); on SmolLM2 its cost in perplexity and greedy text;
on llama.cpp its q8_0 K/V under flash attention."""

from __future__ import annotations

import pytest
import torch

from edgellm.backends.base import kv_bytes_per_token
from edgellm.backends.torch import TorchBackend
from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.kernels import cpu
from edgellm.kernels.paged_attention import dequantize_kv, paged_attention, quantize_kv
from edgellm.sampling.params import SamplingParams
from tests.conftest import ours_from_hf, run_all, tiny_engine, tiny_hf_model
from tests.test_engine import prompts, tokens
from tests.test_fast_path import CASES, _paged_case

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
INT8 = dict(kv_cache_dtype="int8")


def test_rows_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.logspace(-3, 2, 7)[:, None, None]
    x[2, 1] = 0.0  # an all-zero row
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127)
    back = dequantize_kv(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert (back[2, 1] == 0).all() and scale[2, 1] == 0
    assert (rows[..., :64].abs() <= 127).all()
    assert dequantize_kv(x, torch.bfloat16).dtype == torch.bfloat16  # float rows: a cast


@pytest.mark.skipif(cpu.library() is None, reason=f"kernel: {cpu.status()}")
@pytest.mark.parametrize(("chunks", "heads", "kv_heads"), CASES)
def test_kernel_on_int8_cache_matches_reference(chunks, heads, kv_heads):
    q, k, v, meta = _paged_case(chunks, heads, kv_heads)
    kq, vq = quantize_kv(k), quantize_kv(v)
    row_seq, row_len = cpu.row_metadata(meta)
    got = cpu.paged_attention_rows(q, kq, vq, meta.block_tables, row_seq, row_len, 0.25)
    want = paged_attention(q, kq, vq, meta, 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # and the reference on int8 rows is the float reference on their decoded values
    deq = paged_attention(
        q, dequantize_kv(kq, torch.float32), dequantize_kv(vq, torch.float32), meta, 0.25
    )
    torch.testing.assert_close(want, deq, atol=0, rtol=0)


def test_pool_bytes_follow_the_formula():
    hf, config = tiny_hf_model()
    model = ours_from_hf(hf, config)
    args = model.args
    fp32 = TorchBackend(model, EngineConfig(kv_cache_mb=2))
    int8 = TorchBackend(model, EngineConfig(kv_cache_mb=2, **INT8))
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * (args.head_dim + 4)
    assert kv_bytes_per_token(2, 2, 16, torch.int8) == per_token
    pool = sum(k.nbytes + v.nbytes for k, v in int8.kv_caches)
    assert pool == int8.num_blocks * int8.block_size * per_token <= 2 * 2**20
    assert int8.num_blocks == 2 * 2**20 // (16 * per_token)
    assert int8.num_blocks / fp32.num_blocks == pytest.approx(4 * 16 / 20, rel=0.01)
    # SmolLM2's geometry (30 layers, 3 KV heads, head_dim 64): int8 vs 16-bit
    ratio = kv_bytes_per_token(30, 3, 64, torch.bfloat16) / kv_bytes_per_token(
        30, 3, 64, torch.int8
    )
    assert ratio == pytest.approx(128 / 68) and ratio >= 1.8
    assert kv_bytes_per_token(30, 3, 64, "q8_0") == 2 * 30 * 3 * 68


def test_int8_cache_stays_close_to_the_float_cache():
    """A check of scale, not of equality: the logits of a tiny random model move little."""
    from edgellm.engine.scheduler import ScheduledSeq
    from edgellm.engine.sequence import Sequence

    ids = prompts(1, seed=5)[0] * 2
    logits = {}
    for name, over in (("auto", {}), ("int8", INT8)):
        eng = tiny_engine(**over)
        seq = Sequence("probe", ids, SamplingParams())
        eng.block_manager.allocate(seq, use_prefix_cache=False)
        logits[name] = eng.backend.forward([ScheduledSeq(seq, len(ids))], all_logits=True)
    err = (logits["int8"] - logits["auto"]).abs().max() / logits["auto"].abs().max()
    assert 0 < err < 0.02


def test_batched_chunked_and_preempted_equal_alone():
    ps = prompts(6, seed=1)
    alone = [tokens(run_all(tiny_engine(**INT8), [p], GREEDY))[0] for p in ps]
    assert tokens(run_all(tiny_engine(**INT8), ps, GREEDY)) == alone
    assert tokens(run_all(tiny_engine(max_num_batched_tokens=16, **INT8), ps, GREEDY)) == alone
    # 40 blocks of 4 tokens at 160 bytes a token: too few for all six, so preemption
    small = tiny_engine(kv_cache_mb=40 * 4 * 160 / 2**20, block_size=4, **INT8)
    assert small.block_manager.num_blocks == 40
    assert tokens(run_all(small, ps, GREEDY)) == alone
    assert small.scheduler.num_preemptions > 0
    swap = tiny_engine(
        kv_cache_mb=40 * 4 * 160 / 2**20, block_size=4, swap_space_mb=1, preemption="swap", **INT8
    )
    assert tokens(run_all(swap, ps, GREEDY)) == alone
    assert swap.scheduler.num_swaps > 0


def test_prefix_hits_and_forks_equal_a_cold_cache():
    shared = list(range(1, 41))
    eng = tiny_engine(block_size=8, **INT8)
    first = run_all(eng, [shared + [50, 51]], GREEDY)[0]
    second = run_all(eng, [shared + [60]], GREEDY)[0]
    assert second.num_cached_tokens == 40
    cold = tiny_engine(block_size=8, enable_prefix_caching=False, **INT8)
    assert run_all(cold, [shared + [60]], GREEDY)[0].outputs[0].token_ids == (
        second.outputs[0].token_ids
    )
    assert run_all(cold, [shared + [50, 51]], GREEDY)[0].outputs[0].token_ids == (
        first.outputs[0].token_ids
    )
    # n = 3 greedy children share the prompt's blocks copy-on-write: each equals one alone
    forks = run_all(eng, [shared[:10]], SamplingParams(n=3, temperature=0.0, max_tokens=16))[0]
    alone = run_all(cold, [shared[:10]], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert {tuple(o.token_ids) for o in forks.outputs} == {tuple(alone.outputs[0].token_ids)}
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_speculative_rollback_equals_plain_decoding():
    from tests.test_speculative import GREEDY as SPEC_GREEDY
    from tests.test_speculative import models, plain_engine, run_checked, spec_engine
    from tests.test_speculative import prompts as spec_prompts

    target, draft = models()
    for drafter, repeat in ((None, True), (draft, False)):
        ps = spec_prompts(5, repeat=repeat)
        ref = tokens(run_all(plain_engine(TorchBackend, target, **INT8), ps, SPEC_GREEDY))
        eng = spec_engine(TorchBackend, target, drafter, block_size=4, **INT8)
        outs = run_checked(eng, ps, SPEC_GREEDY)
        assert tokens(outs) == ref
        assert sum(o.metrics.spec.accepted < o.metrics.spec.proposed for o in outs) > 0


def test_bad_kv_options_are_clear_errors():
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    hf, config = tiny_hf_model()
    with pytest.raises(InvalidParameterError, match="llamacpp backend only"):
        TorchBackend(ours_from_hf(hf, config), EngineConfig(kv_cache_dtype="int4"))
    pytest.importorskip("mlx.core")
    from edgellm.backends.mlx import MLXBackend

    with pytest.raises(InvalidParameterError, match="mlx backend takes auto or int8"):
        MLXBackend.from_torch(ours_from_hf(hf, config), EngineConfig(kv_cache_dtype="int4"))


# ---- the real model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_llms(smollm2_path):
    from edgellm import LLM

    made = {
        name: LLM(
            str(smollm2_path),
            backend="torch",
            dtype="float32",
            kv_cache_mb=64,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,
            **over,
        )  # fmt: skip
        for name, over in (("auto", {}), ("int8", INT8))
    }
    yield made
    for llm in made.values():
        llm.engine.backend.close()


@pytest.mark.slow
def test_smollm2_int8_perplexity_within_one_percent(smol_llms):
    from edgellm.eval.perplexity import perplexity
    from edgellm.loaders.texts import load_text

    tok = smol_llms["auto"].tokenizer
    ids = tok.encode(load_text("sotu"), add_special_tokens=False)[:2048]
    ppl = {name: perplexity(llm.score, ids, 512).ppl for name, llm in smol_llms.items()}
    assert abs(ppl["int8"] / ppl["auto"] - 1) < 0.01, ppl


@pytest.mark.slow
def test_smollm2_int8_greedy_equals_float_up_to_near_ties(smol_llms):
    from edgellm.loaders.texts import load_text

    text = load_text("shakespeare")
    ps = [text[i * 900 : i * 900 + 300] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    ref, got = (smol_llms[n].generate(ps, params) for n in ("auto", "int8"))
    same = 0
    for r, o in zip(ref, got, strict=True):
        want, have = r.outputs[0], o.outputs[0]
        d = next(
            (
                i
                for i, (a, b) in enumerate(zip(want.token_ids, have.token_ids, strict=True))
                if a != b
            ),
            None,
        )
        if d is None:
            same += 1
            continue
        top = sorted(want.logprobs[d][1].values(), reverse=True)
        assert top[0] - top[1] < 0.1, f"parted at token {d} without a near-tie"
    assert same >= 2


@pytest.mark.slow
def test_llamacpp_q4_0_kv_equals_llama_with_the_same_cache(smollm2_path):
    """int4 on llama.cpp is its q4_0 K/V: greedy tokens equal `Llama`'s own with
    type_k = type_v = q4_0 (flash attention on), and the pool holds 3.6x f16's tokens."""
    from llama_cpp import Llama

    from edgellm import LLM

    ours = {
        kv: LLM(str(smollm2_path), backend="llamacpp", llamacpp_type="file", kv_cache_mb=32,
                threads=2, kv_cache_dtype=kv)  # fmt: skip
        for kv in ("auto", "int4")
    }
    f16, q4 = (ours[k].engine.block_manager.num_blocks for k in ("auto", "int4"))
    assert q4 / f16 == pytest.approx(128 / 36, rel=0.02)
    ref = Llama(str(smollm2_path), n_ctx=512, n_threads=2, flash_attn=True, verbose=False,
                type_k=2, type_v=2)  # fmt: skip
    for p in ("The capital of France is", "def fibonacci(n):"):
        ids = ref.tokenize(p.encode(), add_bos=False, special=True)
        want = []
        for t in ref.generate(ids, temp=0.0, top_k=1, reset=True):
            want.append(t)
            if len(want) == 32:
                break
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        assert ours["int4"].generate([ids], params)[0].outputs[0].token_ids == want, p
    ref.close()


def test_mlx_int8_cache_equals_torch_int8():
    """The MLX backend stores the same int8 rows (codes + fp32 scale): its pool holds as many
    tokens as torch's, and its greedy tokens equal torch's int8 run up to a late near-tie;
    batched equals alone, no block left."""
    pytest.importorskip("mlx.core")
    from edgellm.backends.mlx import MLXBackend
    from edgellm.engine.engine import Engine
    from tests.conftest import byte_tokenizer

    hf, config = tiny_hf_model()
    model = ours_from_hf(hf, config)
    cfg = EngineConfig(kv_cache_mb=1.0, block_size=4, dtype="float32", **INT8)
    ref = Engine(TorchBackend(model, cfg), byte_tokenizer(), cfg)
    backend = MLXBackend.from_torch(model, cfg)
    backend.run_ahead = False
    ours = Engine(backend, byte_tokenizer(), cfg)
    assert ours.block_manager.num_blocks == ref.block_manager.num_blocks
    assert backend.kv.k[0].dtype.size == 1 and backend.kv.shape[-1] == config["hidden_size"] // 4 + 4
    ps = prompts(4, seed=3)
    want = tokens(run_all(ref, ps, GREEDY))
    got = tokens(run_all(ours, ps, GREEDY))
    for g, w in zip(got, want, strict=True):
        parted = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        assert parted is None or parted > 8, (g, w)
    assert tokens(run_all(ours, ps[:1], GREEDY)) == got[:1]
    assert ours.block_manager.num_free == ours.block_manager.num_blocks
