"""The torch backend's serving path held to its reference twins.

- the C attention kernel (`kernels/cpu_kernels.c`) against `paged_attention` in torch;
- the fused model (`models/fused.py`) against `models/llama.py` on tiny random models
  (llama with GQA, qwen2 with q/k/v biases, quantized Linears that cannot be fused)
  and on the real SmolLM2, whose greedy tokens may part only at a near-tie;
- EDGELLM_REFERENCE=1 really runs the reference.
"""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels import cpu
from edgellm.kernels.paged_attention import AttentionMetadata, paged_attention
from edgellm.models.fused import KERNEL_MAX_CHUNK, FusedModel
from tests.conftest import ours_from_hf, tiny_hf_model

needs_kernel = pytest.mark.skipif(cpu.library() is None, reason=f"kernel: {cpu.status()}")


def _paged_case(chunks, n_heads, n_kv, head_dim=16, bs=4, dtype=torch.float32, seed=0):
    """Random caches and queries for sequences given as (query rows, context length)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-ctx // bs) for _, ctx in chunks)
    n_blocks = width * len(chunks) + 3
    k = torch.randn(n_blocks, bs, n_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(n_blocks, bs, n_kv, head_dim, generator=g).to(dtype)
    tables = torch.randperm(n_blocks, generator=g)[: width * len(chunks)].view(len(chunks), width)
    qsl = [0]
    for n, _ in chunks:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        torch.zeros(qsl[-1], dtype=torch.long), qsl, [c for _, c in chunks], tables
    )
    q = torch.randn(qsl[-1], n_heads, head_dim, generator=g)
    return q, k, v, meta


CASES = [
    ([(1, 1)], 4, 4),  # one decode of the first token
    ([(1, 37), (1, 5), (1, 64)], 4, 2),  # decodes, GQA
    ([(5, 20), (1, 9), (3, 3), (1, 17)], 6, 2),  # chunks (causal inside) beside decodes
    ([(4, 40)], 8, 1),  # multi-query: one KV head for all
    ([(2, 16), (1, 32)], 3, 3),  # contexts ending on block edges
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("chunks", "heads", "kv_heads"), CASES)
def test_kernel_matches_reference(chunks, heads, kv_heads, dtype):
    q, k, v, meta = _paged_case(chunks, heads, kv_heads, dtype=dtype)
    row_seq, row_len = cpu.row_metadata(meta)
    got = cpu.paged_attention_rows(q, k, v, meta.block_tables, row_seq, row_len, 0.25)
    want = paged_attention(q, k.float(), v.float(), meta, 0.25)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_row_metadata_is_causal_within_chunks():
    _, _, _, meta = _paged_case([(3, 10), (1, 4), (2, 2)], 2, 2)
    row_seq, row_len = cpu.row_metadata(meta)
    assert row_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert row_len.tolist() == [8, 9, 10, 4, 1, 2]


@needs_kernel
def test_kernel_rows_do_not_depend_on_the_batch():
    """A row's result is a function of its own inputs: the same bits alone or batched."""
    q, k, v, meta = _paged_case([(1, 30), (3, 12), (1, 7)], 4, 2)
    row_seq, row_len = cpu.row_metadata(meta)
    batched = cpu.paged_attention_rows(q, k, v, meta.block_tables, row_seq, row_len, 0.3)
    for r in range(q.shape[0]):
        alone = cpu.paged_attention_rows(
            q[r : r + 1], k, v, meta.block_tables, row_seq[r : r + 1], row_len[r : r + 1], 0.3
        )
        assert torch.equal(alone[0], batched[r])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize(("k", "n", "bias"), [(64, 48, False), (61, 10, True), (200, 7, True)])
def test_streaming_linear_matches_torch(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu.linear_rows(x, w, b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(cpu.linear_rows(x[:1], w, b)[0], got[0])  # rows are independent


def _step_inputs(args, chunks, n_blocks=64, bs=4, seed=0):
    """Token ids, positions, caches and metadata for sequences (new tokens, context)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-ctx // bs) for _, ctx in chunks)
    tables = torch.randperm(n_blocks, generator=g)[: width * len(chunks)].view(len(chunks), width)
    ids, pos, slots, qsl = [], [], [], [0]
    for b, (n, ctx) in enumerate(chunks):
        for p in range(ctx - n, ctx):
            pos.append(p)
            slots.append(int(tables[b, p // bs]) * bs + p % bs)
        ids += torch.randint(0, args.vocab_size, (n,), generator=g).tolist()
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(torch.tensor(slots), qsl, [c for _, c in chunks], tables)
    return torch.tensor(ids), torch.tensor(pos), meta


def _caches(args, n_blocks=64, bs=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (n_blocks, bs, args.num_key_value_heads, args.head_dim)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(args.num_hidden_layers)
    ]


STEPS = [
    [(1, 9), (1, 30), (1, 2)],  # decodes
    [(7, 7), (1, 12), (3, 20)],  # prefill, decode, a short chunk (kernel)
    [(KERNEL_MAX_CHUNK + 6, KERNEL_MAX_CHUNK + 10), (1, 5)],  # a long chunk (SDPA) beside a decode
]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("chunks", STEPS)
def test_fused_model_matches_reference(model_type, chunks):
    hf, config = tiny_hf_model(model_type, num_attention_heads=4, num_key_value_heads=2)
    ref = ours_from_hf(hf, config)
    fused = FusedModel(ours_from_hf(hf, config), max_positions=512)
    ids, pos, meta = _step_inputs(ref.args, chunks)
    caches_ref, caches_fused = _caches(ref.args), _caches(ref.args)
    rows = torch.arange(len(ids))
    with torch.inference_mode():
        want = ref(ids, pos, caches_ref, meta, rows)
        got = fused(ids, pos, caches_fused, meta, rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (k0, v0), (k1, v1) in zip(caches_ref, caches_fused, strict=True):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)  # the same K/V written
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)


class _OtherLinear(torch.nn.Linear):
    """Stands for a Linear that cannot be concatenated (QuantLinear)."""


def test_fused_model_calls_unfusable_linears_one_by_one():
    hf, config = tiny_hf_model("qwen2")
    ref = ours_from_hf(hf, config)
    for layer in ref.model.layers:
        old = layer.self_attn.k_proj
        layer.self_attn.k_proj = _OtherLinear(old.in_features, old.out_features, bias=True)
        layer.self_attn.k_proj.load_state_dict(old.state_dict())
    fused = FusedModel(ref, max_positions=512)
    assert (
        fused.model.layers[0].qkv.fused is None and fused.model.layers[0].gate_up.fused is not None
    )
    ids, pos, meta = _step_inputs(ref.args, STEPS[1])
    rows = torch.arange(len(ids))
    with torch.inference_mode():
        got = fused(ids, pos, _caches(ref.args), meta, rows)
        want = ref(ids, pos, _caches(ref.args), meta, rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_reference_switch_runs_the_reference_model(monkeypatch):
    from edgellm.backends.torch import TorchBackend
    from edgellm.config import EngineConfig

    hf, config = tiny_hf_model("llama")
    monkeypatch.setenv("EDGELLM_REFERENCE", "1")
    backend = TorchBackend(ours_from_hf(hf, config), EngineConfig(kv_cache_mb=1))
    assert type(backend.model).__name__ == "Model"
    monkeypatch.setenv("EDGELLM_REFERENCE", "0")
    backend = TorchBackend(ours_from_hf(hf, config), EngineConfig(kv_cache_mb=1))
    assert isinstance(backend.model, FusedModel)


def test_smollm2_greedy_fast_equals_reference_up_to_near_ties(monkeypatch, smollm2_path):
    """The serving path and the reference agree token for token on the real model, except
    where the reference's top two logits were within a margin (the llama.cpp tests' rule)."""
    from edgellm import LLM, SamplingParams
    from edgellm.loaders.texts import load_text

    text = load_text("sotu")
    prompts = [text[i * 700 : i * 700 + 300] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("EDGELLM_REFERENCE", flag)
        llm = LLM(str(smollm2_path), backend="torch", dtype="float32", kv_cache_mb=64)
        runs[flag] = llm.generate(prompts, params)
        llm.engine.backend.close()
    for ref, fast in zip(runs["1"], runs["0"], strict=True):
        want, got = ref.outputs[0], fast.outputs[0]
        for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
            if a != b:
                top = sorted(want.logprobs[i][1].values(), reverse=True)  # (logprob, top-k)
                assert top[0] - top[1] < 1e-3, f"parted at token {i} without a near-tie"
                break
