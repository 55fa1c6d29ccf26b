"""One entry point for every model format: `load_model(path)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgellm.errors import EdgeLLMError, ModelFormatError, ModelNotFoundError, TokenizerError
from edgellm.loaders.gguf import (
    GGUFSource,
    check_gguf_weights,
    compact_fields,
    gguf_model_args,
    open_gguf,
)
from edgellm.loaders.hf import (
    check_hf_weights,
    hf_model_args,
    open_safetensors,
    read_config,
    safetensors_files,
)
from edgellm.loaders.tokenizer import Tokenizer
from edgellm.loaders.weights import WeightSource
from edgellm.models.llama import ModelArgs
from edgellm.registry import resolve_model


@dataclass
class LoadedModel:
    """A model's config, lazily-read weights and tokenizer, before building modules."""

    path: Path
    format: str  # "gguf" | "hf"
    args: ModelArgs
    weights: WeightSource
    tokenizer: Tokenizer
    config: dict | None = None  # the HF config.json, when there is one


def load_model(model: str | Path | None = None) -> LoadedModel:
    """Open a GGUF file or HF directory (or a short name / the default model). A checkpoint's
    `quantization_config` is kept in `config` and read where the model is built.

    Nothing is trusted: the header, every hyper-parameter and every tensor's shape are
    checked (`gguf_header`, `validate`) before a byte of weights is read, and any lie
    is one ModelFormatError (or TokenizerError) that names it."""
    path = resolve_model(model)
    if path.is_dir():
        return _load_hf(path)
    return _load_gguf(path)


def _load_gguf(path: Path) -> LoadedModel:
    reader = open_gguf(path)
    args = gguf_model_args(reader, path)
    weights = GGUFSource(reader, args)
    check_gguf_weights(reader, args, weights, path)
    tokenizer = _tokenizer(Tokenizer.from_gguf, reader, path)
    compact_fields(reader)  # read once: the tokenizer arrays as numpy views cost ~370 MB at Qwen
    return _checked(LoadedModel(path, "gguf", args, weights, tokenizer))


def _load_hf(path: Path) -> LoadedModel:
    config = read_config(path)
    _refuse_mlx_format(config, path)
    args = hf_model_args(config, path)
    weights = open_safetensors(safetensors_files(path))
    check_hf_weights(args, weights, path)
    tokenizer = _tokenizer(Tokenizer.from_hf_dir, path, path)
    return _checked(LoadedModel(path, "hf", args, weights, tokenizer, config))


def _refuse_mlx_format(config: dict, path: Path) -> None:
    """An mlx-lm quantized directory (`edgellm export mlx`'s output, mlx-community models):
    its packed uint32 weights with per-group biases are MLX's layout, not one edgellm runs."""
    mlx = config.get("quantization")
    if isinstance(mlx, dict) and "bits" in mlx and "quantization_config" not in config:
        raise ModelFormatError(
            f"{path} is an MLX-format quantized model ({mlx.get('bits')}-bit, group "
            f"{mlx.get('group_size')}: mlx-lm's layout); run it with mlx-lm "
            f"(`mlx_lm.generate --model {path}`), or give edgellm the compressed-tensors "
            "checkpoint or GGUF it was exported from"
        )


def _tokenizer(build, source, path: Path) -> Tokenizer:
    """The tokenizer; a failure inside a tokenizer library becomes one TokenizerError line."""
    try:
        return build(source)
    except EdgeLLMError:
        raise
    except BaseException as e:  # tokenizers/jinja2/json raise their own types on lying files
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise  # KeyboardInterrupt and friends; a Rust panic in `tokenizers` is an error
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise TokenizerError(f"{path}: cannot build the tokenizer ({reason})") from e


def _checked(loaded: LoadedModel) -> LoadedModel:
    """Every id the tokenizer can produce must have an embedding row."""
    n_tokens, n_vocab = loaded.tokenizer.vocab_size, loaded.args.vocab_size
    if n_tokens > n_vocab:
        raise ModelFormatError(
            f"{loaded.path}: the tokenizer has {n_tokens} tokens but the model's vocabulary "
            f"(embedding rows) is {n_vocab}"
        )
    return loaded


def file_size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if not path.exists():
        raise ModelNotFoundError(str(path))
    return path.stat().st_size
