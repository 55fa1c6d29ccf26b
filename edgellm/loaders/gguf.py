"""GGUF files (llama.cpp) of the llama and qwen2 architectures.

Config comes from the GGUF metadata, tensors are renamed to Hugging Face names
and dequantized on access with gguf-py's codecs. llama.cpp's converter permutes
the rows of q/k for the llama architecture (interleaved RoPE); we undo that so
the model runs with HF's rotate-half RoPE and matches transformers.

Nothing in a file is trusted: `gguf_header` scans the header with every length bounded
by the file before gguf-py reads it, and `validate` holds the metadata against the
tensors before anything is built.
"""

from __future__ import annotations

import mmap
import re
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch

from edgellm.errors import ModelFormatError, UnsupportedArchitectureError
from edgellm.loaders.gguf_header import scan_gguf
from edgellm.loaders.validate import Naming, check_weights, model_args, show
from edgellm.loaders.weights import TensorInfo
from edgellm.models import get_model_module, gguf_architecture, model_type_of_gguf
from edgellm.models.llama import ModelArgs

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


# ModelArgs field -> GGUF metadata key, under `{general.architecture}.`
GGUF_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
    "rope_scaling": "rope.scaling",
}
# tensors the file may hold that are not weights by HF name (read into ModelArgs instead)
NON_WEIGHTS = {"rope_freqs.weight"}


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path`, after a bounded scan of its header (`gguf_header`):
    clear errors for non-GGUF, truncated or corrupt files before gguf-py allocates."""
    path = Path(path)
    scan_gguf(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors on corrupt headers
        raise ModelFormatError(f"{path} is a corrupt or truncated GGUF file ({e})") from e


def field_value(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_args(reader, path: str | Path = "the GGUF file") -> ModelArgs:
    """ModelArgs from GGUF metadata (`{arch}.*` keys), every value checked (`validate`)."""
    arch = field_value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{path}: general.architecture is {show(arch)}, expected a string")
    model_type = model_type_of_gguf(arch)
    naming = gguf_naming(reader, path, arch, model_type)
    raw = {f: field_value(reader, f"{arch}.{key}") for f, key in GGUF_KEYS.items()}
    raw = {f: v for f, v in raw.items() if v is not None}
    raw.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    raw.setdefault("vocab_size", _token_count(reader))
    raw.setdefault("head_dim", field_value(reader, f"{arch}.rope.dimension_count", 0))
    tensor_names = {t.name for t in reader.tensors}
    raw.update(
        model_type=model_type,
        rope_scaling=_gguf_rope_scaling(reader, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field_value(reader, "tokenizer.ggml.eos_token_id"),
    )
    args = model_args(raw, naming)
    for key in ("rope.dimension_count", "attention.value_length"):
        value = field_value(reader, f"{arch}.{key}", args.head_dim)
        if value != args.head_dim:  # partial rotary / distinct V width: not this family
            raise naming.error(f"{arch}.{key} is {show(value)}, expected {args.head_dim}")
    return args


def gguf_naming(reader, path: str | Path, arch: str, model_type: str) -> Naming:
    """Errors about a GGUF file in its own words: metadata keys and llama.cpp tensor names."""
    keys = {f: f"{arch}.{key}" for f, key in GGUF_KEYS.items()}
    if f"{arch}.vocab_size" not in reader.fields:
        keys["vocab_size"] = "the vocabulary size (length of tokenizer.ggml.tokens)"
    keys["bos_token_id"] = "tokenizer.ggml.bos_token_id"
    keys["eos_token_id"] = "tokenizer.ggml.eos_token_id"
    return Naming(str(path), keys, lambda hf: gguf_name(hf, model_type) or hf)


def _token_count(reader) -> int | None:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return None if tokens is None else len(tokens.data)


def check_gguf_weights(reader, args: ModelArgs, source: GGUFSource, path: str | Path) -> None:
    """The file's tensors are exactly those of `args`' model (`validate.check_weights`)."""
    naming = gguf_naming(reader, path, gguf_architecture(args.model_type)[0], args.model_type)
    for t in reader.tensors:
        if t.name not in NON_WEIGHTS and hf_name(t.name, args.model_type) is None:
            raise naming.error(f"unexpected tensor {t.name}")
        if not readable(t.tensor_type):
            raise naming.error(
                f"tensor {t.name} has type {t.tensor_type.name}, which is not a weight type "
                "gguf-py can decode"
            )
    check_weights(args, source, naming)


@cache
def readable(qtype: gguf.GGMLQuantizationType) -> bool:
    """gguf-py can dequantize `qtype` (probed on one zero block: its public API only)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except (NotImplementedError, ValueError):
        return False
    return True


def _gguf_rope_scaling(reader, arch: str) -> dict | None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # llama3-style scaling, stored precomputed
            return {
                "rope_type": "freq_factors",
                "freq_factors": _floats(t).tolist(),
            }
    kind = field_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": field_value(reader, f"{arch}.rope.scaling.factor")}
    raise UnsupportedArchitectureError(f"unsupported GGUF rope scaling {show(kind)}")


DEQUANT_ROWS = 4096  # rows decoded at once: gguf-py's temporaries stay a few MiB per call


def _floats(t) -> np.ndarray:
    """A tensor's values as float32 (flat), decoded in chunks of rows into one new array (a
    151936-row embedding table would otherwise pass through several full-size temporaries);
    ModelFormatError for types gguf-py cannot decode."""
    data = t.data
    try:
        if data.ndim != 2 or data.shape[0] <= DEQUANT_ROWS:
            return np.array(gguf.dequantize(data, t.tensor_type), np.float32).reshape(-1)
        out = None
        for r in range(0, data.shape[0], DEQUANT_ROWS):
            part = gguf.dequantize(data[r : r + DEQUANT_ROWS], t.tensor_type)
            if out is None:
                out = np.empty((data.shape[0], part.shape[-1]), np.float32)
            out[r : r + part.shape[0]] = part
        return out.reshape(-1)
    except (NotImplementedError, ValueError) as e:
        raise ModelFormatError(
            f"tensor {t.name} has type {t.tensor_type.name}, which cannot be read ({e})"
        ) from e


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k weights (interleaved -> rotate-half)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


class CompactField:
    """A GGUF metadata array read once into Python values, in place of gguf-py's field.

    gguf-py keeps every element of an array field as numpy views (two per string), for as long
    as the reader lives: Qwen2.5's 151,936 tokens and 151,387 merges hold about 370 MB that
    way, against about 30 MB as Python values. Same interface as far as edgellm reads it:
    `name`, `types`, `data` (one index per element) and `contents()`."""

    __slots__ = ("name", "types", "data", "_value")

    def __init__(self, field):
        self.name, self.types = field.name, list(field.types)
        self._value = field.contents()
        self.data = range(len(self._value))

    def contents(self, index_or_slice: int | slice = slice(None)):
        return self._value[index_or_slice]


def compact_fields(reader) -> None:
    """Replace the reader's array fields (the tokenizer's, mostly) by `CompactField`s."""
    for key, field in list(reader.fields.items()):
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            reader.fields[key] = CompactField(field)


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
        w = torch.from_numpy(_floats(t)).reshape(shape)
        if self._is_permuted(name):
            heads = (
                self.args.num_attention_heads if "q_proj" in name else self.args.num_key_value_heads
            )
            w = unpermute_qk(w, heads)
        return w

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop), float32, decoded from those rows' blocks only (a quantized
        row is whole blocks, so rows decode alone)."""
        t = self._tensors[name]
        cols = int(t.shape[0])
        if t.data.ndim != 2 or self._is_permuted(name):
            return self.get(name)[start:stop]
        try:
            part = gguf.dequantize(t.data[start:stop], t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ModelFormatError(
                f"tensor {t.name} has type {t.tensor_type.name}, which cannot be read ({e})"
            ) from e
        return torch.from_numpy(np.asarray(part, np.float32).reshape(-1, cols))

    def _is_permuted(self, name: str) -> bool:
        return self._permuted and name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        )

    def release(self) -> None:
        """Drop the file's pages from this process's resident set (they stay in the page
        cache; a later `get` maps them again): a layer-by-layer reader stays bounded by one
        layer, not by the pages of every layer read so far."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)
