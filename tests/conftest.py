"""Shared fixtures: tiny random Llama/Qwen2 models built in memory, the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, os.cpu_count() or 1))

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def tiny_hf_model(model_type: str = "llama", tie: bool = False, seed: int = 0, **over):
    """A transformers model with random weights (the oracle) and its config dict."""
    import transformers

    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}[model_type]
    cfg = getattr(transformers, cls)(**{**TINY, **over}, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model_cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    hf = getattr(transformers, model_cls[model_type])(cfg).eval()
    with torch.no_grad():  # biases are zero-initialised; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf, cfg.to_dict()


def ours_from_hf(hf, config: dict, dtype=torch.float32):
    """Our model built from the same weights as a transformers model."""
    from edgellm.loaders.model import LoadedModel, build_model
    from edgellm.loaders.weights import DictSource
    from edgellm.models.llama import ModelArgs

    args = ModelArgs.from_hf_config(config)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    loaded = LoadedModel(Path("memory"), "hf", args, DictSource(sd), tokenizer=None, config=config)
    return build_model(loaded, dtype)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from edgellm.registry import resolve_model

    return resolve_model("smollm2-135m")
