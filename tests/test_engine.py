"""The engine end to end on tiny random models: batching, chunking, preemption, caching."""

import pytest
import torch

from edgellm.engine.sequence import Sequence
from edgellm.errors import ContextLengthError, InvalidParameterError
from edgellm.sampling.params import SamplingParams
from tests.conftest import run_all, tiny_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 256, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_batched_greedy_equals_one_at_a_time():
    ps = prompts(8)
    alone = [tokens(run_all(tiny_engine(), [p], GREEDY))[0] for p in ps]
    batched = tokens(run_all(tiny_engine(), ps, GREEDY))
    assert batched == alone


def test_chunked_prefill_and_preemption_give_the_same_tokens():
    ps = prompts(6, seed=1)
    ref = tokens(run_all(tiny_engine(), ps, GREEDY))
    chunked = tiny_engine(max_num_batched_tokens=16)
    assert tokens(run_all(chunked, ps, GREEDY)) == ref
    # a pool of 40 blocks of 4 tokens (512 bytes a token) cannot hold all six: preemption
    small = tiny_engine(kv_cache_mb=40 * 4 * 512 / 2**20, block_size=4)
    assert small.block_manager.num_blocks == 40
    assert tokens(run_all(small, ps, GREEDY)) == ref
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free == small.block_manager.num_blocks


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swapping_preempted_kv_to_a_host_pool_gives_the_same_tokens(mode):
    """Offloading: preempted sequences' blocks go to a host pool (standing in for device ->
    host memory) and come back instead of being recomputed; the continuation is
    token-identical, prefix-cache hits included, and no block, device or host, is left."""
    ps = prompts(6, seed=1)
    shared = list(range(1, 30))
    ps += [shared + [7], shared + [8]]  # two that share prefix blocks
    ref = tokens(run_all(tiny_engine(), ps, GREEDY))
    small = tiny_engine(
        kv_cache_mb=40 * 4 * 512 / 2**20, block_size=4, swap_space_mb=1, preemption=mode
    )
    assert small.block_manager.num_host_blocks == small.backend.num_host_blocks > 0
    assert tokens(run_all(small, ps, GREEDY)) == ref
    assert small.scheduler.num_swaps > 0  # auto: a copy is measured far cheaper here
    assert small.scheduler.num_preemptions >= small.scheduler.num_swaps
    bm = small.block_manager
    assert bm.num_free == bm.num_blocks and len(bm.free_host) == bm.num_host_blocks
    bm.check_invariants([])


def test_recompute_mode_and_a_full_host_pool_fall_back_to_recomputing():
    ps = prompts(6, seed=1)
    ref = tokens(run_all(tiny_engine(), ps, GREEDY))
    mb = 40 * 4 * 512 / 2**20
    never = tiny_engine(kv_cache_mb=mb, block_size=4, swap_space_mb=1, preemption="recompute")
    assert tokens(run_all(never, ps, GREEDY)) == ref
    assert never.scheduler.num_preemptions > 0 and never.scheduler.num_swaps == 0
    # a host pool of 2 blocks holds no victim: every preemption recomputes
    tiny_pool = tiny_engine(
        kv_cache_mb=mb, block_size=4, swap_space_mb=2 * 4 * 512 / 2**20, preemption="swap"
    )
    assert tiny_pool.backend.num_host_blocks == 2
    assert tokens(run_all(tiny_pool, ps, GREEDY)) == ref
    assert tiny_pool.scheduler.num_preemptions > 0


def test_bad_offloading_options_are_clear_errors():
    from edgellm.config import EngineConfig

    with pytest.raises(InvalidParameterError, match="unknown preemption"):
        EngineConfig(preemption="sometimes")
    with pytest.raises(InvalidParameterError, match="swap_space_mb"):
        EngineConfig(swap_space_mb=-1)


def test_aborting_a_swapped_sequence_frees_its_host_blocks():
    eng = tiny_engine(
        kv_cache_mb=20 * 4 * 512 / 2**20, block_size=4, swap_space_mb=1, preemption="swap"
    )
    # four sequences of up to 34 tokens (9 blocks each) in 20 blocks: some get swapped
    ids = [eng.add_request(list(range(1 + i, 11 + i)), GREEDY) for i in range(4)]
    while not eng.scheduler.swapped and eng.has_unfinished():
        eng.step()
    assert eng.scheduler.swapped
    victim = eng.scheduler.swapped[0]
    assert victim.host_table and victim.num_computed_tokens > 0
    eng.abort(victim.request_id)
    assert not victim.host_table
    while eng.has_unfinished():
        eng.step()
    bm = eng.block_manager
    bm.check_invariants([])
    assert len(bm.free_host) == bm.num_host_blocks
    assert ids


def test_prefix_cache_hit_gives_same_tokens():
    eng = tiny_engine(block_size=8)
    shared = list(range(1, 41))
    first = run_all(eng, [shared + [50, 51]], GREEDY)[0]
    second = run_all(eng, [shared + [50, 51]], GREEDY)[0]
    assert second.num_cached_tokens == 40
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    cold = run_all(
        tiny_engine(block_size=8, enable_prefix_caching=False), [shared + [50, 51]], GREEDY
    )[0]
    assert cold.outputs[0].token_ids == first.outputs[0].token_ids
    assert eng.block_manager.prefix_hit_rate > 0


def test_full_prefix_hit_still_computes_last_token():
    eng = tiny_engine(block_size=8)
    p = list(range(1, 33))  # exactly 4 blocks
    a = run_all(eng, [p], GREEDY)[0]
    b = run_all(eng, [p], GREEDY)[0]
    assert b.num_cached_tokens == 24 and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_n_greater_than_one_forks_and_seeds_reproduce():
    eng = tiny_engine(block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    out = run_all(eng, [list(range(1, 11))], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    texts = [o.token_ids for o in out.outputs]
    assert len({tuple(t) for t in texts}) > 1  # different samples
    again = run_all(tiny_engine(block_size=4), [list(range(1, 11))], params)[0]
    assert [o.token_ids for o in again.outputs] == texts
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_seeded_sampling_does_not_depend_on_batch():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16)
    p = list(range(5, 25))
    alone = tokens(run_all(tiny_engine(), [p], params))[0]
    mixed = tokens(run_all(tiny_engine(), [p] + prompts(4), params))[0]
    assert alone == mixed


def test_abort_frees_everything():
    eng = tiny_engine(block_size=4)
    ids = [eng.add_request(p, SamplingParams(max_tokens=100)) for p in prompts(5)]
    for _ in range(3):
        eng.step()
    for rid in ids:
        eng.abort(rid)
    assert not eng.has_unfinished()
    assert eng.block_manager.num_free == eng.block_manager.num_blocks
    eng.block_manager.check_invariants([])


def test_stop_strings_max_tokens_and_streaming():
    eng = tiny_engine()
    free = run_all(eng, ["hello"], SamplingParams(temperature=0, max_tokens=40))[0]
    text = free.outputs[0].text
    assert free.outputs[0].finish_reason == "length" and len(free.outputs[0].token_ids) == 40
    stop = text[5:8]
    if stop:
        out = run_all(eng, ["hello"], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == text[: text.index(stop)]
    rid = eng.add_request("hello", SamplingParams(temperature=0, max_tokens=40))
    pieces = []
    while eng.has_unfinished():
        pieces += [d.text for d in eng.step() if d.request_id == rid]
    assert "".join(pieces) == text


def test_stop_token_ids_end_generation():
    eng = tiny_engine()
    free = run_all(eng, ["abc"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    stop_tok = free.token_ids[4]
    out = run_all(
        eng, ["abc"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]


def test_bad_requests_are_refused_clearly():
    eng = tiny_engine(max_model_len=64)
    with pytest.raises(ContextLengthError, match="context"):
        eng.add_request(list(range(1, 70)))
    with pytest.raises(InvalidParameterError, match="empty"):
        eng.add_request([])
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        eng.add_request([1, 2, 999])
    out = run_all(eng, [list(range(1, 60))], SamplingParams(temperature=0, max_tokens=100))[0]
    assert (
        out.outputs[0].finish_reason == "length"
        and len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    )


def test_score_matches_prefill_logits():
    eng = tiny_engine()
    ids = list(range(1, 50))
    lp = eng.score(ids)
    eng2 = tiny_engine(max_num_batched_tokens=7)
    torch.testing.assert_close(eng2.score(ids), lp, atol=1e-5, rtol=1e-5)
    assert lp.shape == (48,) and (lp <= 0).all()
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_prefix_cache_hit_gives_same_logits():
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5)
    p = list(range(1, 45))
    warm = tiny_engine(block_size=8)
    run_all(warm, [p[:40] + [9]], params)
    hit = run_all(warm, [p], params)[0]
    cold = run_all(tiny_engine(block_size=8, enable_prefix_caching=False), [p], params)[0]
    assert hit.num_cached_tokens == 40
    for (lp_hit, top_hit), (lp_cold, top_cold) in zip(
        hit.outputs[0].logprobs, cold.outputs[0].logprobs, strict=True
    ):
        assert abs(lp_hit - lp_cold) < 1e-5
        assert top_hit.keys() == top_cold.keys()


def test_closing_a_stream_early_aborts_and_keeps_the_partial_output():
    from edgellm.entrypoints.llm import LLM

    llm = LLM.__new__(LLM)  # the engine part of LLM, on a tiny model
    llm.engine = tiny_engine(block_size=4)
    stream = llm.stream(
        [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    )
    first = [next(stream) for _ in range(3)]
    stream.close()
    out = llm.last_output
    assert out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].text.startswith("".join(first))
    assert (
        not llm.engine.requests
        and llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks
    )


def test_non_finite_logits_end_that_request_with_an_error_only():
    """A NaN in the model (here: the embedding of byte 7) fails the sequences it reaches with
    finish_reason "error", never a token drawn from NaN; other requests in the same batch
    finish exactly as without it."""
    clean, bad_prompt = [[1, 2, 3, 4] * 5, [9, 8, 6] * 7], [5, 6, 7, 8] * 5
    params = SamplingParams(max_tokens=6, temperature=0)
    want = tokens(run_all(tiny_engine(), clean, params))
    engine = tiny_engine()
    with torch.no_grad():
        engine.backend.model.model.embed_tokens.weight[7] = float("nan")
    outs = run_all(engine, [clean[0], bad_prompt, clean[1]], params)
    assert tokens([outs[0], outs[2]]) == want
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "NaN logits" in failed.error
    assert engine.block_manager.num_free == engine.block_manager.num_blocks



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf"), "row -inf"])
def test_step_checks_find_each_unusable_row_and_each_rows_argmax(dtype, bad):
    """The step's check (one pass: argmax, or max without greedy rows; numpy on CPU float32,
    torch otherwise) fails exactly when a row holds a NaN or a +inf, or nothing but -inf; a
    -inf among finite logits is a token ruled out, not an error. Its argmax is torch's."""
    from edgellm.engine.engine import _step_checks, _usable

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 1000, generator=g) * 5).to(dtype)
    if bad == "row -inf":
        logits[1] = float("-inf")
    elif bad is not None:
        logits[1, 517] = bad
    # the rule, element by element: no NaN, no +inf, at least one finite logit
    usable = [
        not row.isnan().any() and not row.isposinf().any() and bool(row.isfinite().any())
        for row in logits
    ]
    finite, argmax = _step_checks(logits, plain=True)
    assert finite == all(usable) == (bad in (None, float("-inf")))
    assert [_usable(row[None]) for row in logits] == usable
    if finite:
        assert argmax == logits.float().argmax(-1).tolist()
        assert argmax[1] != 517 or bad is None
    assert _step_checks(logits, plain=False) == (finite, [])
    assert _step_checks(logits[:0], plain=True) == (True, [])


def test_unusable_rows_are_named_by_what_is_wrong():
    from edgellm.engine.engine import _non_finite

    seq = Sequence("r", [1, 2, 3], SamplingParams())
    row = torch.zeros(1, 8)
    nan, pos, neg = row.clone(), row.clone(), torch.full((1, 8), float("-inf"))
    nan[0, 3], pos[0, 3] = float("nan"), float("inf")
    assert "NaN logits at token 3" in _non_finite(seq, nan)
    assert "infinite logits" in _non_finite(seq, pos)
    assert "-inf for every token" in _non_finite(seq, neg)


def test_n_children_count_against_max_num_seqs_from_admission():
    """A request's n sequences are admitted together: forking after the prompt never takes
    the running set past max_num_seqs, and every completion still arrives."""
    engine = tiny_engine(max_num_seqs=4)
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=1, n=3, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(3)]
    ids.append(engine.add_request(prompts(1, seed=9)[0], SamplingParams(max_tokens=5)))
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most <= 4
    outs = [engine.pop_output(i) for i in ids]
    assert [len(o.outputs) for o in outs] == [3, 3, 3, 1]
    assert all(len(c.token_ids) == 5 for o in outs[:3] for c in o.outputs)
