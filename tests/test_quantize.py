"""The quantize pipeline end to end on tiny models: every method, the CLI, failures."""

import json

import pytest
import torch

from edgellm import SamplingParams
from edgellm.errors import InvalidParameterError, OutputExistsError
from edgellm.quantize import QuantizeOptions, quantize
from edgellm.quantize.format import read_quant_config
from tests.conftest import byte_tokenizer, tiny_hf_model

FAST = dict(calib="shakespeare", n_samples=4, seq_len=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny llama as a Hugging Face directory on disk, with a real (byte-level) tokenizer."""
    d = tmp_path_factory.mktemp("tiny") / "model"
    hf, _ = tiny_hf_model(
        "llama", intermediate_size=96
    )  # 96-wide down_proj: group 64 falls back to 32
    hf.save_pretrained(d)
    byte_tokenizer(eos_id=0).save_pretrained(d)
    return d


def float_and_quant_logits(src, out, ids):
    from edgellm.entrypoints.llm import LLM

    ref, q = LLM(str(src), backend="torch"), LLM(str(out), backend="torch")
    return ref.score(ids), q.score(ids), q


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
@pytest.mark.parametrize("sym", [True, False])
def test_every_method_writes_a_loadable_checkpoint(tiny_dir, tmp_path, method, sym):
    out = tmp_path / "q"
    opts = QuantizeOptions(method=method, bits=4, group_size=64, symmetric=sym, **FAST)
    report = quantize(str(tiny_dir), str(out), opts, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["edgellm"]["method"] == method
    assert ("calibration" in qc["edgellm"]) == (method != "rtn")
    assert ("awq" in qc["edgellm"]) == (method == "awq")  # its search settings, duo scaling
    if method == "awq":
        assert qc["edgellm"]["awq"]["sequences"] == opts.awq_sequences == 8
    if method != "rtn":  # the forwards' product dtype, as this CPU resolved "auto"
        assert qc["edgellm"]["calibration"]["compute"] == str(opts.compute_dtype)[6:]
    assert (
        read_quant_config(cfg).bits == 4 and len(qc["config_groups"]) == 2
    )  # g64 and the g32 fallback
    ids = list(range(1, 60))
    ref, got, llm = float_and_quant_logits(tiny_dir, out, ids)
    assert ref.shape == got.shape and torch.isfinite(got).all()
    assert (got - ref).abs().mean() < 0.5  # 4-bit of a random model: close, not equal
    assert 4.0 < report.bits_per_weight < 5.0 and report.peak_rss_mb > 0
    assert len(report.layer_errors) == 2


def test_quantized_checkpoint_equals_its_dequantized_weights(tiny_dir, tmp_path):
    """The torch backend runs INT4 natively; its reference twin is dequantize-then-matmul."""
    from edgellm.entrypoints.llm import measure_ppl
    from edgellm.quantize.linear import QuantLinear

    out = tmp_path / "q"
    report = quantize(str(tiny_dir), str(out), QuantizeOptions(method="gptq", **FAST), progress=False,
                      eval_text="shakespeare", eval_tokens=600, measure_ppl=measure_ppl)  # fmt: skip
    prov = json.loads((out / "config.json").read_text())["quantization_config"]["edgellm"]
    assert prov["perplexity"]["before"] == report.ppl_before > 1
    assert prov["perplexity"]["after"] == report.ppl_after > 1
    from edgellm.entrypoints.llm import LLM

    llm = LLM(str(out), backend="torch")
    ids = list(range(3, 40))
    fast = llm.score(ids)
    QuantLinear.use_fast = False
    try:
        ref = llm.score(ids)
    finally:
        QuantLinear.use_fast = True
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)


def test_refuses_existing_output_and_bad_options(tiny_dir, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    with pytest.raises(OutputExistsError):
        quantize(str(tiny_dir), str(out), QuantizeOptions(method="rtn"), progress=False)
    with pytest.raises(InvalidParameterError, match="unknown method"):
        QuantizeOptions(method="squeeze")
    with pytest.raises(InvalidParameterError, match="bits"):
        QuantizeOptions(bits=1)
    with pytest.raises(InvalidParameterError, match="unknown compute dtype 'fp8'"):
        QuantizeOptions(compute="fp8")
    with pytest.raises(InvalidParameterError, match="awq_sequences"):
        QuantizeOptions(awq_sequences=-1)
    short = tmp_path / "short.txt"
    short.write_text("far too short")
    with pytest.raises(InvalidParameterError, match="fewer than one sample"):
        quantize(
            str(tiny_dir),
            str(tmp_path / "y"),
            QuantizeOptions(method="awq", calib=str(short)),
            progress=False,
        )
    assert not (tmp_path / "y").exists()


def test_auto_compute_is_bf16_only_where_the_cpu_multiplies_it(monkeypatch):
    """bf16 products where the CPU has them natively; elsewhere torch converts and runs them
    slower than float32, so "auto" stays float32. An explicit choice is taken as given."""
    from edgellm.kernels import cpu

    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(cpu, "native_bf16", lambda native=native: native)
        assert QuantizeOptions().compute_dtype == want
        assert QuantizeOptions(compute="float32").compute_dtype == torch.float32
        assert QuantizeOptions(compute="bfloat16").compute_dtype == torch.bfloat16


def test_interrupted_run_leaves_no_complete_looking_output(tiny_dir, tmp_path, monkeypatch):
    from edgellm.quantize import pipeline

    calls = []
    real = pipeline.quantize_layer

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the model
        return real(*a, **kw)

    monkeypatch.setattr(pipeline, "quantize_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        quantize(str(tiny_dir), str(tmp_path / "q"), QuantizeOptions(method="rtn"), progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary directory


def test_cli_quantize(tiny_dir, tmp_path, capsys, monkeypatch):
    from tests.test_cli import run_cli

    out = tmp_path / "cli"
    code, stdout, _ = run_cli(
        ["quantize", str(tiny_dir), "-o", str(out), "--method", "rtn", "--group-size", "32", "--asym"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert (
        code in (0, None) and "rtn W4 g32 asym" in stdout and (out / "model.safetensors").is_file()
    )
    code, _, err = run_cli(
        ["quantize", str(tiny_dir), "-o", str(out), "--method", "rtn"], capsys, monkeypatch
    )
    assert code == 1 and err.startswith("error:") and "exists" in err
    code, _, err = run_cli(
        ["quantize", str(tiny_dir), "-o", str(tmp_path / "c2"), "--compute", "fp8"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert code == 1 and "unknown compute dtype" in err and not (tmp_path / "c2").exists()


@pytest.mark.slow
def test_smollm2_checkpoint_loads_in_transformers_with_identical_logits(tmp_path, monkeypatch):
    """Real model, mixed group sizes (576-wide layers fall back to 64): transformers reads
    our checkpoint and computes the logits of our dequantized reference path."""
    from transformers import AutoModelForCausalLM

    from edgellm.entrypoints.llm import LLM
    from edgellm.quantize.linear import QuantLinear

    out = tmp_path / "smol-rtn"
    quantize(None, str(out), QuantizeOptions(method="rtn", group_size=128), progress=False)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {g["weights"]["group_size"] for g in cfg["config_groups"].values()} == {64, 128}
    llm = LLM(str(out), backend="torch", dtype="float32")
    ids = llm.tokenizer.encode(
        "The State of the Union is strong, and the economy", add_special_tokens=False
    )
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    expect = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    monkeypatch.setattr(QuantLinear, "use_fast", False)
    torch.testing.assert_close(llm.score(ids), expect, atol=1e-4, rtol=1e-4)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = llm.chat(question, SamplingParams(temperature=0, max_tokens=16))[0].text
    assert "Paris" in answer


@pytest.mark.slow
def test_awq_beats_rtn_on_the_real_smollm2(tmp_path):
    """End to end on the real model, with a small calibration: AWQ's checkpoint scores a
    lower held-out perplexity than RTN's on both texts at W4 g128. AWQ once fell below RTN
    here (the layer that makes the sinks left them out of its searches: 33.2 vs 31.5 on
    sotu at full calibration) while every test on random layers passed."""
    from edgellm.entrypoints.llm import measure_ppl

    opts = {"group_size": 128, "n_samples": 8, "seq_len": 256, "awq_tokens": 2048}
    ppl = {}
    for method in ("rtn", "awq"):
        out = tmp_path / method
        quantize(None, str(out), QuantizeOptions(method=method, **opts), progress=False)
        ppl[method] = {t: measure_ppl(str(out), t, 2048) for t in ("sotu", "shakespeare")}
    for text in ("sotu", "shakespeare"):
        assert ppl["awq"][text] < 0.95 * ppl["rtn"][text], ppl


def test_a_quantization_over_the_memory_budget_is_refused_before_work(tiny_dir, tmp_path):
    from edgellm.quantize.pipeline import MB, memory_estimate

    out = tmp_path / "q"
    opts = QuantizeOptions(method="gptq", **FAST)
    with pytest.raises(InvalidParameterError) as e:
        quantize(str(tiny_dir), str(out), opts, progress=False, memory_budget=300 * MB)
    msg = str(e.value)
    assert (
        "needs about" in msg and "over the memory budget of 300 MiB" in msg and "--samples" in msg
    )
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing started
    # the estimate grows with what the method keeps: GPTQ's Hessian of the widest input
    from edgellm.models.llama import ModelArgs

    qwen = ModelArgs("qwen2", 1536, 8960, 28, 12, 2, 151936, qkv_bias=True)
    rtn, gptq = (memory_estimate(qwen, QuantizeOptions(method=m)) for m in ("rtn", "gptq"))
    assert "method" not in rtn and gptq["method"] >= 2 * 8960 * 8960 * 4
    # untied: the 16-bit table, safetensors' copy of it and the head's table; never float32
    assert 6 * 151936 * 1536 <= rtn["embedding"] < 7 * 151936 * 1536

    def layers(est):  # the layer phase (the embedding phase is the same for every method)
        return sum(est.get(k, 0) for k in ("one layer", "activations", "method"))

    assert layers(gptq) > layers(rtn) and gptq["total"] >= rtn["total"]


def test_cli_memory_budget_refusal_is_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    from tests.test_cli import assert_one_line_error, run_cli

    code, _, err = run_cli(
        ["quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "--method", "awq",
         "--memory-budget", "200MB"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert_one_line_error(code, err, "over the memory budget of 200 MiB")


@pytest.mark.slow
def test_gguf_source_releases_the_pages_it_read(smollm2_path):
    """Layer-by-layer reading stays bounded: the file pages read so far leave this process's
    resident set when the quantizer releases them (they stay in the page cache)."""
    from edgellm.loaders.model import load_model

    def rss_file() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no RssFile")

    src = load_model(smollm2_path).weights
    before = rss_file()
    read = sum(src.get(n).numel() for n in src.names() if n.startswith("model.layers."))
    grown = rss_file() - before
    assert grown > 40 * 2**20, grown  # Q4_1 pages of every layer (~60 MiB) were mapped
    src.release()
    assert rss_file() - before < grown / 4
    assert read and torch.isfinite(src.get("model.layers.0.mlp.up_proj.weight")).all()
