"""Model files that lie give one clear ModelFormatError naming the lie, never a traceback,
a hang, a crash or unbounded memory (issue 14). One test per lie found against main, for
GGUF files and Hugging Face directories, and the real CLI under a memory cap."""

from __future__ import annotations

import json
import math
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from edgellm.errors import ModelFormatError, TokenizerError
from edgellm.loaders import weights
from edgellm.loaders.model import load_model
from edgellm.models import llama
from edgellm.models.llama import ModelArgs, weight_shapes
from edgellm.quantize.export_gguf import export_gguf
from tests.conftest import bpe_tokenizer

V = gguf.GGUFValueType
TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=264,  # bpe_tokenizer's
    max_position_embeddings=512,
)
ROOT = Path(__file__).resolve().parent.parent
EDGELLM = ROOT / ".venv" / "bin" / "edgellm"


# ---- building and corrupting tiny model files -----------------------------------------------


def write_hf_dir(path: Path, seed: int = 0, **over) -> Path:
    """A tiny random float model as an HF directory (config.json, safetensors, tokenizer)."""
    args = ModelArgs(**{**TINY, **over})
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: (1 + 0.1 * torch.randn(shape, generator=gen))
        if name.endswith("norm.weight")
        else 0.1 * torch.randn(shape, generator=gen)
        for name, shape in weight_shapes(args).items()
    }
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(args.to_hf_config()))
    bpe_tokenizer(eos_id=0).save_pretrained(path)
    return path


def write_gguf(path: Path, hf_dir: Path) -> Path:
    return export_gguf(hf_dir, path, "f16")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_hf_dir(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture(scope="module")
def gguf_file(hf_dir, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_dir)


def rewrite_gguf(src: Path, dst: Path, kv: dict | None = None, tensors=None) -> Path:
    """A copy of `src` through gguf-py's writer: `kv` sets keys (key -> (value, type[, sub
    type]) or None to drop), `tensors(name, array)` replaces a tensor's data (None drops it)."""
    kv = kv or {}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and name not in kv:
            sub = f.types[-1] if f.types[0] == V.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for name, spec in kv.items():
        if spec is not None:
            w.add_key_value(name, *spec)
    for t in r.tensors:
        data = np.array(t.data)
        data = tensors(t.name, data) if tensors else data
        if data is not None:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def patched(src: Path, dst: Path, at: int, raw: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[at : at + len(raw)] = raw
    dst.write_bytes(bytes(data))
    return dst


def value_at(src: Path, key: str) -> int:
    """File offset of a metadata value (for arrays: its element type)."""
    f = gguf.GGUFReader(src).fields[key]
    return f.offset + 8 + len(key.encode()) + 4


def tensor_field(src: Path, name: str, part: str) -> int:
    """File offset of one part of a tensor's header entry: n_dims, dims, type or offset."""
    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == name)
    n_dims_at = t.field.offset + 8 + len(name.encode())
    n_dims = len(t.shape)
    return {
        "n_dims": n_dims_at,
        "dims": n_dims_at + 4,
        "type": n_dims_at + 4 + 8 * n_dims,
        "offset": n_dims_at + 8 + 8 * n_dims,
    }[part]


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def assert_refused(path: Path, *needles: str, error=ModelFormatError) -> str:
    with pytest.raises(error) as exc:
        load_model(path)
    message = str(exc.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


# ---- the valid files load --------------------------------------------------------------


def test_tiny_files_load(hf_dir, gguf_file):
    for path in (hf_dir, gguf_file):
        loaded = load_model(path)
        assert loaded.args.num_hidden_layers == 2 and loaded.args.head_dim == 16
        assert loaded.weights.get("model.layers.1.mlp.up_proj.weight").shape == (128, 64)


def test_a_loaded_gguf_keeps_its_tokenizer_arrays_compactly(gguf_file):
    """gguf-py holds two numpy views per vocabulary string for the reader's life (~370 MB at
    Qwen's 151k tokens); a loaded model keeps the same values as Python lists instead."""
    raw = gguf.GGUFReader(gguf_file).fields
    kept = load_model(gguf_file).weights.reader.fields
    big = [k for k, f in raw.items() if f.types[0] == gguf.GGUFValueType.ARRAY]
    assert "tokenizer.ggml.tokens" in big and "tokenizer.ggml.merges" in big
    for key in raw:
        assert kept[key].types == list(raw[key].types), key
        assert kept[key].contents() == raw[key].contents(), key
        assert len(kept[key].data) == len(raw[key].data), key
        if key in big:
            assert not hasattr(kept[key], "parts"), key
    assert kept["tokenizer.ggml.tokens"].contents(5) == raw["tokenizer.ggml.tokens"].contents(5)


def test_rows_decode_alone_as_the_whole_tensor_would(hf_dir, gguf_file, monkeypatch):
    """`gather_rows` (the calibration lookup) and `rows_as` (the 16-bit table a checkpoint
    stores) read a few rows at a time, and give exactly the rows of `get` on every source,
    q/k rows that GGUF permutes included."""
    monkeypatch.setattr(weights, "ROW_CHUNK", 7)  # many chunks, a ragged last one
    for path in (hf_dir, gguf_file):
        source = load_model(path).weights
        for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"):
            full = source.get(name)
            ids = torch.tensor([0, 9, full.shape[0] - 1, 3, 9, 8])
            assert torch.equal(weights.gather_rows(source, name, ids), full[ids].float())
            assert torch.equal(weights.rows_as(source, name, torch.float16), full.half())
        norm = source.get("model.norm.weight")
        assert torch.equal(weights.rows_as(source, "model.norm.weight", torch.bfloat16), norm.bfloat16())
    table = torch.randn(20, 4)
    src = weights.DictSource({"e": table})
    assert torch.equal(weights.gather_rows(src, "e", torch.tensor([19, 0])), table[[19, 0]])
    assert weights.gather_rows(src, "e", torch.tensor([], dtype=torch.long)).shape == (0, 4)


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True), ("mistral", False)])
def test_weight_shapes_match_the_built_model(model_type, tie):
    """The loader's table of shapes is the model's own state dict (its slow twin)."""
    over = {"qkv_bias": model_type == "qwen2", "head_dim": 32 if model_type == "mistral" else 0}
    args = ModelArgs(**{**TINY, "model_type": model_type, "tie_word_embeddings": tie, **over})
    with torch.device("meta"):
        model = llama.Model(args)
    assert weight_shapes(args) == {n: tuple(t.shape) for n, t in model.state_dict().items()}


# ---- GGUF metadata that lies -------------------------------------------------------------

GGUF_LIES = {
    "block_count 0": ({"llama.block_count": (0, V.UINT32)}, "llama.block_count is 0"),
    "block_count 1000": ({"llama.block_count": (1000, V.UINT32)}, "llama.block_count is 1000"),
    "block_count one short": (
        {"llama.block_count": (1, V.UINT32)},
        "llama.block_count is 1, expected more: tensor blk.1.",
    ),
    "head_count 0": (
        {"llama.attention.head_count": (0, V.UINT32)},
        "llama.attention.head_count is 0",
    ),
    "head_count_kv 0": (
        {"llama.attention.head_count_kv": (0, V.UINT32)},
        "llama.attention.head_count_kv is 0",
    ),
    "head_count_kv not a divisor": (
        {"llama.attention.head_count_kv": (3, V.UINT32)},
        "llama.attention.head_count_kv is 3, expected a divisor of llama.attention.head_count 4",
    ),
    "head_count vs tensors": (
        {"llama.attention.head_count": (8, V.UINT32)},
        "llama.attention.head_count is 8, expected 4",
    ),
    "head_count_kv as an array": (
        {"llama.attention.head_count_kv": ([2, 2], V.ARRAY, V.UINT32)},
        "llama.attention.head_count_kv is [2, 2]",
    ),
    "embedding_length": (
        {"llama.embedding_length": (32, V.UINT32)},
        "llama.embedding_length is 32, expected 64",
    ),
    "embedding_length a string": (
        {"llama.embedding_length": ("sixty-four", V.STRING)},
        "llama.embedding_length is 'sixty-four', expected an integer",
    ),
    "feed_forward_length": (
        {"llama.feed_forward_length": (100, V.UINT32)},
        "llama.feed_forward_length is 100, expected 128",
    ),
    "vocab_size": ({"llama.vocab_size": (300, V.UINT32)}, "llama.vocab_size is 300, expected 264"),
    "key_length odd": (
        {"llama.attention.key_length": (15, V.UINT32)},
        "llama.attention.key_length is 15, expected an even number",
    ),
    "rope.dimension_count": (
        {"llama.rope.dimension_count": (8, V.UINT32)},
        "llama.rope.dimension_count is 8, expected 16",
    ),
    "eps NaN": (
        {"llama.attention.layer_norm_rms_epsilon": (math.nan, V.FLOAT32)},
        "llama.attention.layer_norm_rms_epsilon is nan, expected a finite number",
    ),
    "eps negative": (
        {"llama.attention.layer_norm_rms_epsilon": (-1e-5, V.FLOAT32)},
        "llama.attention.layer_norm_rms_epsilon is",
    ),
    "freq_base 0": ({"llama.rope.freq_base": (0.0, V.FLOAT32)}, "llama.rope.freq_base is 0.0"),
    "freq_base inf": ({"llama.rope.freq_base": (math.inf, V.FLOAT32)}, "llama.rope.freq_base"),
    "context_length 0": ({"llama.context_length": (0, V.UINT32)}, "llama.context_length is 0"),
    "context_length 2^40": (
        {"llama.context_length": (2**40, V.UINT64)},
        "llama.context_length is 1099511627776",
    ),
    "no embedding_length": ({"llama.embedding_length": None}, "llama.embedding_length is missing"),
}


@pytest.mark.parametrize("case", list(GGUF_LIES))
def test_lying_gguf_metadata(case, gguf_file, tmp_path):
    kv, needle = GGUF_LIES[case]
    assert_refused(rewrite_gguf(gguf_file, tmp_path / "lie.gguf", kv), needle)


def _nan_first(name: str, data: np.ndarray) -> np.ndarray:
    if name == "blk.0.attn_norm.weight":
        data[0] = np.nan
    return data


GGUF_TENSOR_LIES = {
    "NaN in a norm weight": (_nan_first, "blk.0.attn_norm.weight holds NaN or infinite values"),
    "a layer tensor missing": (
        lambda n, d: None if n == "blk.1.ffn_up.weight" else d,
        "tensor blk.1.ffn_up.weight is missing",
    ),
    "a layer tensor of the wrong shape": (
        lambda n, d: d[:, :100] if n == "blk.1.ffn_down.weight" else d,
        "tensor blk.1.ffn_down.weight has shape [64, 100], expected [64, 128]",
    ),
}


@pytest.mark.parametrize("case", list(GGUF_TENSOR_LIES))
def test_lying_gguf_tensors(case, gguf_file, tmp_path):
    edit, needle = GGUF_TENSOR_LIES[case]
    assert_refused(rewrite_gguf(gguf_file, tmp_path / "lie.gguf", tensors=edit), needle)


def test_unexpected_gguf_tensor(gguf_file, tmp_path):
    src = gguf.GGUFReader(gguf_file)
    w = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    for name, f in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = f.types[-1] if f.types[0] == V.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, np.float32))  # a Qwen3 feature
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_refused(tmp_path / "extra.gguf", "unexpected tensor blk.0.attn_q_norm.weight")


# ---- GGUF headers that lie (byte patches: gguf-py's writer would not write them) --------


def test_architecture_not_utf8(gguf_file, tmp_path):
    at = value_at(gguf_file, "general.architecture") + 8  # past the string length
    bad = patched(gguf_file, tmp_path / "arch.gguf", at, b"\xff\xfe")
    assert_refused(bad, "general.architecture is not UTF-8")


def test_huge_array_count(gguf_file, tmp_path):
    at = value_at(gguf_file, "tokenizer.ggml.token_type") + 4  # past the element type
    bad = patched(gguf_file, tmp_path / "count.gguf", at, u64(2**40))
    assert_refused(bad, "tokenizer.ggml.token_type has 1099511627776 elements")
    # below the cap but past the end of the file
    bad = patched(gguf_file, tmp_path / "count2.gguf", at, u64(2**21))
    assert_refused(bad, "tokenizer.ggml.token_type", "needs 8388608 bytes")


def test_huge_string_lengths(gguf_file, tmp_path):
    at = value_at(gguf_file, "tokenizer.ggml.tokens") + 4 + 8  # the first token's length
    bad = patched(gguf_file, tmp_path / "str.gguf", at, u64(2**62))
    assert_refused(bad, "tokenizer.ggml.tokens[0] needs 4611686018427387904 bytes")
    bad = patched(gguf_file, tmp_path / "strs.gguf", at - 8, u64(2**40))  # the token count
    assert_refused(bad, "tokenizer.ggml.tokens has 1099511627776 elements")
    bad = patched(gguf_file, tmp_path / "kvs.gguf", 16, u64(2**60))  # the metadata count
    assert_refused(bad, "the metadata count 1152921504606846976 cannot fit")
    bad = patched(gguf_file, tmp_path / "ts.gguf", 8, u64(2**33))  # the tensor count
    assert_refused(bad, "the tensor count 8589934592 cannot fit")


def test_unknown_value_type(gguf_file, tmp_path):
    bad = patched(
        gguf_file, tmp_path / "t.gguf", value_at(gguf_file, "llama.block_count") - 4, u32(99)
    )
    assert_refused(bad, "llama.block_count has unknown value type 99")


TENSOR_HEADER_LIES = {
    "a zero dim": ("blk.0.ffn_up.weight", "dims", u64(0), "every dim must be at least 1"),
    "5 dims": ("blk.0.ffn_up.weight", "n_dims", u32(5), "has 5 dims, expected 1..4"),
    "unknown type": ("blk.0.ffn_up.weight", "type", u32(99), "has unknown type 99"),
    "an integer type": ("blk.0.attn_norm.weight", "type", u32(26), "has type I32"),  # same size
    "shifted offset": ("blk.0.ffn_up.weight", "offset", None, "has offset"),
    "wrapped offset": ("blk.0.ffn_up.weight", "offset", u64(-32), "has offset 1844674407370955"),
}


@pytest.mark.parametrize("case", list(TENSOR_HEADER_LIES))
def test_lying_tensor_header(case, gguf_file, tmp_path):
    name, part, raw, needle = TENSOR_HEADER_LIES[case]
    at = tensor_field(gguf_file, name, part)
    if raw is None:  # move the tensor 32 bytes on: aligned, overlapping its neighbour
        raw = u64(struct.unpack_from("<Q", gguf_file.read_bytes(), at)[0] + 32)
    message = assert_refused(patched(gguf_file, tmp_path / "t.gguf", at, raw), needle)
    assert name in message


def test_truncated_gguf(gguf_file, tmp_path):
    data = gguf_file.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 3000, 40, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        assert_refused(tmp_path / "cut.gguf", "truncated")


def test_big_endian_and_bad_versions(gguf_file, tmp_path):
    assert_refused(patched(gguf_file, tmp_path / "be.gguf", 4, struct.pack(">I", 3)), "big-endian")
    assert_refused(patched(gguf_file, tmp_path / "v9.gguf", 4, u32(9)), "version 9")


# ---- Hugging Face directories that lie -------------------------------------------------------


def lying_hf_dir(src: Path, dst: Path, **config) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


HF_LIES = {
    "hidden_size": ({"hidden_size": 32}, "hidden_size is 32, expected 64"),
    "hidden_size a string": ({"hidden_size": "64"}, "hidden_size is '64', expected an integer"),
    "intermediate_size": ({"intermediate_size": 100}, "intermediate_size is 100, expected 128"),
    "num_hidden_layers": ({"num_hidden_layers": 3}, "num_hidden_layers is 3, expected 2"),
    "num_attention_heads 0": ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    "num_attention_heads": ({"num_attention_heads": 8}, "num_attention_heads is 8, expected 4"),
    "num_key_value_heads": (
        {"num_key_value_heads": 3},
        "num_key_value_heads is 3, expected a divisor of num_attention_heads 4",
    ),
    "num_key_value_heads a list": ({"num_key_value_heads": [2]}, "num_key_value_heads is [2]"),
    "head_dim": ({"head_dim": 8}, "num_attention_heads is 4, expected 8"),
    "vocab_size": ({"vocab_size": 300}, "vocab_size is 300, expected 264"),
    "rms_norm_eps NaN": ({"rms_norm_eps": math.nan}, "rms_norm_eps is nan"),
    "rope_theta 0": ({"rope_theta": 0}, "rope_theta is 0"),
    "rope_scaling a string": ({"rope_scaling": "yes"}, "rope_scaling is 'yes'"),
    "rope_scaling without factor": (
        {"rope_scaling": {"rope_type": "linear"}},
        "rope_scaling.factor is None",
    ),
    "max_position_embeddings": (
        {"max_position_embeddings": -1},
        "max_position_embeddings is -1",
    ),
    "tie_word_embeddings a string": ({"tie_word_embeddings": "no"}, "tie_word_embeddings is 'no'"),
    "eos_token_id a string": ({"eos_token_id": "</s>"}, "eos_token_id is '</s>'"),
}


@pytest.mark.parametrize("case", list(HF_LIES))
def test_lying_config_json(case, hf_dir, tmp_path):
    config, needle = HF_LIES[case]
    message = assert_refused(lying_hf_dir(hf_dir, tmp_path / "lie", **config), needle)
    assert "config.json" in message


def test_config_json_not_an_object(hf_dir, tmp_path):
    bad = lying_hf_dir(hf_dir, tmp_path / "list")
    (bad / "config.json").write_text("[1, 2, 3]")
    assert_refused(bad, "config.json holds a list, expected an object")
    (bad / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    assert_refused(bad, "config.json is not valid JSON")
    (bad / "config.json").write_text("[" * 100_000)
    assert_refused(bad, "config.json is not valid JSON")


def test_broken_safetensors_index(hf_dir, tmp_path):
    bad = lying_hf_dir(hf_dir, tmp_path / "index")
    index = bad / "model.safetensors.index.json"
    for text, needle in (
        ("{not json", "is not valid JSON"),
        ("[]", "has no weight_map object"),
        ('{"weight_map": ["model.safetensors"]}', "has no weight_map object"),
        ('{"weight_map": {"a": 7}}', "maps a tensor to 7"),
        ('{"weight_map": {"a": "../tiny/model.safetensors"}}', "maps a tensor to '../tiny"),
        ('{"weight_map": {"a": "/etc/passwd"}}', "maps a tensor to '/etc/passwd'"),
        ('{"weight_map": {"a": "other.safetensors"}}', "missing shards: other.safetensors"),
    ):
        index.write_text(text)
        assert_refused(bad, needle)


def test_bad_safetensors_header(hf_dir, tmp_path):
    bad = lying_hf_dir(hf_dir, tmp_path / "st")
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(u64(2**40) + data[8:])  # a header length past the end of the file
    assert_refused(bad, "corrupt or truncated safetensors")
    weights.write_bytes(data[:8] + b"\xff" * 16 + data[24:])  # a header that is not JSON
    assert_refused(bad, "corrupt or truncated safetensors")
    weights.write_bytes(data[: len(data) // 2])
    assert_refused(bad, "corrupt or truncated safetensors")


def test_hf_tensor_lies(hf_dir, tmp_path):
    from safetensors.torch import load_file

    bad = lying_hf_dir(hf_dir, tmp_path / "nan")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.norm.weight"][3] = math.inf
    save_file(tensors, str(bad / "model.safetensors"))
    assert_refused(bad, "tensor model.norm.weight holds NaN or infinite values")
    tensors["model.norm.weight"][3] = 1.0
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, str(bad / "model.safetensors"))
    assert_refused(bad, "num_hidden_layers is 2, expected more: tensor model.layers.2.")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    tensors["model.embed_tokens.weight"] = torch.zeros(264, 64, dtype=torch.int32)
    save_file(tensors, str(bad / "model.safetensors"))
    assert_refused(bad, "tensor model.embed_tokens.weight has dtype I32, expected a float type")


def test_tokenizer_larger_than_the_vocabulary(tmp_path):
    path = write_hf_dir(tmp_path / "small", vocab_size=256)  # bpe_tokenizer has 264 tokens
    assert_refused(path, "the tokenizer has 264 tokens", "is 256")


def test_tokenizer_library_errors_become_tokenizer_errors(hf_dir, tmp_path):
    bad = lying_hf_dir(hf_dir, tmp_path / "gen")
    (bad / "generation_config.json").write_text("[1, 2]")  # tokenizer.py reads it as a dict
    assert_refused(bad, "cannot build the tokenizer", error=TokenizerError)


# ---- the real CLI, in a subprocess under a memory cap ------------------------------------------

MEMORY_CAP = 4 << 30


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_capped(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [str(EDGELLM), *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_cap_memory,
        env=env,
    )


def assert_one_line(proc: subprocess.CompletedProcess, needle: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def cli_files(gguf_file, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    at = value_at(gguf_file, "tokenizer.ggml.token_type") + 4
    return {
        "huge array": patched(gguf_file, root / "array.gguf", at, u64(2**40)),
        "head_count 0": rewrite_gguf(
            gguf_file, root / "heads.gguf", {"llama.attention.head_count": (0, V.UINT32)}
        ),
        "block_count 1000": rewrite_gguf(
            gguf_file, root / "blocks.gguf", {"llama.block_count": (1000, V.UINT32)}
        ),
        "eps NaN": rewrite_gguf(
            gguf_file,
            root / "eps.gguf",
            {"llama.attention.layer_norm_rms_epsilon": (math.nan, V.FLOAT32)},
        ),
    }


CLI_CASES = [
    ("huge array", ["info"], "tokenizer.ggml.token_type has 1099511627776 elements"),
    ("head_count 0", ["generate", "hi", "-n", "2", "-b", "torch", "-m"], "head_count is 0"),
    ("block_count 1000", ["generate", "hi", "-n", "2", "-b", "llamacpp", "-m"], "block_count"),
    ("eps NaN", ["generate", "hi", "-n", "2", "-b", "llamacpp", "-m"], "epsilon is nan"),
]


@pytest.mark.parametrize("case,argv,needle", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_under_a_memory_cap(case, argv, needle, cli_files):
    if "llamacpp" in argv and sys.modules.get("llama_cpp") is None:
        pytest.importorskip("llama_cpp")
    assert_one_line(run_capped(*argv, str(cli_files[case])), needle)


def test_valid_file_runs_on_the_cli_under_the_cap(gguf_file):
    """The cap itself lets a real run through: a refusal above is the check, not the cap."""
    proc = run_capped("generate", "hi", "-n", "2", "-b", "torch", "-m", str(gguf_file))
    assert proc.returncode == 0, proc.stderr[-2000:]
