"""The llama.cpp backend under the shared engine, on the real SmolLM2 GGUF.

Oracle: llama-cpp-python's own `Llama` greedy generation on the same file, with the same
K/V types: every test taking `llm` or `reference` runs with f16 K/V and again with q8_0
(`kv_cache_dtype="int8"`), both under flash attention.
"""

from __future__ import annotations

import pytest

from edgellm.sampling.params import SamplingParams
from tests.conftest import next_logits

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. Answer in one short paragraph, "
    "plainly, without lists, and say when you are unsure.<|im_end|>\n<|im_start|>user\n"
)


# K/V storage: ours (EngineConfig.kv_cache_dtype) and Llama's (type_k / type_v; 8 = q8_0)
KV = {"auto": ({}, {}), "int8": ({"kv_cache_dtype": "int8"}, {"type_k": 8, "type_v": 8})}


@pytest.fixture(scope="module", params=list(KV))
def kv(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llm(smollm2_path, kv):
    from edgellm.entrypoints.llm import LLM

    return LLM(
        str(smollm2_path), backend="llamacpp", llamacpp_type="file", kv_cache_mb=64, threads=2,
        **KV[kv][0],
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(smollm2_path, kv):
    """Llama's own greedy continuation (64 tokens) of each prompt's token ids."""
    from llama_cpp import Llama

    ref = Llama(
        str(smollm2_path), n_ctx=512, n_threads=2, flash_attn=True, verbose=False, **KV[kv][1]
    )
    out = {}
    for p in PROMPTS:
        ids = ref.tokenize(p.encode(), add_bos=False, special=True)
        toks = []
        for t in ref.generate(ids, temp=0.0, top_k=1, reset=True):
            toks.append(t)
            if len(toks) == 64:
                break
        out[p] = (ids, toks)
    ref.close()
    return out


def greedy(n: int = 64) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# llama.cpp's kernels are not batch-invariant: a different batch shape (several sequences,
# a shorter prefill chunk after a prefix hit) changes the float summation order, so a
# near-tie between the two best tokens may flip. Equal outputs are required up to such a
# flip, and a flip is accepted only where the two tokens' logits are this close.
NEAR_TIE = 0.5  # logits of ~20: a 2.5% wobble; mixing sequences up would part them early and far


def assert_same_tokens(llm, prompt: list[int], got: list[int], want: list[int]) -> None:
    """got == want (over the shorter: a small context stops early), or they part at a
    near-tie of `want`'s own logits."""
    n = min(len(got), len(want))
    d = next((i for i, (a, b) in enumerate(zip(got[:n], want[:n], strict=True)) if a != b), None)
    if d is None:
        return
    logits = next_logits(llm, prompt + want[:d])
    gap = float(logits[want[d]] - logits[got[d]])
    assert abs(gap) < NEAR_TIE, f"outputs part at token {d} with a logit gap of {gap:.3f}"


def assert_no_cells(llm) -> None:
    """No running sequence holds llama.cpp cells; keepers hold only cached blocks."""
    engine = llm.engine
    cells = engine.backend.cells
    assert not cells.live
    n_live = cells.keepers[0].lseq  # lseqs below the keepers serve running sequences
    for lseq in range(n_live):
        assert cells.cell_positions(lseq) == (-1, -1), f"lseq {lseq} still holds cells"
    bm = engine.block_manager
    for k in cells.keepers:
        held = [i for i, b in enumerate(k.table) if b is not None]
        lo, hi = cells.cell_positions(k.lseq)
        if not held:
            assert (lo, hi) == (-1, -1)
        else:
            assert lo <= held[0] * bm.block_size and hi == (held[-1] + 1) * bm.block_size - 1
    assert bm.num_free == bm.num_blocks
    engine.block_manager.check_invariants([])
    kept = {(k.lseq, i): b for k in cells.keepers for i, b in enumerate(k.table) if b is not None}
    assert kept == {key: b for key, (_, b) in cells.kept.items()}
    assert len(kept) <= cells.keep_blocks
    assert all(bm.is_cached(b) for b in kept.values())  # nothing kept that the cache forgot


def test_greedy_equals_llama(llm, reference):
    for p, (ids, want) in reference.items():
        out = llm.generate([ids], greedy())[0]
        assert out.outputs[0].token_ids == want, p
    assert_no_cells(llm)


def test_batched_equals_alone(llm, reference):
    prompts = [ids for ids, _ in reference.values()]
    outs = llm.generate(prompts, greedy())
    for out, (ids, want) in zip(outs, reference.values(), strict=True):
        assert_same_tokens(llm, ids, out.outputs[0].token_ids, want)
    assert_no_cells(llm)


def test_prefix_hit_gives_same_tokens(llm):
    tok = llm.tokenizer
    prompts = [
        tok.encode(SYSTEM + q + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        for q in ("Why is the sky blue?", "What is rain?")
    ]
    bm = llm.engine.block_manager
    bm.enable_prefix_caching = False
    try:
        fresh = [llm.generate([p], greedy(32))[0] for p in prompts]
    finally:
        bm.enable_prefix_caching = True
    assert all(f.num_cached_tokens == 0 for f in fresh)
    llm.generate(prompts[:1], greedy(4))  # caches the system prompt's blocks (then kept)
    for p, f in zip(prompts, fresh, strict=True):
        hit = llm.generate([p], greedy(32))[0]
        assert hit.num_cached_tokens >= 32  # the shared system prompt came from the cache
        assert_same_tokens(llm, p, hit.outputs[0].token_ids, f.outputs[0].token_ids)
    assert_no_cells(llm)


def test_forks_share_cells(llm, reference):
    ids, want = next(iter(reference.values()))
    out = llm.generate([ids], SamplingParams(n=3, max_tokens=64, temperature=0.0, ignore_eos=True))[
        0
    ]
    for c in out.outputs:
        assert_same_tokens(llm, ids, c.token_ids, want)
    assert_no_cells(llm)


def test_preemption_and_aborts_leave_no_cells(smollm2_path, reference, kv):
    from edgellm.entrypoints.llm import LLM

    # a pool of 3 blocks of 16 tokens (48 tokens) for 4 sequences: preemption guaranteed
    # (q8_0 K/V take 68 bytes a row of 64 where f16 takes 128)
    mb = 1.2 * (68 / 128 if kv == "int8" else 1)
    small = LLM(
        str(smollm2_path), backend="llamacpp", llamacpp_type="file", kv_cache_mb=mb, threads=2,
        **KV[kv][0],
    )  # fmt: skip
    assert small.engine.block_manager.num_blocks == 3
    engine = small.engine
    prompts = [ids for ids, _ in reference.values()]
    outs = small.generate(prompts, greedy())
    assert engine.scheduler.num_preemptions > 0
    for out, (ids, want) in zip(outs, reference.values(), strict=True):
        got = out.outputs[0].token_ids
        # the pool holds 48 tokens: a sequence reaching them stops for length
        assert len(got) == min(len(want), small.engine.max_model_len - len(ids))
        assert_same_tokens(small, ids, got, want)
    assert_no_cells(small)
    rids = [engine.add_request(p, greedy()) for p in prompts * 2]
    for step in range(12):
        engine.step()
        if step % 3 == 0:
            engine.abort(rids.pop(0))
    for rid in rids:
        engine.abort(rid)
    assert not engine.has_unfinished()
    assert_no_cells(small)


def test_truncate_then_recompute(llm, reference):
    """Speculative rollback: drop the last tokens' cells, recompute them, same logits."""
    from edgellm.engine.scheduler import ScheduledSeq
    from edgellm.engine.sequence import Sequence

    engine = llm.engine
    ids, want = next(iter(reference.values()))
    seq = Sequence("t", ids + want[:8], greedy())
    engine.block_manager.allocate(seq, use_prefix_cache=False)
    backend = engine.backend
    # cloned: the backend's logits are a view of llama.cpp's buffer, valid until the next forward
    full = backend.forward([ScheduledSeq(seq, len(seq))], all_logits=True).clone()
    seq.num_computed_tokens = len(seq)
    keep = len(ids) + 2
    engine.block_manager.trim(seq, keep)
    backend.truncate(seq, keep)
    assert backend.cells.cell_positions(backend.cells.live[seq.seq_id].lseq)[1] == keep - 1
    engine.block_manager.append_slots(seq)
    again = backend.forward([ScheduledSeq(seq, len(seq) - keep)], all_logits=True)
    assert (again - full[keep:]).abs().max() < 1e-3
    engine.block_manager.free(seq)
    backend.release(seq)
    assert_no_cells(llm)


def test_a_cache_too_small_for_two_blocks_is_refused(smollm2_path):
    from edgellm import LLM
    from edgellm.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="holds only"):
        LLM(str(smollm2_path), backend="llamacpp", llamacpp_type="file", kv_cache_mb=0.01)
    with pytest.raises(InvalidParameterError, match="needs flash attention"):
        LLM(str(smollm2_path), backend="llamacpp", llamacpp_type="file", kv_cache_dtype="int8",
            flash_attn=False)  # fmt: skip


def test_auto_runs_the_default_model_from_its_f16_export(smollm2_path):
    """The registry names F16 for SmolLM2 on llama.cpp (its Q4_1 file loses answers there);
    "file" runs the packaged file itself; an unlisted model's file runs as it is."""
    import gguf

    from edgellm.backends.llamacpp import gguf_for
    from edgellm.loaders.model import load_model

    loaded = load_model(str(smollm2_path))
    assert gguf_for(loaded, "file") == smollm2_path
    f16 = gguf_for(loaded, "auto")
    assert f16 != smollm2_path and f16 == gguf_for(loaded, "f16")  # one cached export
    types = {t.tensor_type for t in gguf.GGUFReader(f16).tensors if t.name.endswith("q.weight")}
    assert types == {gguf.GGMLQuantizationType.F16}


def test_kept_cells_stay_within_budget_least_recent_going_first(smollm2_path):
    """Past `llamacpp_keep_tokens` the least recently used blocks leave the prefix cache, so
    kept cells (in every sequence's attention window) stay bounded; recent prefixes still
    hit, and a prefix hit makes its blocks recent again."""
    from edgellm.entrypoints.llm import LLM

    small = LLM(
        str(smollm2_path),
        backend="llamacpp",
        llamacpp_type="file",
        kv_cache_mb=64,
        threads=2,
        llamacpp_keep_tokens=256,  # 16 blocks
    )
    tok = small.tokenizer
    prompts = [
        tok.encode(f"Note {i}: " + "the quick brown fox jumps over the lazy dog. " * 5)
        for i in range(8)
    ]  # ~55 tokens: 3 full blocks each
    small.generate(prompts[:2], greedy(4))
    small.generate(prompts[:1], greedy(4))  # prompt 0 used again: recent
    for p in prompts[2:6]:  # 18 blocks for a budget of 16: two go
        small.generate([p], greedy(4))
    assert_no_cells(small)
    cells = small.engine.backend.cells
    assert len(cells.kept) == cells.keep_blocks
    # newest first: a miss would keep its own blocks and evict older ones
    hits = {i: small.generate([prompts[i]], greedy(1))[0].num_cached_tokens for i in (5, 4, 0, 1)}
    assert hits[5] == hits[4] == 48  # the most recent prompts still hit
    assert hits[0] == 48  # used again after prompt 1: outlived it
    assert hits[1] == 16  # the least recent lost its deepest blocks, kept its first
    assert_no_cells(small)
