"""Which of vLLM's fast INT GPU kernels take a checkpoint, and the warning quantize gives."""

import json
import warnings

import pytest

from edgellm.models.llama import ModelArgs
from edgellm.quantize import QuantizeOptions, quantize
from edgellm.quantize.format import QuantConfig
from edgellm.quantize.vllm_kernels import (
    MACHETE,
    MARLIN,
    VllmKernelWarning,
    blockers,
    rank_linears,
    tensor_parallel_sizes,
    vllm_kernel_fit,
    vllm_warning,
)
from tests.conftest import byte_tokenizer, tiny_hf_model

# the real shapes (from the GGUF headers)
QWEN15 = ModelArgs("qwen2", 1536, 8960, 28, 12, 2, 151936, qkv_bias=True)
SMOLLM2 = ModelArgs("llama", 576, 1536, 30, 9, 3, 49152)


def fits(args, qc):
    return {f.kernel.name: f.tp_sizes for f in vllm_kernel_fit(args, qc)}


def test_qwen_15b_takes_both_kernels_at_group_128():
    assert rank_linears(QWEN15) == [
        ("qkv_proj", 1536, 1536, 2048), ("o_proj", 1536, 1536, 1536),
        ("gate_up_proj", 1536, 1536, 17920), ("down_proj", 8960, 8960, 1536),
    ]  # fmt: skip
    assert tensor_parallel_sizes(QWEN15) == [1, 2, 4]  # 12 heads: not 8
    # TP 4: down_proj has 2240 inputs per rank: not a multiple of 128 (Marlin), nor of the
    # group (both); per channel, Machete (multiples of 64) takes it
    assert fits(QWEN15, QuantConfig(4, 128, True)) == {"Marlin": [1, 2], "Machete": [1, 2]}
    assert "down_proj: group size 128 does not divide its 2240 input features per rank" in (
        blockers(MACHETE, QWEN15, QuantConfig(4, 128), tp=4)
    )
    assert rank_linears(QWEN15, 4)[0] == ("qkv_proj", 1536, 1536, 384 + 2 * 128)  # KV replicated
    msg = vllm_warning(QWEN15, QuantConfig(4, 128, True))
    assert msg.startswith("vLLM's fast INT GPU kernels take this checkpoint on one GPU")
    assert "Marlin not at tensor-parallel size 4; Machete not at tensor-parallel size 4" in msg


def test_group_32_and_zero_points():
    # Machete takes group 128 or per channel only; Marlin takes 32
    assert fits(QWEN15, QuantConfig(4, 32, True)) == {"Marlin": [1, 2], "Machete": []}
    assert "group size 32 (takes -1, 128)" in " ".join(
        blockers(MACHETE, QWEN15, QuantConfig(4, 32))
    )
    assert fits(QWEN15, QuantConfig(4, -1, False)) == {"Marlin": [1, 2], "Machete": [1, 2, 4]}
    # Marlin has no 8-bit kernel with zero points, nor 3 bits at all
    assert blockers(MARLIN, QWEN15, QuantConfig(8, 128, False))[0].startswith("8-bit asymmetric")
    assert "3-bit symmetric" in blockers(MARLIN, QWEN15, QuantConfig(3, 128, True))[0]
    assert "Marlin" in vllm_warning(QWEN15, QuantConfig(3, 128, True))


def test_smollm2_576_wide_layers_take_neither_kernel():
    qc = QuantConfig(4, 128, True)
    marlin = blockers(MARLIN, SMOLLM2, qc)
    assert "qkv_proj: 576 input features, not a multiple of 128" in marlin
    # 576 is not a multiple of 128: the checkpoint stores group 64 there, Machete refuses it
    assert "qkv_proj: group size 64 (takes -1, 128)" in blockers(MACHETE, SMOLLM2, qc)
    assert fits(SMOLLM2, qc) == {"Marlin": [], "Machete": []}
    msg = vllm_warning(SMOLLM2, qc)
    assert msg.startswith("vLLM's fast INT GPU kernels will not take this checkpoint")
    assert "Marlin (Ampere or newer (sm80+))" in msg and "Machete (Hopper (sm90))" in msg


def _tiny(tmp_path, **over):
    d = tmp_path / "m"
    hf, _ = tiny_hf_model("llama", **over)
    hf.save_pretrained(d)
    byte_tokenizer(eos_id=0).save_pretrained(d)
    return d


def test_quantize_warns_and_records_the_kernels(tmp_path):
    """hidden 64: neither kernel; the warning comes before the work, the config records it."""
    src = _tiny(tmp_path)
    with pytest.warns(VllmKernelWarning, match="64 input features, not a multiple of 128"):
        quantize(str(src), str(tmp_path / "q"), QuantizeOptions(method="rtn", group_size=32),
                 progress=False)  # fmt: skip
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    rec = cfg["quantization_config"]["edgellm"]["vllm_gpu_kernels"]
    assert rec["marlin"]["tensor_parallel"] == [] and rec["marlin"]["blockers"]


def test_quantize_is_quiet_when_the_shapes_qualify(tmp_path):
    src = _tiny(tmp_path, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                num_key_value_heads=2, num_hidden_layers=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", VllmKernelWarning)
        quantize(str(src), str(tmp_path / "q"), QuantizeOptions(method="rtn", group_size=128),
                 progress=False)  # fmt: skip
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    rec = cfg["quantization_config"]["edgellm"]["vllm_gpu_kernels"]
    assert rec["marlin"]["tensor_parallel"] == [1, 2] and rec["machete"]["blockers"] == []


def test_cli_prints_the_warning_on_one_line(tmp_path, capsys, monkeypatch):
    from tests.test_cli import run_cli

    src = _tiny(tmp_path)
    code, _, err = run_cli(
        ["quantize", str(src), "-o", str(tmp_path / "q"), "--method", "rtn", "--group-size", "32"],
        capsys, monkeypatch,
    )  # fmt: skip
    assert code in (0, None)
    line = next(ln for ln in err.splitlines() if "vLLM" in ln)
    assert line.startswith("warning: vLLM's fast INT GPU kernels will not take this checkpoint")
