"""GGUF files (llama.cpp) of the llama and qwen2 architectures.

Config comes from the GGUF metadata, tensors are renamed to Hugging Face names
and dequantized on access with gguf-py's codecs. llama.cpp's converter permutes
the rows of q/k for the llama architecture (interleaved RoPE); we undo that so
the model runs with HF's rotate-half RoPE and matches transformers.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from edgellm.errors import ModelFormatError, UnsupportedArchitectureError
from edgellm.loaders.weights import TensorInfo
from edgellm.models.llama import ModelArgs

GGUF_MAGIC = b"GGUF"

# general.architecture -> (HF model_type, q/k rows permuted by llama.cpp's converter)
GGUF_ARCHITECTURES = {
    "llama": ("llama", True),
    "qwen2": ("qwen2", False),
}

# llama.cpp tensor names -> HF names ({i} = layer index)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """HF name of a llama.cpp tensor, or None for tensors we do not load."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


_HF_LAYER_NAMES = {hf: g for g, hf in _LAYER_NAMES.items()}
_HF_GLOBAL_NAMES = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf: str) -> str | None:
    """llama.cpp name of an HF tensor (inverse of `hf_name`), None when llama.cpp has none."""
    if hf in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m and m.group(2) in _HF_LAYER_NAMES:
        return f"blk.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"
    return None


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path`, with clear errors for non-GGUF or truncated files."""
    import gguf

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
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    model_type, _ = GGUF_ARCHITECTURES[arch]

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
        self._permuted = GGUF_ARCHITECTURES[field_value(reader, "general.architecture")][1]
        self._tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        import gguf

        t = self._tensors[name]
        block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        return TensorInfo(name, shape, t.tensor_type.name, 8 * nbytes / block)

    def get(self, name: str) -> torch.Tensor:
        import gguf

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
