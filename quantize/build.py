"""A runnable torch model from a loaded one: float weights, or a compressed-tensors INT
checkpoint run as stored (packed Linears become `QuantLinear`)."""

from __future__ import annotations

import torch

from edgellm.errors import ModelFormatError
from edgellm.loaders.model import LoadedModel
from edgellm.models import get_model_module
from edgellm.quantize.format import read_quant_config
from edgellm.quantize.linear import swap_linears


def build_model(loaded: LoadedModel, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Instantiate the torch model and load its weights (built on `meta`, then assigned).

    A checkpoint with a `quantization_config` (compressed-tensors pack-quantized) runs
    as stored: its packed Linears become `QuantLinear` and integer tensors stay integer.
    """
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
    try:
        model.load_state_dict({k: weights[k] for k in expected}, assign=True, strict=True)
    except RuntimeError as e:  # shapes the checkpoint's config does not explain
        first = str(e).strip().splitlines()[-1].strip()
        raise ModelFormatError(f"{loaded.path}: tensors do not fit the config: {first}") from e
    model.inv_freq = module.rope_inv_freq(loaded.args)  # buffers are not in the state dict
    if loaded.args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _swap_quantized(model: torch.nn.Module, loaded: LoadedModel, dtype: torch.dtype) -> None:
    """Turn the Linears the checkpoint stores packed into QuantLinear (meta, shapes only)."""
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
