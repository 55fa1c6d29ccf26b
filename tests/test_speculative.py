"""Speculative decoding on tiny random models: same tokens (greedy), same distribution
(sampling), no KV leak after rollbacks, prefix caching, stops, batching, adaptation."""

from __future__ import annotations

import atexit
import functools
import inspect
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from edgellm.backends.llamacpp import LlamaCppBackend
from edgellm.backends.mlx import MLXBackend
from edgellm.backends.registry import BACKENDS as REGISTRY
from edgellm.backends.torch import TorchBackend
from edgellm.config import EngineConfig, SpeculativeConfig
from edgellm.engine.engine import Engine
from edgellm.engine.speculator import Proposal
from edgellm.errors import InvalidParameterError
from edgellm.quantize.export_gguf import export_gguf
from edgellm.sampling.params import SamplingParams
from edgellm.sampling.sampler import process_logits
from edgellm.spec.acceptance import verify
from edgellm.spec.controller import Controller, choose_k, expected_tokens
from edgellm.spec.decoder import SpeculativeDecoder
from edgellm.spec.proposers import DraftProposer, NgramProposer
from tests.conftest import bpe_tokenizer, ours_from_hf, run_all, tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


VOCAB = 264  # bpe_tokenizer's: llama.cpp needs a tokenizer with merges in the GGUF


def tiny(seed: int = 0):
    """A tiny llama of VOCAB tokens and its config."""
    return tiny_hf_model("llama", seed=seed, vocab_size=VOCAB)


def ours(hf, config):
    """Our model of `hf`, remembering its source (the llama.cpp backend exports it)."""
    model = ours_from_hf(hf, config)
    model.hf_source = (hf, config)
    return model


_GGUF: dict[int, object] = {}


def llamacpp_backend(model, config: EngineConfig):
    """llama.cpp on an F16 GGUF export of the model's source (made once per source)."""
    hf, _ = model.hf_source
    if id(hf) not in _GGUF:
        root = Path(tempfile.mkdtemp(prefix="edgellm-spec-"))
        atexit.register(shutil.rmtree, root, True)  # the session's exports, not left in /tmp
        hf.save_pretrained(root / "hf")
        bpe_tokenizer().save_pretrained(root / "hf")
        _GGUF[id(hf)] = (hf, export_gguf(root / "hf", root / "model.gguf", "f16"))
    return LlamaCppBackend(_GGUF[id(hf)][1], model.args, config.replace(threads=2))


# every backend of the registry is one line here
BACKENDS = {"torch": TorchBackend, "llamacpp": llamacpp_backend, "mlx": MLXBackend.from_torch}


@pytest.fixture(params=list(BACKENDS))
def make_backend(request):
    if not REGISTRY[request.param].available():
        pytest.skip(f"{request.param} is not available on this machine")
    return BACKENDS[request.param]


@functools.cache
def hf_pair(noise: float, sharpen: float = 1.0, overconfident: float = 1.0):
    """A tiny target and a draft with the same vocab: the target's weights plus noise,
    logits scaled by `sharpen` (both) and `overconfident` (the draft only)."""
    target, config = tiny(seed=0)
    draft, _ = tiny(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpen)
        draft.lm_head.weight.mul_(sharpen * overconfident)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return target, draft, config


def models(noise: float = 0.3, sharpen: float = 1.0, overconfident: float = 1.0):
    target, draft, config = hf_pair(noise, sharpen, overconfident)
    return ours(target, config), ours(draft, config)


def plain_engine(make_backend, target, eos_id=None, **cfg) -> Engine:
    config = EngineConfig(**{"kv_cache_mb": 2.0, **cfg})
    return Engine(make_backend(target, config), bpe_tokenizer(eos_id=eos_id), config)


def spec_engine(
    make_backend, target, draft=None, k=4, adaptive=False, eos_id=None, ngram_min=2, **cfg
) -> Engine:
    config = EngineConfig(**{"kv_cache_mb": 2.0, **cfg})
    method = "draft" if draft is not None else "ngram"
    spec = SpeculativeConfig(
        method, k, "memory" if draft else None, ngram_min=ngram_min, adaptive=adaptive
    )
    if draft is not None:
        proposer = DraftProposer(make_backend(draft, config))
    else:
        proposer = NgramProposer(spec.ngram_max, spec.ngram_min)
    speculator = SpeculativeDecoder(spec, proposer)
    return Engine(make_backend(target, config), bpe_tokenizer(eos_id=eos_id), config, speculator)


def prompts(n: int, seed: int = 0, repeat: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(1, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g)
        out.append((p.tolist() * 3) if repeat else p.tolist())
    return out


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def run_checked(engine: Engine, ps, params) -> list:
    """run_all, also checking the draft's block invariants every step."""
    ids = [engine.add_request(p, params) for p in ps]
    while engine.has_unfinished():
        engine.step()
        live = [s for r in engine.requests.values() for s in r.seqs if s.block_table]
        engine.block_manager.check_invariants(live)
        if isinstance(engine.speculator.proposer, DraftProposer):
            mirrors = list(engine.speculator.proposer.mirrors.values())
            engine.speculator.proposer.block_manager.check_invariants(mirrors)
    return [engine.pop_output(i) for i in ids]


def assert_no_leak(engine: Engine) -> None:
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks
    if isinstance(engine.speculator.proposer, DraftProposer):
        assert not engine.speculator.proposer.mirrors
        dbm = engine.speculator.proposer.block_manager
        dbm.check_invariants([])
        assert dbm.num_free == dbm.num_blocks


# ---- greedy: identical tokens ---------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_with_and_without_speculation(make_backend, method):
    target, draft = models()
    ps = prompts(6, repeat=method == "ngram")
    ref = tokens(run_all(plain_engine(make_backend, target), ps, GREEDY))
    eng = spec_engine(make_backend, target, draft if method == "draft" else None, block_size=4)
    outs = run_checked(eng, ps, GREEDY)
    assert tokens(outs) == ref
    assert sum(o.metrics.spec.accepted for o in outs) > 0  # speculation really ran
    assert sum(o.metrics.spec.accepted < o.metrics.spec.proposed for o in outs) > 0
    assert_no_leak(eng)


def test_greedy_identical_with_unrelated_draft_and_adaptive_k(make_backend):
    target, _ = models()
    other = ours(*tiny(seed=5))  # different weights, same vocab
    ps = prompts(4, seed=2)
    ref = tokens(run_all(plain_engine(make_backend, target), ps, GREEDY))
    eng = spec_engine(make_backend, target, other, k=6, adaptive=True)
    assert tokens(run_checked(eng, ps, GREEDY)) == ref
    assert_no_leak(eng)


def test_batched_speculation_equals_alone(make_backend):
    target, draft = models(noise=0.5)
    ps = prompts(3, seed=3) + prompts(2, seed=4, repeat=True)
    alone = [
        tokens(run_checked(spec_engine(make_backend, target, draft), [p], GREEDY))[0] for p in ps
    ]
    eng = spec_engine(make_backend, target, draft, block_size=4)
    outs = run_checked(eng, ps, GREEDY)
    assert tokens(outs) == alone
    rates = {round(o.metrics.spec.acceptance_rate, 2) for o in outs}
    assert len(rates) > 1  # the batch mixes sequences with different acceptance
    assert_no_leak(eng)


def test_draft_catches_up_in_backend_sized_chunks(make_backend):
    target, draft = models()
    ps = prompts(3, seed=7)  # prompts up to 40 tokens, steps of at most 16 (llama.cpp's batch)
    ref = tokens(run_all(plain_engine(make_backend, target, max_num_batched_tokens=16), ps, GREEDY))
    eng = spec_engine(make_backend, target, draft, max_num_batched_tokens=16)
    assert tokens(run_checked(eng, ps, GREEDY)) == ref
    assert_no_leak(eng)


def test_no_kv_leak_with_preemption_and_rollbacks(make_backend):
    target, draft = models(noise=0.5)
    ps = prompts(6, seed=1)
    ref = tokens(run_all(plain_engine(make_backend, target), ps, GREEDY))
    # 40 blocks of 4 tokens (80 on llama.cpp, whose K/V is fp16) cannot hold all six
    # sequences: preemption on top of rollbacks
    eng = spec_engine(make_backend, target, draft, kv_cache_mb=40 * 4 * 512 / 2**20, block_size=4)
    assert eng.block_manager.num_blocks in (40, 80)
    assert tokens(run_checked(eng, ps, GREEDY)) == ref
    assert eng.scheduler.num_preemptions > 0
    assert_no_leak(eng)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_prefix_cache_hits_with_speculation(make_backend, method):
    target, draft = models()
    eng = spec_engine(make_backend, target, draft if method == "draft" else None, block_size=8)
    shared = list(range(1, 41)) * 2
    first = run_checked(eng, [shared + [50, 51]], GREEDY)[0]
    second = run_checked(eng, [shared + [50, 51]], GREEDY)[0]
    assert second.num_cached_tokens == 80
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    ref = run_all(plain_engine(make_backend, target, block_size=8), [shared + [50, 51]], GREEDY)
    assert first.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert_no_leak(eng)


# ---- stops are honoured per accepted token ---------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stop_conditions_match_plain_decoding(make_backend, method):
    target, draft = models()
    draft = draft if method == "draft" else None
    p = prompts(1, seed=6, repeat=True)[0]
    full = run_all(plain_engine(make_backend, target), [p], GREEDY)[0].outputs[0]
    eos = full.token_ids[17]  # a token produced mid-way ends the completion there
    stop_text = bpe_tokenizer().decode(full.token_ids[9:12])
    cases = [
        (dict(eos_id=eos), SamplingParams(temperature=0.0, max_tokens=40)),
        ({}, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text])),
        ({}, SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)),
    ]
    for kw, params in cases:
        ref = run_all(plain_engine(make_backend, target, **kw), [p], params)[0].outputs[0]
        eng = spec_engine(make_backend, target, draft, ngram_min=1, **kw)
        got = run_checked(eng, [p], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            ref.token_ids,
            ref.text,
            ref.finish_reason,
        )
        assert len(got.token_ids) < len(full.token_ids)
        assert_no_leak(eng)


# ---- sampling: the target's distribution -----------------------------------------------------------
def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value; bins with expected count < 5 are merged into one."""
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def second_token_distribution(hf, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """Exact marginal of the 2nd sampled token from the transformers model (the oracle):
    sum over t1 of p(t1 | prompt) * p(t2 | prompt, t1), both after process_logits."""
    with torch.no_grad():
        first = hf(torch.tensor([prompt])).logits[0, -1]
        p1 = process_logits(first, params, prompt, []).softmax(-1)
        support = p1.nonzero()[:, 0]
        batch = torch.tensor([prompt + [int(t)] for t in support])
        rows = hf(batch).logits[:, -1]
    p2 = torch.stack(
        [
            process_logits(r, params, prompt, [int(t)]).softmax(-1)
            for r, t in zip(rows, support, strict=True)
        ]
    )
    return (p1[support, None] * p2).sum(0)


# an overconfident draft: where it is rejected, the target's residual must exclude its token
SHARP = (0.3, 3.0, 4.0)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(make_backend, method):
    target_hf, _, config = hf_pair(*SHARP)
    target, draft = models(*SHARP)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, ignore_eos=True)
    # every token occurs in the prompt, so the n-gram proposer (n >= 1) always drafts
    prompt = torch.randperm(256, generator=torch.Generator().manual_seed(0)).tolist() + [7, 30]
    expected = second_token_distribution(target_hf, prompt, params)
    eng = spec_engine(make_backend, target, draft if method == "draft" else None, k=2, ngram_min=1)
    n = 1500
    reqs = [SamplingParams(**{**_fields(params), "seed": i}) for i in range(n)]
    ids = [eng.add_request(prompt, r) for r in reqs]
    while eng.has_unfinished():
        eng.step()
    outs = [eng.pop_output(i) for i in ids]
    assert sum(o.metrics.spec.proposed for o in outs) > n // 2  # most were speculative
    second = torch.tensor([o.outputs[0].token_ids[1] for o in outs])
    observed = torch.bincount(second, minlength=expected.numel()).float()
    assert chi_square_pvalue(observed, expected * n) > 1e-3


@pytest.mark.parametrize("drafter", ["model", "one-hot"])
def test_acceptance_rule_reproduces_the_target_distribution(drafter):
    """The rule alone, many draws: drafted token ~ q (or a fixed one-hot guess), output ~ p."""
    g = torch.Generator().manual_seed(0)
    logits_p = torch.randn(12, generator=g) * 1.5  # processed target logits, 12 tokens
    q = (2.5 * logits_p + torch.randn(12, generator=g)).softmax(-1)  # overconfident draft
    p = logits_p.softmax(-1)
    rows = torch.stack([logits_p, logits_p])  # [k + 1, V] with k = 1
    params = SamplingParams(temperature=1.0)
    n = 6000
    counts = torch.zeros(12)
    for _ in range(n):
        if drafter == "model":
            d = int(torch.multinomial(q, 1, generator=g))
            proposal = Proposal([d], q[None])
        else:
            proposal = Proposal([int(p.argmax())])
        accepted, extra = verify(rows, proposal, params, g)
        counts[proposal.tokens[0] if accepted else extra] += 1
    assert chi_square_pvalue(counts, p * n) > 1e-3


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__slots__}


# ---- adaptation ------------------------------------------------------------------------------------
def test_controller_picks_k_by_measured_cost():
    from edgellm.engine.sequence import Sequence

    ctl = Controller(SpeculativeConfig("draft", 6, "memory"))
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    ctl.record_step(0.010, drafted=0)
    ctl.record_step(0.014, drafted=2)  # a drafted token adds 20% of a plain step
    assert ctl.cost(2) == pytest.approx(1.4) and ctl.cost(5) == pytest.approx(2.0)
    for _ in range(3):  # 90% accepted: long drafts pay
        ctl.record(seq, 2, 2, 3)
    st = ctl.state(seq)
    assert st.k >= 4 and st.off_until == 0
    expensive = Controller(SpeculativeConfig("draft", 6, "memory"))
    expensive.record_step(0.010, drafted=0)
    expensive.record_step(0.030, drafted=2)  # a drafted token costs a plain step
    for _ in range(4):  # 50% accepted: 2 tokens a step that costs 3 plain ones
        expensive.record(seq, 2, 1, 2)
    assert expensive.state(seq).off_until > 0


@pytest.mark.parametrize("costly_start", [False, True])
def test_a_draft_model_starts_only_where_it_pays(costly_start):
    from edgellm.engine.sequence import Sequence

    ctl = Controller(SpeculativeConfig("draft", 4, "memory"), costly_start=costly_start)
    first, second = (Sequence("r", [1, 2, 3], SamplingParams()) for _ in range(2))
    assert [ctl.k_for(first, 10) for _ in range(3)] == [0, 0, 4]  # nothing measured: try
    ctl.record_step(0.010, drafted=0)
    ctl.record_step(0.030, drafted=2)  # a drafted token costs a plain step
    for _ in range(4):
        ctl.record(first, 2, 1, 2)  # 50% accepted
    started = [ctl.k_for(second, 10) for _ in range(3)][-1] > 0
    assert started != costly_start  # a new sequence would pay a prefill for no gain


def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_choose_k_grows_with_acceptance():
    ks = [choose_k(a, 8) for a in (0.0, 0.3, 0.6, 0.8, 0.95, 1.0)]
    assert ks == sorted(ks) and ks[0] == 1 and ks[-1] == 8


def test_controller_switches_off_when_speculation_costs_more():
    from edgellm.engine.sequence import Sequence

    ctl = Controller(SpeculativeConfig("ngram", 4, probe_every=5))
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    assert [ctl.k_for(seq, 10) for _ in range(2)] == [0, 0]  # warm-up: plain steps
    ctl.record_step(0.010, drafted=0)
    for _ in range(4):  # each speculative step costs 3x a plain one but gains 2 tokens
        assert ctl.k_for(seq, 10) > 0
        ctl.record_step(0.030, drafted=4)
        ctl.record(seq, 4, 1, 2)
    assert [ctl.k_for(seq, 10) for _ in range(4)] == [0] * 4  # switched off ...
    assert ctl.k_for(seq, 10) == 1  # ... and probing again
    assert ctl.k_for(seq, 0) == 0  # never past max_tokens


# ---- the public interfaces -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speculative", "medusa"], "unknown speculative method"),
        (["--speculative", "draft"], "needs a draft model"),
        (["--speculative", "ngram", "--num-draft-tokens", "0"], "num_draft_tokens"),
    ],
)
def test_cli_rejects_bad_speculative_options(args, needle, capsys, monkeypatch):
    from tests.test_cli import assert_one_line_error, run_cli

    code, _, err = run_cli(["generate", "hi", *args], capsys, monkeypatch)
    assert_one_line_error(code, err, needle)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    from edgellm import LLM

    hf, _ = tiny()
    for name, merges in [("target", None), ("draft", ("e s", "t h", "Ġ w", "o r"))]:
        hf.save_pretrained(tmp_path / name)
        tok = bpe_tokenizer(merges) if merges else bpe_tokenizer()
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(InvalidParameterError, match="does not share the target's tokenizer"):
        LLM(str(tmp_path / "target"), speculative="draft", draft_model=str(tmp_path / "draft"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_smollm2_speculation_gives_the_same_greedy_text(smollm2_path, method, backend):
    from edgellm import LLM

    code = inspect.getsource(choose_k)
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n\n{code}"}]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = LLM(str(smollm2_path), backend=backend).chat(messages, params)[0]
    draft = str(smollm2_path) if method == "draft" else None  # itself: every token accepted
    spec = LLM(str(smollm2_path), backend=backend, speculative=method, draft_model=draft)
    spec = spec.chat(messages, params)[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    m = spec.metrics.spec
    assert m.proposed > 0 and m.tokens_per_forward > 1.0
    if method == "draft":
        assert m.acceptance_rate > 0.9
