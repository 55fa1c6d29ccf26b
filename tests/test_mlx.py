"""The MLX backend (MLX's CPU build on this Linux machine) and `edgellm export mlx`.

Oracles: our torch backend (logits on tiny models, greedy tokens on SmolLM2 up to a
near-tie), MLX's own `mx.dequantize` (the INT mapping, bit for bit) and mlx-lm, which must
load an export as it is and generate our tokens. The engine-level contract (forks, prefix
hits, aborts, preemption, truncate) and speculative identity run on MLX through
tests/test_backend_contract.py and tests/test_speculative.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

from edgellm.backends import mlx as mlx_backend  # noqa: E402
from edgellm.backends.mlx import MLXBackend  # noqa: E402
from edgellm.backends.registry import AUTO_ORDER, resolve_backend  # noqa: E402
from edgellm.backends.torch import TorchBackend  # noqa: E402
from edgellm.config import EngineConfig  # noqa: E402
from edgellm.engine.block_manager import BlockManager  # noqa: E402
from edgellm.engine.engine import Engine  # noqa: E402
from edgellm.engine.scheduler import ScheduledSeq  # noqa: E402
from edgellm.engine.sequence import Sequence  # noqa: E402
from edgellm.entrypoints import cli  # noqa: E402
from edgellm.entrypoints.llm import LLM  # noqa: E402
from edgellm.errors import (  # noqa: E402
    InvalidParameterError,
    ModelFormatError,
    OutputExistsError,
    UnsupportedArchitectureError,
)
from edgellm.kernels.int4_matmul import dequantize_weight  # noqa: E402
from edgellm.loaders.model import load_model as load_ours  # noqa: E402
from edgellm.quantize import QuantizeOptions, quantize  # noqa: E402
from edgellm.quantize.build import build_model  # noqa: E402
from edgellm.quantize.export_mlx import affine_from_packed, export_mlx  # noqa: E402
from edgellm.quantize.format import pack_int32  # noqa: E402
from edgellm.quantize.linear import QuantLinear  # noqa: E402
from edgellm.sampling.params import SamplingParams  # noqa: E402
from tests.conftest import (  # noqa: E402
    byte_tokenizer,
    next_logits,
    ours_from_hf,
    run_all,
    tiny_hf_model,
)

FAST = dict(calib="shakespeare", n_samples=4, seq_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


# ---- the INT mapping ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_packed_groups_are_mlx_affine_groups_bit_for_bit(bits, group, sym):
    g = torch.Generator().manual_seed(bits * group + sym)
    out, inp, lo, hi = 24, 256, -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (out, inp), generator=g).to(torch.int8)
    scale = (torch.rand(out, inp // group, generator=g) * 0.1 + 1e-3).to(torch.bfloat16)
    zero = None if sym else torch.randint(lo, hi, (out, inp // group), generator=g).to(torch.int8)
    zp = None if zero is None else pack_int32(zero, bits, dim=0)
    w, s, b = affine_from_packed(pack_int32(q, bits), scale, zp, bits, (out, inp))
    arrays = [mx.array(w.view(torch.int32).numpy()).view(mx.uint32), mx.array(s.numpy()),
              mx.array(b.numpy())]  # fmt: skip
    got = mx.dequantize(*arrays, group_size=group, bits=bits)
    want = dequantize_weight(q, scale, zero)
    assert np.array_equal(np.array(got), want.numpy())
    x = torch.randn(3, inp, generator=g)
    y = mx.quantized_matmul(mx.array(x.numpy()), *arrays, transpose=True, group_size=group,
                            bits=bits)  # fmt: skip
    np.testing.assert_allclose(np.array(y), (x @ want.T).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("bits", "group", "needle"), [
    (4, 16, "group sizes 32, 64, 128"), (4, 256, "group sizes"), (3, 32, "3-bit"),
])  # fmt: skip
def test_groups_and_bits_mlx_cannot_take_are_refused(bits, group, needle):
    q = torch.zeros(8, 256, dtype=torch.int8)
    scale = torch.ones(8, 256 // group)
    with pytest.raises(UnsupportedArchitectureError, match=needle):
        affine_from_packed(pack_int32(q, bits), scale, None, bits, (8, 256))


# ---- tiny models against the torch backend -------------------------------------------------------
def forward_logits(backend, chunks: list[list[int]]) -> torch.Tensor:
    """Every row's logits of one sequence fed in `chunks` (a prefix, then the rest)."""
    bm = BlockManager(backend.num_blocks, backend.block_size)
    ids = [t for c in chunks for t in c]
    seq = Sequence("s", ids, SamplingParams())
    bm.allocate(seq, use_prefix_cache=False)
    out, done = [], 0
    for c in chunks:
        out.append(backend.forward([ScheduledSeq(seq, len(c))], all_logits=True))
        done += len(c)
        bm.commit(seq, done)
    return torch.cat(out)


@pytest.mark.parametrize(("model_type", "tie"), [("llama", False), ("llama", True),
                                                 ("qwen2", False), ("mistral", False)])  # fmt: skip
def test_logits_equal_the_torch_backend(model_type, tie):
    hf, config = tiny_hf_model(model_type, tie=tie)
    model = ours_from_hf(hf, config)
    cfg = EngineConfig(kv_cache_mb=1.0, block_size=4)
    # a 21-token prompt (a long chunk, SDPA's causal mask) then 7 tokens after it (a short run)
    chunks = [list(range(3, 24)), list(range(40, 47))]
    want = forward_logits(TorchBackend(model, cfg), chunks)
    got = forward_logits(MLXBackend.from_torch(model, cfg), chunks)
    torch.testing.assert_close(got, want, atol=2e-5 * float(want.abs().max()), rtol=0)


def test_bfloat16_runs_within_its_precision():
    hf, config = tiny_hf_model("llama")
    model = ours_from_hf(hf, config)
    chunks = [list(range(3, 30))]
    want = forward_logits(TorchBackend(model, EngineConfig(kv_cache_mb=1.0)), chunks)
    got = forward_logits(MLXBackend.from_torch(model, EngineConfig(kv_cache_mb=1.0,
                                                                   dtype="bfloat16")), chunks)  # fmt: skip
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize(("kind", "tol"), [("q8", 0.02), ("q4", 0.3)])
def test_a_float_model_quantized_on_load(kind, tol):
    """mlx_quantize: a float model's Linears through `mx.quantize` (q8 near-lossless here)."""
    hf, config = tiny_hf_model("llama", intermediate_size=96)  # 96 inputs: group 32
    model = ours_from_hf(hf, config)
    chunks = [list(range(3, 30))]
    want = forward_logits(TorchBackend(model, EngineConfig(kv_cache_mb=1.0)), chunks)
    b = MLXBackend.from_torch(model, EngineConfig(kv_cache_mb=1.0, mlx_quantize=kind))
    layer = b.model.layers[0]
    assert layer.down_proj.bits == int(kind[1:]) and layer.down_proj.group_size == 32
    assert layer.qkv.group_size == 64 and layer.qkv.weight.dtype == mx.uint32
    got = forward_logits(b, chunks)
    assert 0 < float((got - want).abs().max()) < tol * float(want.abs().max())
    with pytest.raises(InvalidParameterError, match="mlx_quantize"):
        EngineConfig(mlx_quantize="q3")


def test_batched_rows_equal_alone_bit_for_bit():
    """A sequence's logits do not depend on what else is in the step (padding, grouping)."""
    hf, config = tiny_hf_model("llama")
    b = MLXBackend.from_torch(ours_from_hf(hf, config), EngineConfig(kv_cache_mb=1.0, block_size=4))
    bm = BlockManager(b.num_blocks, b.block_size)
    seqs = [Sequence(str(i), list(range(5 + i, 5 + i + n)), SamplingParams())
            for i, n in enumerate((9, 30, 3, 17))]  # fmt: skip
    for s in seqs:
        bm.allocate(s, use_prefix_cache=False)
    alone = [b.forward([ScheduledSeq(s, len(s.token_ids))], all_logits=True) for s in seqs]
    together = b.forward([ScheduledSeq(s, len(s.token_ids)) for s in seqs], all_logits=True)
    assert torch.equal(together, torch.cat(alone))


def test_engine_batched_chunked_equals_alone():
    hf, config = tiny_hf_model("qwen2")
    model = ours_from_hf(hf, config)
    cfg = EngineConfig(kv_cache_mb=1.0, block_size=4, max_num_batched_tokens=24)
    engine = Engine(MLXBackend.from_torch(model, cfg), byte_tokenizer(), cfg)
    prompts = ["a short one", "a much longer prompt that is prefilled in several chunks " * 2, "x"]
    alone = [run_all(engine, [p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in run_all(engine, prompts, GREEDY)]
    assert together == alone
    torch_engine = Engine(TorchBackend(model, cfg), byte_tokenizer(), cfg)
    assert [o.outputs[0].token_ids for o in run_all(torch_engine, prompts, GREEDY)] == alone
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_steps_run_ahead_give_the_tokens_of_steps_run_on_demand(monkeypatch):
    """Greedy decodes are queued one step ahead (mlx-lm's pipelining); requests arriving,
    finishing and sampling mid-run make the guess wrong, which must cost nothing but time."""
    hf, config = tiny_hf_model("llama")
    model = ours_from_hf(hf, config)
    cfg = EngineConfig(kv_cache_mb=1.0, block_size=4)
    used = []
    matches = mlx_backend._Ahead.matches
    monkeypatch.setattr(mlx_backend._Ahead, "matches",
                        lambda self, batch: used.append(matches(self, batch)) or used[-1])  # fmt: skip

    def run(ahead: bool):
        monkeypatch.setattr(MLXBackend, "run_ahead", ahead)
        engine = Engine(MLXBackend.from_torch(model, cfg), byte_tokenizer(), cfg)
        sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True)
        ids = [engine.add_request("first prompt", GREEDY), engine.add_request("second", sampled)]
        outs, step = {}, 0
        while engine.has_unfinished():
            engine.step()
            step += 1
            if step == 8:  # arrives mid-decode: the step run ahead is dropped
                ids.append(engine.add_request("a late one", GREEDY))
        for i in ids:
            outs[i] = engine.pop_output(i).outputs[0].token_ids
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
        return outs

    assert run(True) == run(False)
    assert True in used and False in used  # guesses were used, and wrong ones dropped


def test_auto_picks_mlx_only_on_apple_silicon():
    assert (AUTO_ORDER[0] == "mlx") == mlx_backend.apple_silicon()
    assert (resolve_backend("auto") == "mlx") == mlx_backend.apple_silicon()
    assert "mlx backend: MLX" in mlx_backend.describe()


# ---- an INT checkpoint and its export ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny llama (96-wide MLP: group 64 falls back to 32 on down_proj) and its asymmetric
    RTN checkpoint."""
    root = tmp_path_factory.mktemp("mlx")
    hf, _ = tiny_hf_model("llama", intermediate_size=96)
    hf.save_pretrained(root / "src")
    byte_tokenizer(eos_id=0).save_pretrained(root / "src")
    opts = QuantizeOptions(method="rtn", group_size=64, symmetric=False, **FAST)
    quantize(str(root / "src"), str(root / "q"), opts, progress=False)
    return root


def test_int_checkpoint_runs_as_its_dequantized_weights(tiny_ckpt, monkeypatch):
    monkeypatch.setattr(QuantLinear, "use_fast", False)  # torch: dequantize-then-matmul, fp32
    ids = list(range(1, 50))
    # fp32 on both (torch's "auto" is bf16 on CPUs with native bf16 dot products)
    want = LLM(str(tiny_ckpt / "q"), backend="torch", kv_cache_mb=1.0, dtype="float32").score(ids)
    got = LLM(str(tiny_ckpt / "q"), backend="mlx", kv_cache_mb=1.0, dtype="float32").score(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_export_loads_in_mlx_lm_with_our_exact_weights(tiny_ckpt):
    from mlx_lm.utils import load_model

    out, weights = export_mlx(tiny_ckpt / "q", tiny_ckpt / "mlx", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["group_size"] == 64 and "quantization_config" not in cfg
    assert cfg["quantization"]["model.layers.0.mlp.down_proj"]["group_size"] == 32
    assert weights.scale_dtype == torch.float32  # asymmetric: biases are not exact in fp16
    assert (out / "tokenizer.json").exists() and not list(out.parent.glob(".mlx.partial*"))
    theirs, _ = load_model(out)
    ours = build_model(load_ours(tiny_ckpt / "q"))
    n = 0
    for name, mod in ours.named_modules():
        if isinstance(mod, QuantLinear):
            m = theirs
            for part in name.split("."):
                m = m[int(part)] if part.isdigit() else getattr(m, part)
            w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
            assert np.array_equal(np.array(w), mod.dequantize().numpy()), name
            n += 1
    assert n == 7 * ours.args.num_hidden_layers
    # mlx-lm's own forward over the export equals our MLX backend's logits
    ids = list(range(1, 40))
    llm = LLM(str(tiny_ckpt / "q"), backend="mlx", kv_cache_mb=1.0)
    b = llm.engine.backend
    got = forward_logits(b, [ids])
    want = np.array(theirs(mx.array([ids]))[0].astype(mx.float32))
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4, rtol=1e-4)


def test_export_refuses_and_loses_nothing(tiny_ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "exp"
    export_mlx(tiny_ckpt / "q", out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(OutputExistsError):
        export_mlx(tiny_ckpt / "q", out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(InvalidParameterError, match="source model"):
        export_mlx(tiny_ckpt / "q", tiny_ckpt / "q")
    # the export is mlx-lm's layout: edgellm's own loader says so and names the way to run it
    with pytest.raises(ModelFormatError, match="MLX-format quantized model .*mlx_lm.generate"):
        load_ours(out)
    # per-channel groups (96 wide on down_proj) are no MLX group size: one error, no output
    opts = QuantizeOptions(method="rtn", group_size=-1, **FAST)
    quantize(str(tiny_ckpt / "src"), str(tmp_path / "pc"), opts, progress=False)
    monkeypatch.setattr(sys, "argv", ["edgellm", "export", "mlx", str(tmp_path / "pc"),
                                      "-o", str(tmp_path / "pc-mlx")])  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "group sizes 32, 64, 128" in err and "Traceback" not in err
    assert not (tmp_path / "pc-mlx").exists() and not list(tmp_path.glob(".pc-mlx*"))
    with pytest.raises(UnsupportedArchitectureError, match="group sizes 32, 64, 128"):
        LLM(str(tmp_path / "pc"), backend="mlx", kv_cache_mb=1.0)  # nor can the backend run it
    for dtype, scale in (("float64", "auto"), ("auto", "bfloat16")):  # unknown names
        with pytest.raises(InvalidParameterError, match="unknown"):
            export_mlx(tiny_ckpt / "q", tmp_path / "names", dtype, scale)
    assert not (tmp_path / "names").exists()
    # llama3 RoPE stored as per-dimension factors (as GGUFs do): mlx-lm's config cannot say it
    src = tmp_path / "ff"
    shutil.copytree(tiny_ckpt / "src", src)
    cfg = json.loads((src / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": [1.0] * (head // 2)}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="per-dimension factors"):
        export_mlx(src, tmp_path / "ff-mlx")
    assert not (tmp_path / "ff-mlx").exists()
    monkeypatch.setattr(sys, "argv", ["edgellm", "export", "mlx", str(tiny_ckpt / "q"), "-o",
                                      str(out), "--force", "--scale-dtype", "float32"])  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code in (0, None) and "MLX affine int4" in capsys.readouterr().out


# ---- the real SmolLM2 ----------------------------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n",
    "The best way to learn a new language is",
    "In 1969, the first people to walk on the moon",
]
NEAR_TIE = 0.5  # as tests/test_llamacpp.py: a flip is accepted only where the two logits are this close


@pytest.fixture(scope="module")
def awq(tmp_path_factory, smollm2_path):
    """SmolLM2 as AWQ W4 g64 checkpoints, symmetric and asymmetric (a short calibration)."""
    root = tmp_path_factory.mktemp("awq")
    for sym in (True, False):
        opts = QuantizeOptions(method="awq", group_size=64, symmetric=sym, n_samples=4,
                               seq_len=128, awq_tokens=512, awq_grid=4)  # fmt: skip
        quantize(str(smollm2_path), str(root / ("sym" if sym else "asym")), opts, progress=False)
    return root


def assert_same_up_to_near_tie(reference, prompt, got, want) -> None:
    d = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if d is None:
        return
    logits = next_logits(reference, prompt + want[:d])
    gap = float(logits[want[d]] - logits[got[d]])
    assert abs(gap) < NEAR_TIE, f"outputs part at token {d} with a logit gap of {gap:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["float", "awq-sym", "awq-asym"])
def test_smollm2_greedy_equals_the_torch_backend(kind, smollm2_path, awq):
    path = str(smollm2_path) if kind == "float" else str(awq / kind.removeprefix("awq-"))
    # half the prompts each: float and the symmetric checkpoint the even ones, the
    # asymmetric one the odd ones
    prompts = PROMPTS[kind == "awq-asym" :: 2]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LLM(path, backend="torch", kv_cache_mb=32)
    llm = LLM(path, backend="mlx", kv_cache_mb=32)
    ids = [ref.tokenizer.encode(p) for p in prompts]
    want = [o.outputs[0].token_ids for o in ref.generate(ids, params)]
    got = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
    for p, g, w in zip(ids, got, want, strict=True):
        assert len(g) == 40
        assert_same_up_to_near_tie(ref, p, g, w)
    bm = llm.engine.block_manager
    assert bm.num_free == bm.num_blocks


@pytest.mark.slow
def test_smollm2_export_generates_our_tokens_in_mlx_lm(awq, tmp_path):
    """mlx_lm.load + its own greedy generation on the export give `-b mlx`'s tokens and text."""
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    out, weights = export_mlx(awq / "sym", tmp_path / "mlx", dtype="float32")
    assert weights.scale_dtype == torch.float16  # symmetric: every bias -8 * scale is exact
    model, tok = load(str(out))
    llm = LLM(str(awq / "sym"), backend="mlx", kv_cache_mb=32)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        ids = llm.tokenizer.encode(prompt)
        assert ids == tok.encode(prompt)
        theirs = [r.token for r in stream_generate(model, tok, ids, max_tokens=24,
                                                   sampler=make_sampler(temp=0.0))]  # fmt: skip
        ours = llm.generate([ids], params)[0].outputs[0]
        # mlx-lm stops after yielding an end-of-sequence token; ours goes on (ignore_eos)
        if len(theirs) < 24:
            assert theirs[-1] in tok.eos_token_ids, (prompt, theirs)
        assert ours.token_ids[: len(theirs)] == theirs, prompt
        if len(theirs) == 24:
            assert ours.text == tok.decode(theirs)
        else:
            assert llm.tokenizer.decode(ours.token_ids[: len(theirs)]) == tok.decode(theirs)
    assert Path(out / "tokenizer_config.json").exists()
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text()) or (
        out / "chat_template.jinja"
    ).exists()
