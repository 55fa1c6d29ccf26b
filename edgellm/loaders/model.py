"""One entry point for every model format: `load_model(path)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edgellm.errors import ModelFormatError, ModelNotFoundError
from edgellm.loaders.weights import WeightSource
from edgellm.models.llama import ModelArgs


@dataclass
class LoadedModel:
    """A model's config, lazily-read weights and tokenizer, before building modules."""

    path: Path
    format: str  # "gguf" | "hf"
    args: ModelArgs
    weights: WeightSource
    tokenizer: object  # edgellm.tokenizer.Tokenizer
    config: dict | None = None  # the HF config.json, when there is one


def load_model(model: str | Path | None = None) -> LoadedModel:
    """Open a GGUF file or HF directory (or a short name / the default model)."""
    from edgellm.registry import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        return _load_hf(path)
    return _load_gguf(path)


def _load_gguf(path: Path) -> LoadedModel:
    from edgellm.loaders.gguf import GGUFSource, gguf_model_args, open_gguf
    from edgellm.tokenizer import Tokenizer

    reader = open_gguf(path)
    args = gguf_model_args(reader)
    return LoadedModel(path, "gguf", args, GGUFSource(reader, args), Tokenizer.from_gguf(reader))


def _load_hf(path: Path) -> LoadedModel:
    from edgellm.loaders.hf import hf_model_args, open_safetensors, read_config, safetensors_files
    from edgellm.quantize.checkpoint import read_quant_config
    from edgellm.tokenizer import Tokenizer

    config = read_config(path)
    args = hf_model_args(config)
    read_quant_config(config)  # refuse unsupported quantization before reading weights
    weights = open_safetensors(safetensors_files(path))
    return LoadedModel(path, "hf", args, weights, Tokenizer.from_hf_dir(path), config)


def build_model(loaded: LoadedModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Instantiate the torch model and load its weights (built on `meta`, then assigned).

    A checkpoint with a `quantization_config` (compressed-tensors pack-quantized) runs
    as stored: its packed Linears become `QuantLinear` and integer tensors stay integer.
    """
    from edgellm.models import get_model_module

    module = get_model_module(loaded.args.model_type)
    with torch.device("meta"):
        model = module.Model(loaded.args)
    _swap_quantized(model, loaded, dtype)
    weights = {n: _cast(loaded.weights.get(n), dtype) for n in loaded.weights.names()}
    weights = model.sanitize(weights)
    expected = set(model.state_dict())
    missing = expected - set(weights)
    if missing:
        raise ModelFormatError(
            f"{loaded.path} is missing tensors: {', '.join(sorted(missing)[:5])}"
        )
    model.load_state_dict({k: weights[k] for k in expected}, assign=True, strict=True)
    model.inv_freq = module.rope_inv_freq(loaded.args)  # buffers are not in the state dict
    if loaded.args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _swap_quantized(model: torch.nn.Module, loaded: LoadedModel, dtype: torch.dtype) -> None:
    """Turn the Linears the checkpoint stores packed into QuantLinear (meta, shapes only)."""
    from edgellm.quantize.checkpoint import read_quant_config
    from edgellm.quantize.linear import swap_linears

    qconfig = read_quant_config(loaded.config or {})
    if qconfig is None:
        return
    suffix = ".weight_packed"
    packed = {n.removesuffix(suffix) for n in loaded.weights.names() if n.endswith(suffix)}
    if not packed:
        raise ModelFormatError(f"{loaded.path} has a quantization_config but no packed weights")
    swap_linears(model, qconfig, ignore=(), include=packed, dtype=dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floats to the model dtype; integer tensors (packed codes, zero points, shapes) as they are."""
    return t.to(dtype) if t.is_floating_point() else t


def file_size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if not path.exists():
        raise ModelNotFoundError(str(path))
    return path.stat().st_size
