"""Hugging Face model directories: config.json + (sharded) safetensors."""

from __future__ import annotations

import json
from pathlib import Path

from edgellm.errors import ModelFormatError, ModelNotFoundError
from edgellm.loaders.weights import SafetensorsSource
from edgellm.models.llama import ModelArgs


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_file} is not valid JSON ({e})") from e


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files, in index order when sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFormatError(f"{path} is missing shards: {', '.join(missing)}")
    return files


def open_safetensors(files: list[Path]) -> SafetensorsSource:
    try:
        return SafetensorsSource(files)
    except Exception as e:  # safetensors raises on truncated headers/data
        raise ModelFormatError(
            f"corrupt or truncated safetensors file in {files[0].parent} ({e})"
        ) from e


def hf_model_args(config: dict) -> ModelArgs:
    return ModelArgs.from_hf_config(config)
