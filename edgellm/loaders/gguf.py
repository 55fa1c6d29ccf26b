"""GGUF files (llama.cpp) of the llama and qwen2 architectures.

Config comes from the GGUF metadata, tensors are renamed to Hugging Face names
and dequantized on access with gguf-py's codecs. llama.cpp's converter permutes
the rows of q/k for the llama architecture (interleaved RoPE); we undo that so
the model runs with HF's rotate-half RoPE and matches transformers.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from edgellm.errors import ModelFormatError, UnsupportedArchitectureError
from edgellm.loaders.weights import TensorInfo
from edgellm.models import get_model_module, gguf_architecture, model_type_of_gguf
from edgellm.models.llama import ModelArgs

GGUF_MAGIC = b"GGUF"

_BLK = re.compile(r"blk\.(\d+)\.(.+)")


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """HF name of a llama.cpp tensor, or None for tensors we do not load."""
    family = get_model_module(model_type)
    if gguf_name in family.GGUF_GLOBAL_NAMES:
        return family.GGUF_GLOBAL_NAMES[gguf_name]
    m = _BLK.fullmatch(gguf_name)
    if m and m.group(2) in family.GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{family.GGUF_LAYER_NAMES[m.group(2)]}"
    return None


def gguf_name(hf: str, model_type: str) -> str | None:
    """llama.cpp name of an HF tensor (inverse of `hf_name`), None when llama.cpp has none."""
    family = get_model_module(model_type)
    globals_ = {h: g for g, h in family.GGUF_GLOBAL_NAMES.items()}
    if hf in globals_:
        return globals_[hf]
    layer = {h: g for g, h in family.GGUF_LAYER_NAMES.items()}
    m = _HF_LAYER.fullmatch(hf)
    if m and m.group(2) in layer:
        return f"blk.{m.group(1)}.{layer[m.group(2)]}"
    return None


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path`, with clear errors for non-GGUF or truncated files."""

    path = Path(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors on corrupt headers
        raise ModelFormatError(f"{path} is a corrupt or truncated GGUF file ({e})") from e
    _check_complete(reader, path)
    return reader


def _check_complete(reader, path: Path) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelFormatError(
                f"{path} is truncated: tensor {t.name} ends past the end of the file"
            )


def field_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_args(reader) -> ModelArgs:
    """ModelArgs from GGUF metadata (`{arch}.*` keys)."""
    arch = field_value(reader, "general.architecture")
    model_type = model_type_of_gguf(arch)

    def get(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    n_vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}
    return ModelArgs(
        model_type=model_type,
        hidden_size=get("embedding_length"),
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        vocab_size=n_vocab,
        head_dim=get("attention.key_length") or get("rope.dimension_count") or 0,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, arch),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
    )


def _gguf_rope_scaling(reader, arch: str) -> dict | None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # llama3-style scaling, stored precomputed
            return {
                "rope_type": "freq_factors",
                "freq_factors": np.asarray(t.data, np.float32).tolist(),
            }
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": field_value(reader, f"{arch}.rope.scaling.factor")}
    raise UnsupportedArchitectureError(f"unsupported GGUF rope scaling {kind!r}")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k weights (interleaved -> rotate-half)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


class GGUFSource:
    """Tensors of a GGUF file by HF name, dequantized to float32 on access."""

    def __init__(self, reader, args: ModelArgs):
        self.reader = reader
        self.args = args
        self._permuted = gguf_architecture(args.model_type)[1]
        self._tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name, args.model_type)
            if name is not None:
                self._tensors[name] = t

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:

        t = self._tensors[name]
        block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        return TensorInfo(name, shape, t.tensor_type.name, 8 * nbytes / block)

    def get(self, name: str) -> torch.Tensor:

        t = self._tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(shape)
        if self._permuted and name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            heads = (
                self.args.num_attention_heads if "q_proj" in name else self.args.num_key_value_heads
            )
            w = unpermute_qk(w, heads)
        return w
