"""Model architectures (torch): one file per family, chosen by `model_type`."""

from edgellm.errors import UnsupportedArchitectureError

# model_type -> module file. Families that share one implementation share a file;
# per-architecture differences (QKV bias, ...) are data in that file's table.
MODEL_REMAPPING = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
}


def get_model_module(model_type: str):
    """Return the module implementing `model_type` (e.g. `edgellm.models.llama`)."""
    import importlib

    name = MODEL_REMAPPING.get(model_type)
    if name is None:
        supported = ", ".join(sorted(MODEL_REMAPPING))
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r} (supported: {supported})"
        )
    return importlib.import_module(f"edgellm.models.{name}")
