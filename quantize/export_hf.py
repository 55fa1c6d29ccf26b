"""`edgellm convert`: a GGUF (or any loadable model) to a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgellm.errors import InvalidParameterError
from edgellm.fsutil import atomic_path, check_output
from edgellm.loaders.model import load_model
from edgellm.registry import resolve_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def convert_to_hf(
    model: str | None, out_dir: str | Path, dtype: str = "bfloat16", force: bool = False
) -> Path:
    """Write safetensors, config.json, generation_config.json and tokenizer files."""

    if dtype not in DTYPES:
        raise InvalidParameterError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    check_output(out_dir, force, source=resolve_model(model), is_dir=True)
    loaded = load_model(model)
    args = loaded.args
    names = [
        n
        for n in loaded.weights.names()
        if not (args.tie_word_embeddings and n == "lm_head.weight")
    ]
    with atomic_path(out_dir, force=force, is_dir=True) as tmp:
        tensors = {n: loaded.weights.get(n).to(DTYPES[dtype]).contiguous() for n in names}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = {**args.to_hf_config(), "torch_dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config(loaded), indent=2)
        )
        loaded.tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def generation_config(loaded) -> dict:
    tok = loaded.tokenizer
    eos = sorted(tok.stop_ids) if tok.stop_ids else loaded.args.eos_token_id
    return {"bos_token_id": tok.bos_id, "eos_token_id": eos, "do_sample": False}
