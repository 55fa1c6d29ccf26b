"""Hugging Face model directories: config.json + (sharded) safetensors.

Nothing in the directory is trusted: config.json must be an object whose sizes hold
against the tensors (`validate`), the shard index must name plain files inside the
directory, and a safetensors header that does not parse is a ModelFormatError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgellm.errors import ModelFormatError, ModelNotFoundError
from edgellm.loaders.validate import PACKED_PARTS, Naming, check_weights, model_args, show
from edgellm.loaders.weights import SafetensorsSource
from edgellm.models.llama import ModelArgs, hf_fields

# ModelArgs fields that config.json spells differently
HF_KEYS = {"qkv_bias": "attention_bias"}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names
# config.json keys read as nested objects
HF_OBJECTS = ("rope_parameters", "rope_scaling")


def read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelFormatError(f"{file} is not valid JSON ({e})") from None


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    config = read_json(cfg_file)
    if not isinstance(config, dict):
        raise ModelFormatError(f"{cfg_file} holds a {type(config).__name__}, expected an object")
    return config


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files, in index order when sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / s for s in _index_shards(index)]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFormatError(f"{path} is missing shards: {', '.join(missing)}")
    return files


def _index_shards(index: Path) -> list[str]:
    """Shard file names of an index; each must be a plain *.safetensors name in the directory."""
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFormatError(f"{index} has no weight_map object (tensor name -> shard file)")
    shards = set(weight_map.values())
    for shard in shards:
        plain = isinstance(shard, str) and Path(shard).name == shard
        if not plain or not shard.endswith(".safetensors"):
            raise ModelFormatError(
                f"{index} maps a tensor to {show(shard)}, expected a .safetensors file name "
                "in the same directory"
            )
    return sorted(shards)


def open_safetensors(files: list[Path]) -> SafetensorsSource:
    try:
        return SafetensorsSource(files)
    except Exception as e:  # safetensors raises on truncated headers/data
        reason = " ".join(str(e).split())[:300]
        raise ModelFormatError(
            f"corrupt or truncated safetensors file in {files[0].parent} ({reason})"
        ) from e


def hf_naming(path: Path) -> Naming:
    return Naming(str(path / "config.json"), HF_KEYS)


def hf_model_args(config: dict, path: Path = Path(".")) -> ModelArgs:
    """ModelArgs from a config.json dict, every value checked (`validate`)."""
    naming = hf_naming(path)
    for key in HF_OBJECTS:
        if not isinstance(config.get(key), dict | None):
            raise naming.error(f"{key} is {show(config[key])}, expected an object or null")
    return model_args(hf_fields(config), naming)


def check_hf_weights(args: ModelArgs, weights: SafetensorsSource, path: Path) -> None:
    """The tensors are exactly `args`' model's (`validate.check_weights`); dense ones float."""
    naming = hf_naming(path)
    for name in weights.names():
        dtype = weights.info(name).dtype
        if not name.endswith(PACKED_PARTS) and dtype not in FLOAT_DTYPES:
            raise naming.error(f"tensor {name} has dtype {dtype}, expected a float type")
    check_weights(args, weights, naming)
