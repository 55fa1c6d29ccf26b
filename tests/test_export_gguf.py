"""GGUF export: blocks decoded by gguf-py's reference codecs equal our dequantized weights;
llama.cpp loads the file and computes the same logits as our torch backend."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.loaders.gguf import unpermute_qk
from edgellm.loaders.model import load_model
from edgellm.quantize.build import build_model
from edgellm.quantize.export_gguf import exact_type, export_gguf, int_blocks, permute_qk
from edgellm.quantize.rtn import QuantConfig, dequantize, quantize_rtn
from tests.conftest import bpe_tokenizer, tiny_hf_model
from tests.test_checkpoint import write_checkpoint

Q = gguf.GGMLQuantizationType


def fp16_reference(qw, zero_rounding: bool) -> torch.Tensor:
    """What the GGUF blocks must decode to: our dequantization with fp16 d (and m)."""
    d = qw.scale.to(torch.float16).float()
    if qw.zero is None:
        return dequantize(qw.q, d, None, qw.config)
    g = qw.config.group_len(qw.q.shape[1])
    m = (-(8 + qw.zero.float()) * qw.scale.float()).to(torch.float16).float()
    qg = (qw.q.float() + 8).view(qw.q.shape[0], -1, g)
    return (qg * d[..., None] + m[..., None]).view(qw.q.shape) if zero_rounding else None


@pytest.mark.parametrize(
    "bits,group,sym", [(4, 32, True), (4, 64, False), (4, 128, True), (4, -1, False), (8, 32, True)]
)
def test_blocks_decode_to_our_weights(bits, group, sym):
    torch.manual_seed(bits + group)
    w = torch.randn(48, 256) * torch.rand(48, 1)
    qw = quantize_rtn(w, QuantConfig(bits, group, sym))
    qtype = exact_type(bits, sym)
    blocks = int_blocks(qw.q, qw.scale, qw.zero, bits, qtype)
    decoded = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(w.shape).copy())
    want = fp16_reference(qw, zero_rounding=True)
    assert torch.equal(decoded, want)  # bit for bit, against gguf-py's own codec
    # and that is our dequantization up to fp16 rounding (2^-11 relative) of d and m
    ours = qw.dequantize()
    levels = 2 ** (bits - 1) * (1 if sym else 4)  # |q - zero| and |m| / scale bounds
    assert (decoded - ours).abs().max() <= 2**-11 * qw.scale.max() * levels


def test_symmetric_codes_also_fit_q4_1():
    qw = quantize_rtn(torch.randn(8, 64), QuantConfig(4, 32, True))
    blocks = int_blocks(qw.q, qw.scale, None, 4, Q.Q4_1)
    decoded = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q4_1).reshape(8, 64).copy())
    assert (decoded - qw.dequantize()).abs().max() <= 2**-11 * qw.scale.max() * 16


def test_impossible_exports_are_refused():
    qw = quantize_rtn(torch.randn(8, 64), QuantConfig(4, 32, False))
    with pytest.raises(InvalidParameterError, match="re-quantizing"):
        int_blocks(qw.q, qw.scale, qw.zero, 4, Q.Q4_0)
    qw = quantize_rtn(torch.randn(8, 96), QuantConfig(4, 48, True))
    with pytest.raises(InvalidParameterError, match="multiple of 32"):
        int_blocks(qw.q, qw.scale, qw.zero, 4, Q.Q4_0)
    with pytest.raises(InvalidParameterError, match="exactly"):
        exact_type(3, True)


def test_permute_is_the_inverse_of_the_loader():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_qk(permute_qk(w, 4), 4), w)
    assert not torch.equal(permute_qk(w, 4), w)


CASES = {
    "llama-sym-g32": ("llama", QuantConfig(4, 32, True)),
    "qwen2-asym-g64": ("qwen2", QuantConfig(4, 64, False)),
    "llama-asym-channel": ("llama", QuantConfig(4, -1, False)),
}


def quantize_tiny(model_type: str, qconfig: QuantConfig):
    """A tiny model (vocab 264, as `bpe_tokenizer`) and RTN codes of its decoder Linears."""
    hf, cfg = tiny_hf_model(model_type, vocab_size=264)
    qws = {
        n.removesuffix(".weight"): quantize_rtn(t, qconfig)
        for n, t in hf.state_dict().items()
        if n.endswith("proj.weight")
    }
    return hf, cfg, qws


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    model_type, qconfig = CASES[request.param]
    hf, cfg, qws = quantize_tiny(model_type, qconfig)
    root = tmp_path_factory.mktemp(request.param)
    write_checkpoint(root / "ckpt", hf, cfg, qws, qconfig, tokenizer=bpe_tokenizer())
    out = export_gguf(root / "ckpt", root / "model.gguf")
    return root / "ckpt", out, qconfig


def test_exported_tensors_equal_checkpoint_weights(exported):
    ckpt, path, qconfig = exported
    ours = load_model(ckpt)
    back = load_model(path)  # our GGUF loader: gguf-py dequantization + q/k un-permutation
    types = {t.name: t.tensor_type for t in back.weights.reader.tensors}
    assert types["blk.0.attn_q.weight"] == exact_type(4, qconfig.symmetric)
    assert types["token_embd.weight"] in (Q.BF16, Q.F16, Q.F32)
    model = build_model(ours)
    for name, module in model.named_modules():
        if not hasattr(module, "weight_packed"):
            continue
        got = back.weights.get(f"{name}.weight")
        want = module.dequantize()
        tol = 0 if qconfig.symmetric else 2e-2 * module.weight_scale.float().abs().max()
        assert (got - want).abs().max() <= tol, name
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(back.weights.get(name), ours.weights.get(name).float())


def test_llamacpp_logits_match_torch(exported):
    from edgellm.backends.llamacpp import LlamaCppBackend
    from edgellm.backends.torch import TorchBackend
    from edgellm.engine.scheduler import ScheduledSeq
    from edgellm.engine.sequence import Sequence
    from edgellm.sampling.params import SamplingParams

    ckpt, path, _ = exported
    loaded = load_model(ckpt)
    ids = [3, 17, 101, 44, 250, 9, 77, 128, 5, 60, 61, 62]
    rows = {}
    backends = {
        "torch": TorchBackend(build_model(loaded), EngineConfig(kv_cache_mb=1, block_size=4)),
        "llamacpp": LlamaCppBackend(path, loaded.args, EngineConfig(kv_cache_mb=1, block_size=4)),
    }
    for name, backend in backends.items():
        seq = Sequence("r", list(ids), SamplingParams())
        seq.block_table = list(range(3))
        rows[name] = backend.forward([ScheduledSeq(seq, len(ids))], all_logits=True)
    assert rows["llamacpp"].shape == rows["torch"].shape == (len(ids), 264)
    # llama.cpp quantizes activations to 8 bits for its INT4 dot products: close, not equal
    err = (rows["llamacpp"] - rows["torch"]).abs().max() / rows["torch"].abs().max()
    assert err < 0.03, f"relative error {err:.4f}"
    agree = (rows["llamacpp"].argmax(-1) == rows["torch"].argmax(-1)).float().mean()
    assert agree >= 0.9


def test_float_export_and_refusals(tmp_path):
    hf, cfg, qws = quantize_tiny("llama", QuantConfig(4, 32, True))
    write_checkpoint(tmp_path / "ckpt", hf, cfg, qws, QuantConfig(4, 32, True), bpe_tokenizer())
    with pytest.raises(InvalidParameterError, match="re-quantizing"):
        export_gguf(tmp_path / "ckpt", tmp_path / "x.gguf", "q8_0")
    assert not (tmp_path / "x.gguf").exists()
    f16 = export_gguf(tmp_path / "ckpt", tmp_path / "f16.gguf", "f16")
    reader = gguf.GGUFReader(f16)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {Q.F16}
    # a float model (the f16 export itself) to Q8_0; asking it for Q4_0 says to quantize first
    q8 = export_gguf(f16, tmp_path / "q8.gguf", "q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(q8).tensors}
    assert types["blk.0.ffn_down.weight"] == Q.Q8_0
    with pytest.raises(InvalidParameterError, match="quantize first"):
        export_gguf(f16, tmp_path / "q4.gguf", "q4_0")
    assert np.array_equal(
        load_model(q8).weights.get("model.norm.weight").numpy(),
        load_model(f16).weights.get("model.norm.weight").numpy(),
    )


def test_cli_export_and_cached_llamacpp_run(exported, tmp_path, monkeypatch, capsys):
    from edgellm import LLM, SamplingParams
    from tests.test_cli import assert_one_line_error, run_cli

    ckpt, path, _ = exported
    out = tmp_path / "cli.gguf"
    code, stdout, _ = run_cli(["export", "gguf", str(ckpt), "-o", str(out)], capsys, monkeypatch)
    assert code == 0 and f"wrote {out}" in stdout
    assert out.read_bytes() == path.read_bytes()  # the export is deterministic
    code, _, err = run_cli(["export", "gguf", str(ckpt), "-o", str(out)], capsys, monkeypatch)
    assert_one_line_error(code, err, "exists")
    # a checkpoint on the llama.cpp backend: exported once into the cache, reused after
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "cache"))
    kw = dict(backend="llamacpp", kv_cache_mb=1, threads=1)
    first = LLM(str(ckpt), **kw)
    (cached,) = (tmp_path / "cache" / "gguf").glob("*.gguf")
    stamp = cached.stat().st_mtime_ns
    again = LLM(str(ckpt), **kw)
    assert cached.stat().st_mtime_ns == stamp
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [3, 17, 101, 44, 250, 9]
    want = LLM(str(path), **kw).generate([ids], params)[0].outputs[0].token_ids
    assert first.generate([ids], params)[0].outputs[0].token_ids == want
    assert again.generate([ids], params)[0].outputs[0].token_ids == want


def test_dense_type_q8_0_quantizes_only_embeddings_and_head(tmp_path):
    """`--dense-type q8_0`: the INT4 blocks stay exact, the embedding table becomes Q8_0
    (within a step of each block's scale); an unknown type is refused."""
    qconfig = QuantConfig(4, 32, True)
    hf, cfg, qws = quantize_tiny("llama", qconfig)
    write_checkpoint(tmp_path / "ckpt", hf, cfg, qws, qconfig, tokenizer=bpe_tokenizer())
    plain = load_model(export_gguf(tmp_path / "ckpt", tmp_path / "plain.gguf"))
    small = load_model(export_gguf(tmp_path / "ckpt", tmp_path / "q8.gguf", dense_type="q8_0"))
    types = {t.name: t.tensor_type for t in small.weights.reader.tensors}
    assert types["token_embd.weight"] == Q.Q8_0 and types["output.weight"] == Q.Q8_0
    assert types["blk.0.attn_q.weight"] == Q.Q4_0 and types["output_norm.weight"] == Q.F32
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(small.weights.get(name), plain.weights.get(name))
    want, got = (
        plain.weights.get("model.embed_tokens.weight"),
        small.weights.get("model.embed_tokens.weight"),
    )
    step = want.abs().reshape(-1, 32).amax(1, keepdim=True) / 127
    assert ((got - want).reshape(-1, 32).abs() <= step).all()  # half a step, + fp16 scales
    assert (tmp_path / "q8.gguf").stat().st_size < (tmp_path / "plain.gguf").stat().st_size
    with pytest.raises(InvalidParameterError, match="unknown dense type"):
        export_gguf(tmp_path / "ckpt", tmp_path / "x.gguf", dense_type="q4_k")
    assert not (tmp_path / "x.gguf").exists()
