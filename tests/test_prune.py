"""Structured pruning (edgellm.distill.prune) on tiny random models: the student is exactly
the teacher with the pruned parts removed, importance picks what does least, the result
loads on every CPU backend and exports to GGUF, bad options are one clear error."""

from __future__ import annotations

import pytest
import torch

from edgellm.backends.torch import TorchBackend
from edgellm.config import EngineConfig
from edgellm.distill.prune import PruneOptions, prune
from edgellm.engine.engine import Engine
from edgellm.errors import InvalidParameterError
from edgellm.loaders.model import load_model
from edgellm.quantize.build import build_model
from edgellm.sampling.params import SamplingParams
from tests.conftest import bpe_tokenizer, run_all, tiny_hf_model

# 4 layers, 6 query / 2 KV heads of 16 (GQA 3:1), MLP 128 wide
SHAPE = dict(
    hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=4,
    intermediate_size=128, vocab_size=264,
)  # fmt: skip
CFG = EngineConfig(kv_cache_mb=1.0, block_size=4)
CALIB: dict = {}


@pytest.fixture(autouse=True, scope="module")
def calibration_text(tmp_path_factory):
    """A few pages of real text (State of the Union) as a file: tokenizing all of it with
    the tiny byte-level BPE would take most of each test."""
    from edgellm.loaders.texts import load_text

    path = tmp_path_factory.mktemp("calib") / "sotu.txt"
    path.write_text(load_text("sotu")[:20000])
    CALIB.update(calib=str(path), n_samples=4, seq_len=32, dtype="float32")
    yield
    CALIB.clear()


def teacher_dir(tmp_path, model_type="qwen2", weak_layer: int | None = None):
    hf, _ = tiny_hf_model(model_type, **SHAPE)
    if weak_layer is not None:  # a layer that barely changes its input
        with torch.no_grad():
            layer = hf.model.layers[weak_layer]
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
    path = tmp_path / "teacher"
    hf.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def scores(model, ids: list[int]) -> torch.Tensor:
    return Engine(TorchBackend(model, CFG), bpe_tokenizer(), CFG).score(ids)


IDS = list(range(40, 90))


def test_pruning_nothing_reproduces_the_teacher(tmp_path):
    src = teacher_dir(tmp_path)
    out, p, imp = prune(str(src), tmp_path / "same", PruneOptions(**CALIB))
    assert p.layers == [0, 1, 2, 3] and len(imp.block_influence) == 4
    got = scores(build_model(load_model(str(out))), IDS)
    want = scores(build_model(load_model(str(src))), IDS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_student_is_the_teacher_with_the_pruned_parts_removed(tmp_path):
    """Dropping a layer = skipping it; removing MLP channels and KV groups = zeroing the
    down_proj / o_proj columns they feed: the scores agree to float32 rounding."""
    src = teacher_dir(tmp_path)
    opts = PruneOptions(drop_layers=1, mlp_width=64, heads=3, **CALIB)
    out, p, _ = prune(str(src), tmp_path / "small", opts)
    loaded = load_model(str(out))
    a = loaded.args
    assert (a.num_hidden_layers, a.intermediate_size, a.num_attention_heads) == (3, 64, 3)
    assert (a.num_key_value_heads, a.head_dim) == (1, 16)
    student = build_model(loaded)
    teacher = build_model(load_model(str(src)))
    d, g = 16, 3
    with torch.no_grad():
        for layer, channels, groups in zip(
            [teacher.model.layers[i] for i in p.layers], p.mlp_channels, p.kv_groups, strict=True
        ):
            keep = torch.zeros(128, dtype=torch.bool)
            keep[channels] = True
            layer.mlp.down_proj.weight[:, ~keep] = 0
            heads = torch.zeros(6 * d, dtype=torch.bool)
            for k in groups:
                heads[k * g * d : (k + 1) * g * d] = True
            layer.self_attn.o_proj.weight[:, ~heads] = 0
    teacher.model.layers = torch.nn.ModuleList(teacher.model.layers[i] for i in p.layers)
    teacher.args.num_hidden_layers = len(p.layers)
    torch.testing.assert_close(scores(student, IDS), scores(teacher, IDS), atol=1e-4, rtol=0)
    assert sum(t.numel() for t in student.parameters()) < sum(
        t.numel() for t in build_model(load_model(str(src))).parameters()
    )


def test_block_influence_drops_the_layer_that_does_least(tmp_path):
    src = teacher_dir(tmp_path, weak_layer=2)
    _, p, imp = prune(str(src), tmp_path / "out", PruneOptions(drop_layers=1, **CALIB))
    assert min(range(4), key=lambda i: imp.block_influence[i]) == 2
    assert p.layers == [0, 1, 3]


def test_pruned_model_runs_on_llamacpp_through_a_gguf_export(tmp_path):
    pytest.importorskip("llama_cpp")
    from edgellm.backends.llamacpp import LlamaCppBackend
    from edgellm.quantize.export_gguf import export_gguf

    src = teacher_dir(tmp_path, "llama")
    out, _, _ = prune(str(src), tmp_path / "small", PruneOptions(drop_layers=1, heads=3, **CALIB))
    gguf = export_gguf(str(out), tmp_path / "small.gguf", "f16")
    loaded = load_model(str(out))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [IDS[:20]]
    ours = Engine(TorchBackend(build_model(loaded), CFG), bpe_tokenizer(), CFG)
    cfg = CFG.replace(threads=2)
    theirs = Engine(LlamaCppBackend(gguf, loaded.args, cfg), bpe_tokenizer(), cfg)
    want = run_all(ours, prompt, greedy)[0].outputs[0].token_ids
    got = run_all(theirs, prompt, greedy)[0].outputs[0].token_ids
    assert got[:3] == want[:3]  # f16 weights: they may part later at a near-tie
    assert load_model(str(gguf)).args.num_attention_heads == 3


def test_bad_options_are_one_clear_error_and_write_nothing(tmp_path):
    src = teacher_dir(tmp_path)
    before = sorted(p.name for p in src.iterdir())
    for opts, match in [
        (PruneOptions(drop_layers=4), "has 4 layers"),
        (PruneOptions(mlp_width=50), "multiple of 32"),
        (PruneOptions(mlp_width=256), "multiple of 32"),
        (PruneOptions(heads=4), "multiple of 3"),
        (PruneOptions(dtype="int8"), "unknown dtype"),
    ]:
        with pytest.raises(InvalidParameterError, match=match):
            prune(str(src), tmp_path / "bad", opts)
        assert not (tmp_path / "bad").exists()
    (tmp_path / "exists").mkdir()
    with pytest.raises(Exception, match="exists"):
        prune(str(src), tmp_path / "exists", PruneOptions(**CALIB))
    assert sorted(p.name for p in src.iterdir()) == before


def test_cli_prune(tmp_path, capsys, monkeypatch):
    from tests.test_cli import run_cli

    src = teacher_dir(tmp_path)
    out = tmp_path / "cli-out"
    args = ["prune", str(src), "-o", str(out), "--drop-layers", "1", "--mlp-width", "96"]
    args += ["--calib", CALIB["calib"], "--samples", "2", "--seq-len", "16"]
    code, stdout, _ = run_cli(args, capsys, monkeypatch)
    assert code == 0 and "3 layers, MLP 96, 6/2 heads" in stdout
    assert load_model(str(out)).args.intermediate_size == 96
    code, _, err = run_cli(["prune", str(src), "-o", str(tmp_path / "x"), "--heads", "5"], capsys, monkeypatch)
    assert code != 0 and "multiple of 3" in err
