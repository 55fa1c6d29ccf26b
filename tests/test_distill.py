"""Distillation (edgellm.distill) on tiny random models: the training forward is the serving
model's; KD lowers the held-out KL of a pruned and of an INT4 student; a distilled INT4
checkpoint keeps the exact layout (codes unchanged, same tensors, exact GGUF export whose
llama.cpp perplexity matches ours); interrupt + resume = one run; bad options are one
clear error; training windows never overlap held-out or evaluation text."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from edgellm.config import EngineConfig
from edgellm.distill.kd import KDOptions, held_out_kl, prepare_student, train, train_forward
from edgellm.distill.pipeline import DistillOptions, distill, split_windows, stored_dtypes
from edgellm.distill.prune import PruneOptions, prune
from edgellm.errors import InvalidParameterError, OutputExistsError
from edgellm.loaders.model import load_model
from edgellm.quantize.build import build_model
from edgellm.quantize.linear import QuantLinear
from tests.conftest import bpe_tokenizer
from tests.test_prune import CALIB, calibration_text, teacher_dir  # noqa: F401

CFG = EngineConfig(kv_cache_mb=1.0, block_size=4)


def sharpened_teacher(tmp_path, model_type="qwen2"):
    """A random model's distributions are nearly flat: a sharper head gives KD something to
    learn (and the INT4 student something to lose)."""
    src = teacher_dir(tmp_path, model_type)
    f = src / "model.safetensors"
    tensors = load_file(str(f))
    key = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    tensors[key] = tensors[key] * 8
    from safetensors.torch import save_file

    save_file(tensors, str(f), metadata={"format": "pt"})
    return src


def int_options(**over) -> DistillOptions:
    base = dict(
        bits=4, group_size=32, init="rtn", steps=12, batch=2, seq_len=32, lr=1e-2, warmup=2,
        calib=CALIB["calib"], held_out=4, evals=2,
    )  # fmt: skip
    return DistillOptions(**{**base, **over})


def test_train_forward_matches_the_paged_model(tmp_path):
    from edgellm.backends.torch import TorchBackend
    from edgellm.engine.engine import Engine

    model = build_model(load_model(str(teacher_dir(tmp_path))))
    ids = list(range(40, 80))
    want = Engine(TorchBackend(model, CFG), bpe_tokenizer(), CFG).score(ids)
    logits = train_forward(model, torch.tensor([ids]))[0]
    got = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_distillation_lowers_held_out_kl_of_a_pruned_student(tmp_path):
    src = sharpened_teacher(tmp_path)
    out, _, _ = prune(str(src), tmp_path / "small", PruneOptions(drop_layers=1, mlp_width=64, **CALIB))
    teacher = build_model(load_model(str(src)))
    loaded = load_model(str(out))
    student = prepare_student(build_model(loaded), stored_dtypes(loaded))
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 264, (24, 32), generator=g).tolist()
    train_w, held = windows[:16], windows[16:]
    before = held_out_kl(student.model, teacher, held)
    state = train(student, teacher, train_w, KDOptions(steps=40, batch=4, lr=1e-3, warmup=4))
    after = held_out_kl(student.model, teacher, held)
    assert after < 0.7 * before, (before, after)
    assert state.losses[-1] < state.losses[0] and state.step == 40
    # frozen embeddings: the tensors a tied head shares are the teacher's
    assert "model.embed_tokens.weight" not in student.params
    exported = student.export()
    assert exported["model.layers.0.mlp.up_proj.weight"].shape == (64, 96)


@pytest.fixture(scope="module")
def int4_run(tmp_path_factory, calibration_text):  # noqa: F811
    root = tmp_path_factory.mktemp("int4")
    src = sharpened_teacher(root, "llama")
    opts = int_options(symmetric=False)
    report = distill(str(src), root / "out", opts, progress=False)
    return src, root, opts, report


def test_int4_distillation_lowers_kl_and_keeps_the_exact_layout(int4_run, monkeypatch):
    from edgellm.quantize.pipeline import QuantizeOptions, quantize

    src, root, opts, report = int4_run
    assert report.kl_after < 0.9 * report.kl_before, (report.kl_before, report.kl_after)
    assert [e["step"] for e in report.evals] == [0, 6, 12]
    assert not (root / "out.distill-work").exists()
    # the same init made directly: same tensor names, shapes, dtypes; codes identical
    q = QuantizeOptions("rtn", 4, 32, False, CALIB["calib"], seed=0)
    quantize(str(src), str(root / "rtn"), q, progress=False)
    ours, init = load_file(str(root / "out/model.safetensors")), load_file(str(root / "rtn/model.safetensors"))
    assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {
        n: (t.shape, t.dtype) for n, t in init.items()
    }
    changed = {n for n in ours if not torch.equal(ours[n], init[n])}
    assert all(not n.endswith("weight_packed") for n in changed)  # codes never change
    assert any(n.endswith("weight_scale") for n in changed)
    assert any(n.endswith("layernorm.weight") for n in changed)
    assert "model.embed_tokens.weight" not in changed
    # the checkpoint as written computes what was trained: its held-out KL is the report's
    monkeypatch.setattr(QuantLinear, "use_fast", False)  # the exact reference path
    teacher = build_model(load_model(str(src)))
    loaded = load_model(str(root / "out"))
    assert loaded.config["quantization_config"]["edgellm"]["distillation"]["tokens"] == 12 * 2 * 32
    from edgellm.distill.pipeline import split_windows as split
    from edgellm.quantize.calibration import token_stream

    _, held = split(token_stream(loaded.tokenizer, opts.calib), 32, opts.held_out, opts.seed)
    kl = held_out_kl(build_model(loaded), teacher, held)
    assert math.isclose(kl, report.kl_after, rel_tol=1e-4), (kl, report.kl_after)


def test_distilled_int4_exports_exactly_and_llamacpp_agrees(int4_run):
    pytest.importorskip("llama_cpp")
    from gguf import GGMLQuantizationType as Q

    from edgellm.backends.llamacpp import LlamaCppBackend
    from edgellm.backends.torch import TorchBackend
    from edgellm.engine.engine import Engine
    from edgellm.quantize.export_gguf import export_gguf

    _, root, _, _ = int4_run
    gguf = export_gguf(str(root / "out"), root / "out.gguf")
    back = load_model(str(gguf))
    types = {t.name: t.tensor_type for t in back.weights.reader.tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q4_1  # asymmetric groups of 32: exactly Q4_1
    model = build_model(load_model(str(root / "out")))
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            got, want = back.weights.get(f"{name}.weight"), module.dequantize()
            tol = 2e-2 * module.weight_scale.float().abs().max()  # Q4_1's fp16 min
            assert (got - want).abs().max() <= tol, name
    ids = list(range(30, 130))
    loaded = load_model(str(root / "out"))
    ours = Engine(TorchBackend(model, CFG), bpe_tokenizer(), CFG).score(ids)
    cfg = CFG.replace(threads=2)
    theirs = Engine(LlamaCppBackend(gguf, loaded.args, cfg), bpe_tokenizer(), cfg).score(ids)
    ppl_ours, ppl_theirs = math.exp(-ours.mean()), math.exp(-theirs.mean())
    assert abs(ppl_theirs / ppl_ours - 1) < 0.01, (ppl_ours, ppl_theirs)


def test_interrupt_and_resume_equals_one_run(tmp_path):
    src = sharpened_teacher(tmp_path)
    opts = int_options(steps=6, evals=3)
    distill(str(src), tmp_path / "once", opts, progress=False)
    with pytest.raises(KeyboardInterrupt):
        distill(str(src), tmp_path / "twice", opts, progress=False, stop_after=2)
    assert (tmp_path / "twice.distill-work" / "state.pt").exists()
    assert not (tmp_path / "twice").exists()
    with pytest.raises(InvalidParameterError, match="interrupted run"):
        distill(str(src), tmp_path / "twice", opts, progress=False)  # neither --resume nor --force
    with pytest.raises(InvalidParameterError, match="other options.*steps"):
        distill(str(src), tmp_path / "twice", int_options(steps=7), progress=False, resume=True)
    report = distill(str(src), tmp_path / "twice", opts, progress=False, resume=True)
    assert report.resumed_from == 2 and len(report.losses) == 6
    a, b = load_file(str(tmp_path / "once/model.safetensors")), load_file(str(tmp_path / "twice/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert not (tmp_path / "twice.distill-work").exists()


def test_pruning_then_distillation_from_the_api(tmp_path):
    src = sharpened_teacher(tmp_path)
    opts = DistillOptions(
        drop_layers=1, mlp_width=64, steps=10, batch=2, seq_len=32, lr=1e-3, warmup=2,
        calib=CALIB["calib"], held_out=4, evals=1, dtype="float32",
    )  # fmt: skip
    report = distill(str(src), tmp_path / "small", opts, progress=False)
    assert report.kl_after < report.kl_before
    a = load_model(str(tmp_path / "small")).args
    assert (a.num_hidden_layers, a.intermediate_size) == (3, 64)
    assert (tmp_path / "small" / "distillation.json").exists()
    assert (tmp_path / "small" / "pruning.json").exists()


def test_bad_options_are_one_clear_error_and_write_nothing(tmp_path):
    src = teacher_dir(tmp_path)
    before = sorted(p.name for p in src.iterdir())
    out = tmp_path / "bad"
    for opts, match in [
        (DistillOptions(), "nothing to distil"),
        (DistillOptions(bits=4, drop_layers=1), "one student per run"),
        (DistillOptions(bits=16), "bits"),
        (DistillOptions(bits=4, group_size=24), "group size 24 does not divide"),
        (DistillOptions(drop_layers=4), "has 4 layers"),
        (DistillOptions(mlp_width=50), "multiple of 32"),
        (DistillOptions(bits=4, init="hqq"), "awq"),
        (DistillOptions(bits=4, loss="mse"), "kl"),
        (DistillOptions(bits=4, steps=0), "steps"),
        (DistillOptions(student=str(src), bits=4), "--student"),
    ]:
        with pytest.raises(InvalidParameterError, match=match):
            distill(str(src), out, opts, progress=False)
        assert not out.exists() and not (tmp_path / "bad.distill-work").exists()
    with pytest.raises(InvalidParameterError, match="is the training text"):
        distill(str(src), out, int_options(calib="shakespeare"), eval_text="shakespeare-calib")
    with pytest.raises(InvalidParameterError, match="no saved state"):
        distill(str(src), out, int_options(), progress=False, resume=True)
    (tmp_path / "exists").mkdir()
    with pytest.raises(OutputExistsError):
        distill(str(src), tmp_path / "exists", int_options(), progress=False)
    assert sorted(p.name for p in src.iterdir()) == before


def test_training_windows_never_overlap_held_out_or_evaluation_text():
    from edgellm.loaders.texts import text_documents
    from edgellm.quantize.calibration import calibration_documents

    stream = list(range(1000))  # distinct tokens: overlap would show as a shared value
    train_w, held = split_windows(stream, 64, 3, seed=1)
    assert len(train_w) == 1000 // 64 - 3 and len(held) == 3
    seen = train_w.flatten().tolist()
    assert len(seen) == len(set(seen)) and not set(seen) & set(held.flatten().tolist())
    # built-in sotu: the training split (before 2000) shares no address with the evaluation one
    calib, evaluation = calibration_documents("sotu"), text_documents("sotu")
    assert calib and evaluation and not set(calib) & set(evaluation)
    with pytest.raises(InvalidParameterError, match="fewer than"):
        split_windows(list(range(100)), 64, 1, seed=0)


def test_cli_distill(tmp_path, capsys, monkeypatch):
    from tests.test_cli import run_cli

    src = sharpened_teacher(tmp_path)
    args = ["distill", str(src), "-o", str(tmp_path / "cli"), "--bits", "4", "--group-size", "32"]
    args += ["--init", "rtn", "--steps", "2", "--batch", "1", "--seq-len", "32"]
    args += ["--calib", CALIB["calib"], "--eval-text", "sotu"]
    code, stdout, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert "held-out KL" in stdout and "peak memory" in stdout and "perplexity sotu" in stdout
    code, _, err = run_cli(["distill", str(src), "-o", str(tmp_path / "x")], capsys, monkeypatch)
    assert code != 0 and "nothing to distil" in err
