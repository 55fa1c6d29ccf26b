"""One entry point for every model format: `load_model(path)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgellm.errors import ModelNotFoundError
from edgellm.loaders.gguf import GGUFSource, gguf_model_args, open_gguf
from edgellm.loaders.hf import hf_model_args, open_safetensors, read_config, safetensors_files
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
    `quantization_config` is kept in `config` and read where the model is built."""
    path = resolve_model(model)
    if path.is_dir():
        return _load_hf(path)
    return _load_gguf(path)


def _load_gguf(path: Path) -> LoadedModel:
    reader = open_gguf(path)
    args = gguf_model_args(reader)
    return LoadedModel(path, "gguf", args, GGUFSource(reader, args), Tokenizer.from_gguf(reader))


def _load_hf(path: Path) -> LoadedModel:
    config = read_config(path)
    args = hf_model_args(config)
    weights = open_safetensors(safetensors_files(path))
    return LoadedModel(path, "hf", args, weights, Tokenizer.from_hf_dir(path), config)


def file_size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if not path.exists():
        raise ModelNotFoundError(str(path))
    return path.stat().st_size
