"""Sliding-window attention: models that declare a window (Mistral's `sliding_window`, Qwen2's
`use_sliding_window` / `max_window_layers`) and the opt-in `kv_window` with attention sinks.

- the mask (`visible`) against a brute-force rule, the C kernel against the reference with
  windows and sinks (blocks out of the window hold garbage: never read);
- tiny Mistral and Qwen2 models with a window of 8 against transformers (the oracle);
- the block manager keeps at most ceil((W - 1) / block_size) + 1 blocks per sequence at any
  length, a sequence runs past the whole pool, and batching, chunked prefill, prefix hits,
  forks, preemption (recompute and swap) and speculation stay exact with freed blocks;
- `kv_window` + sinks equals the dense masked reference and runs past the model's context;
- errors, and llama.cpp, which attends densely (its context stops at the window);
- the MLX backend (here) and the CUDA backend (tests/test_triton.py) equal the torch backend.
"""

from __future__ import annotations

import logging

import pytest
import torch

from edgellm.backends.base import pool_geometry
from edgellm.backends.torch import TorchBackend
from edgellm.config import EngineConfig
from edgellm.engine.block_manager import live
from edgellm.engine.engine import Engine
from edgellm.errors import InvalidParameterError, ModelFormatError
from edgellm.kernels import cpu
from edgellm.kernels.paged_attention import paged_attention, visible
from edgellm.models.llama import ModelArgs
from edgellm.sampling.params import SamplingParams
from tests.conftest import byte_tokenizer, ours_from_hf, run_all, tiny_hf_model
from tests.test_engine import prompts, tokens
from tests.test_fast_path import _paged_case

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
W = 8
WINDOWED = {
    "mistral": dict(sliding_window=W),
    "qwen2": dict(use_sliding_window=True, sliding_window=W, max_window_layers=0),
}


def window_model(model_type: str = "mistral", seed: int = 0, **over):
    hf, config = tiny_hf_model(model_type, seed=seed, **{**WINDOWED[model_type], **over})
    return hf, config, ours_from_hf(hf, config)


def engine_for(model, **cfg) -> Engine:
    config = EngineConfig(**{"kv_cache_mb": 2.0, "block_size": 4, **cfg})
    return Engine(TorchBackend(model, config), byte_tokenizer(), config)


def run_bounded(engine: Engine, ps, params, bound: int) -> list:
    """run_all, also holding every sequence to `bound` live blocks after each step."""
    ids = [engine.add_request(p, params) for p in ps]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        seqs = [s for r in engine.requests.values() for s in r.seqs if s.block_table]
        engine.block_manager.check_invariants(seqs)
        for s in seqs:
            peak = max(peak, len(live(s.block_table)))
    assert peak <= bound, f"a sequence held {peak} blocks, more than {bound}"
    return [engine.pop_output(i) for i in ids]


# ---- config ---------------------------------------------------------------------------------
def test_windows_are_read_as_transformers_reads_them():
    _, cfg = tiny_hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    args = ModelArgs.from_hf_config(cfg)
    assert args.layer_windows() == [0, 8]  # layer 0 full, layers from 1 on slide
    again = ModelArgs.from_hf_config(args.to_hf_config())
    assert again.layer_windows() == [0, 8]
    _, cfg = tiny_hf_model("qwen2", use_sliding_window=False, sliding_window=8)
    assert ModelArgs.from_hf_config(cfg).layer_windows() == [0, 0]
    _, cfg = tiny_hf_model("mistral", sliding_window=8)
    assert ModelArgs.from_hf_config(cfg).layer_windows() == [8, 8]
    _, cfg = tiny_hf_model("mistral", sliding_window=None)
    assert ModelArgs.from_hf_config(cfg).layer_windows() == [0, 0]


def test_bad_window_configs_are_clear_errors(tmp_path):
    from edgellm.loaders.validate import Naming, model_args
    from edgellm.models.llama import hf_fields

    _, cfg = tiny_hf_model("mistral", sliding_window=8)
    naming = Naming("config.json", {})
    for bad, match in (
        ({"sliding_window": -3}, "sliding_window is -3"),
        ({"sliding_window": "8"}, "sliding_window is '8'"),
        ({"layer_types": "sliding_attention"}, "layer_types"),
    ):
        with pytest.raises(ModelFormatError, match=match):
            model_args(hf_fields({**cfg, **bad}), naming)
    with pytest.raises(Exception, match="layer_types must name"):
        model_args(hf_fields({**cfg, "layer_types": ["sliding_attention"] * 3}), naming)


# ---- the mask and the kernel ----------------------------------------------------------------
def test_visible_is_the_window_and_sinks_rule():
    q = torch.arange(40)[:, None]
    k = torch.arange(40)[None, :]
    for window, sinks in ((0, 0), (8, 0), (8, 3), (1, 0), (5, 5)):
        got = visible(q, k, window, sinks)
        for p in range(40):
            for j in range(40):
                want = j <= p and (not window or p - window < j or j < sinks)
                assert bool(got[p, j]) == want, (window, sinks, p, j)


@pytest.mark.skipif(cpu.library() is None, reason=f"kernel: {cpu.status()}")
@pytest.mark.parametrize(("window", "sinks"), [(8, 0), (8, 4), (5, 2), (16, 3), (64, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_kernel_with_window_matches_reference(window, sinks, dtype):
    chunks = [(1, 37), (5, 20), (1, 9), (3, 3), (1, 64), (4, 40)]
    q, k, v, meta = _paged_case(chunks, 4, 2)
    if dtype == torch.int8:
        from edgellm.kernels.paged_attention import quantize_kv

        k, v = quantize_kv(k), quantize_kv(v)
    want = paged_attention(q, k, v, meta, 0.25, window, sinks)
    row_seq, row_len = cpu.row_metadata(meta)
    got = cpu.paged_attention_rows(q, k, v, meta.block_tables, row_seq, row_len, 0.25, window, sinks)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # blocks wholly outside every row's window and sinks: garbage there changes nothing
    poisoned_k, poisoned_v = k.clone(), v.clone()
    bs = k.shape[1]
    for b, (_, ctx) in enumerate(chunks):
        first_row_ctx = ctx - (meta.query_start_loc[b + 1] - meta.query_start_loc[b]) + 1
        lo = max(first_row_ctx - window, 0)
        for i in range(-(-sinks // bs), lo // bs):
            blk = meta.block_tables[b, i]
            poisoned_k[blk], poisoned_v[blk] = 99, 99
    again = cpu.paged_attention_rows(
        q, poisoned_k, poisoned_v, meta.block_tables, row_seq, row_len, 0.25, window, sinks
    )
    assert torch.equal(again, got)


# ---- declared windows against transformers ---------------------------------------------------
@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_window_model_equals_transformers(model_type):
    """Greedy decoding with blocks freed behind the window: every token is transformers'
    argmax over the same sequence (its windowed mask); a long prompt scored in chunks of 8,
    blocks freed as it goes: log-probabilities within 1e-4 of transformers'."""
    hf, _, model = window_model(model_type)
    ps = prompts(4, seed=3)
    outs = run_bounded(engine_for(model, max_num_batched_tokens=16), ps, GREEDY, bound=3)
    for p, got in zip(ps, tokens(outs), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([p + got])).logits[0]
        ref = logits[len(p) - 1 : -1].argmax(-1).tolist()
        assert got == ref
    # logits of one long prompt through prefill chunks and freed blocks
    seq = prompts(1, seed=9)[0] * 2
    out = engine_for(model, max_num_batched_tokens=8).score(seq)
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0].log_softmax(-1)
    expect = want[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


def test_windowed_qwen2_keeps_full_layers_exact():
    """Layer 0 full, layer 1 windowed: no block is freed (a full layer sees everything)."""
    hf, _, model = window_model("qwen2", max_window_layers=1)
    ps = prompts(3, seed=4)
    eng = engine_for(model)
    assert eng.block_manager.window == 0
    outs = run_all(eng, ps, GREEDY)
    for p, got in zip(ps, tokens(outs), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([p + got])).logits[0]
        assert got == logits[len(p) - 1 : -1].argmax(-1).tolist()


# ---- the block manager with a window ---------------------------------------------------------
def test_sequences_run_past_the_whole_pool_within_the_window_bound():
    """16 blocks of 4 tokens (64 tokens): three sequences of 200+ tokens run at once, each
    never holding more than ceil((8 - 1) / 4) + 1 = 3 blocks after a step."""
    _, _, model = window_model("mistral", max_position_embeddings=512)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x fp32
    eng = engine_for(model, kv_cache_mb=16 * 4 * per_token / 2**20, max_num_batched_tokens=8)
    assert eng.block_manager.num_blocks == 16 and eng.max_model_len == 512
    ps = prompts(3, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    outs = run_bounded(eng, ps, params, bound=3)
    assert all(len(o.outputs[0].token_ids) == 200 for o in outs)
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    alone = [tokens(run_all(engine_for(model), [p], params))[0] for p in ps]
    assert tokens(outs) == alone


def test_batched_chunked_prefix_forks_preemption_equal_alone():
    _, _, model = window_model("mistral")
    ps = prompts(6, seed=1)
    alone = [tokens(run_all(engine_for(model), [p], GREEDY))[0] for p in ps]
    assert tokens(run_all(engine_for(model), ps, GREEDY)) == alone
    assert tokens(run_all(engine_for(model, max_num_batched_tokens=8), ps, GREEDY)) == alone
    per_token = 2 * 2 * 2 * 16 * 4
    small = engine_for(model, kv_cache_mb=10 * 4 * per_token / 2**20, max_num_batched_tokens=8)
    assert tokens(run_all(small, ps, GREEDY)) == alone
    assert small.scheduler.num_preemptions > 0
    swap = engine_for(
        model, kv_cache_mb=10 * 4 * per_token / 2**20, max_num_batched_tokens=8,
        swap_space_mb=1, preemption="swap",
    )  # fmt: skip
    assert tokens(run_all(swap, ps, GREEDY)) == alone
    assert swap.scheduler.num_swaps > 0
    # prefix hits: a long shared prompt is found again; only its window's blocks are needed
    shared = list(range(1, 41))
    eng = engine_for(model)
    first = run_all(eng, [shared + [50, 51]], GREEDY)[0]
    second = run_all(eng, [shared + [60]], GREEDY)[0]
    assert second.num_cached_tokens == 40
    cold = engine_for(model, enable_prefix_caching=False)
    assert tokens(run_all(cold, [shared + [60]], GREEDY)) == tokens([second])
    assert tokens(run_all(cold, [shared + [50, 51]], GREEDY)) == tokens([first])
    forks = run_all(eng, [shared[:10]], SamplingParams(n=3, temperature=0.0, max_tokens=30))[0]
    one = run_all(cold, [shared[:10]], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert {tuple(o.token_ids) for o in forks.outputs} == {tuple(one.outputs[0].token_ids)}
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_prefix_hit_needs_only_the_window_blocks():
    """The first blocks of a cached prompt are evicted; a hit still takes the rest."""
    _, _, model = window_model("mistral")
    shared = list(range(1, 41))  # 10 blocks of 4
    eng = engine_for(model)
    run_all(eng, [shared + [50]], GREEDY)
    bm = eng.block_manager
    for block in bm.blocks:  # evict the prompt's first three blocks from the cache
        if block.hash is not None and block.token_ids and block.token_ids[0] in (1, 5, 9):
            bm.uncache(block.block_id)
    again = run_all(eng, [shared + [60]], GREEDY)[0]
    assert again.num_cached_tokens == 40
    cold = engine_for(model, enable_prefix_caching=False)
    assert tokens(run_all(cold, [shared + [60]], GREEDY)) == tokens([again])


def test_speculation_with_a_window_equals_plain_decoding():
    _, _, model = window_model("mistral")
    from edgellm.config import SpeculativeConfig
    from edgellm.spec.decoder import SpeculativeDecoder
    from edgellm.spec.proposers import NgramProposer

    ps = [(p * 4)[:60] for p in prompts(4, seed=2)]  # repetitive: n-gram drafts get accepted
    plain = tokens(run_all(engine_for(model), ps, GREEDY))
    spec = SpeculativeConfig("ngram", 4, adaptive=False)
    config = EngineConfig(kv_cache_mb=2.0, block_size=4, speculative=spec)
    eng = Engine(
        TorchBackend(model, config), byte_tokenizer(), config,
        SpeculativeDecoder(spec, NgramProposer(spec.ngram_max, spec.ngram_min)),
    )  # fmt: skip
    outs = run_all(eng, ps, GREEDY)
    assert tokens(outs) == plain
    assert sum(o.metrics.spec.accepted for o in outs) > 0


# ---- kv_window with sinks --------------------------------------------------------------------
def test_kv_window_with_sinks_equals_the_dense_masked_reference():
    """A llama without a window of its own, run with kv_window 12 + 4 sinks: each greedy token
    is the argmax of the reference model over the whole sequence with the same mask."""
    hf, config = tiny_hf_model("llama", seed=1)
    model = ours_from_hf(hf, config)
    ps = prompts(3, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    eng = engine_for(model, kv_window=12, kv_sinks=4, max_num_batched_tokens=8)
    bound = 1 + (-(-11 // 4) + 1)  # the sink block + the window's
    outs = run_bounded(eng, ps, params, bound)
    full = tokens(run_all(engine_for(model), ps, params))
    assert full != tokens(outs)  # the window changes what the model says
    from edgellm.engine.scheduler import ScheduledSeq
    from edgellm.engine.sequence import Sequence

    # one forward over each whole sequence: every block there, the mask alone windows
    dense = engine_for(ours_from_hf(hf, config), kv_window=12, kv_sinks=4,
                       max_num_batched_tokens=512)  # fmt: skip
    for p, got in zip(ps, tokens(outs), strict=True):
        seq = Sequence("ref", p + got, SamplingParams())
        dense.block_manager.allocate(seq, use_prefix_cache=False)
        logits = dense.backend.forward([ScheduledSeq(seq, len(seq))], all_logits=True)
        dense.block_manager.free(seq)
        want = logits[len(p) - 1 : -1]
        top = want.topk(2, -1).values
        for i, (a, b) in enumerate(zip(got, want.argmax(-1).tolist(), strict=True)):
            if a != b:  # fused C kernel vs SDPA: may part only at a near-tie, then stop
                assert float(top[i, 0] - top[i, 1]) < 1e-4
                break


def test_kv_window_runs_past_the_models_context():
    hf, config = tiny_hf_model("llama", max_position_embeddings=64)
    model = ours_from_hf(hf, config)
    eng = engine_for(model, kv_window=16, kv_sinks=4, kv_cache_mb=0.05, max_num_batched_tokens=8)
    assert eng.max_model_len == 65536 and eng.block_manager.num_blocks < 64
    out = run_all(eng, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 300
    plain = engine_for(ours_from_hf(hf, config))
    assert plain.max_model_len == 64


# ---- errors and dense backends ---------------------------------------------------------------
def test_window_options_are_clear_errors():
    with pytest.raises(InvalidParameterError, match="kv_window and kv_sinks"):
        EngineConfig(kv_window=-1)
    with pytest.raises(InvalidParameterError, match="must be fewer than the kv_window"):
        EngineConfig(kv_window=4, kv_sinks=4)
    _, cfg = tiny_hf_model("llama")
    args = ModelArgs.from_hf_config(cfg)
    with pytest.raises(InvalidParameterError, match="kv_window is not available on the llamacpp"):
        pool_geometry(args, EngineConfig(kv_window=64), torch.float32, backend="llamacpp")
    from edgellm.backends.registry import AUTO_ORDER, BACKENDS, resolve_backend

    masked = next(b for b in AUTO_ORDER if BACKENDS[b].available() and b != "llamacpp")
    assert resolve_backend("auto", kv_window=64) == masked  # auto passes llama.cpp over


def test_dense_backends_stop_at_the_window(caplog):
    """llama.cpp attends to the whole context: a windowed model's context there is its window
    (where dense and windowed attention agree), with a warning."""
    _, cfg = tiny_hf_model("mistral", sliding_window=8)
    args = ModelArgs.from_hf_config(cfg)
    with caplog.at_level(logging.WARNING):
        _, _, limit = pool_geometry(args, EngineConfig(), torch.float32, backend="llamacpp")
    assert limit == 8
    assert "limited to the model's sliding window of 8 tokens" in caplog.text


# ---- MLX ------------------------------------------------------------------------------------
def test_mlx_backend_windows_equal_torch():
    """The MLX backend masks the same windows (declared, and kv_window with sinks) and frees
    the same blocks: its greedy tokens are the torch backend's up to a near-tie."""
    pytest.importorskip("mlx.core")
    from edgellm.backends.mlx import MLXBackend

    _, _, model = window_model("mistral")
    hf, config = tiny_hf_model("llama", seed=1)
    llama = ours_from_hf(hf, config)
    ps = prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # bounds: ceil((8 - 1) / 4) + 1 = 3; the sink block + ceil((12 - 1) / 4) + 1 = 5
    for m, opts, bound in ((model, {}, 3), (llama, dict(kv_window=12, kv_sinks=4), 5)):
        want = tokens(run_all(engine_for(m, **opts), ps, params))
        cfg = EngineConfig(kv_cache_mb=2.0, block_size=4, dtype="float32", max_num_batched_tokens=8, **opts)
        backend = MLXBackend.from_torch(m, cfg)
        backend.run_ahead = False
        eng = Engine(backend, byte_tokenizer(), cfg)
        assert eng.block_manager.window == (12 if opts else W)
        got = tokens(run_bounded(eng, ps, params, bound))
        for g, w in zip(got, want, strict=True):
            same = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
            assert same is None or same > 10, (g, w)  # fp32 both: parting only late, at a tie


def test_cli_kv_window(capsys, monkeypatch):
    """`--kv-window` reaches the engine (auto passes llama.cpp over); bad values are one line."""
    from tests.test_cli import assert_one_line_error, run_cli

    code, out, err = run_cli(
        ["generate", "The State of the Union", "-n", "6", "--kv-window", "32", "--kv-sinks", "2"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert code in (0, None) and "6 generated" in err
    code, _, err = run_cli(
        ["generate", "x", "-n", "2", "--kv-window", "4", "--kv-sinks", "4"], capsys, monkeypatch
    )
    assert_one_line_error(code, err, "must be fewer than the kv_window")
    code, _, err = run_cli(
        ["generate", "x", "-n", "2", "-b", "llamacpp", "--kv-window", "64"], capsys, monkeypatch
    )
    assert_one_line_error(code, err, "kv_window is not available on the llamacpp backend")
