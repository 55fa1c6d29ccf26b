"""Model architectures (torch): one file per family, chosen by `model_type`.

A family file holds every per-architecture fact: `ModelArgs`, the modules, its
weight names (HF and GGUF), its AWQ scale groups. Adding an architecture that an
existing family covers is one line here; a new family is one file and its lines.
"""

from types import ModuleType

from edgellm.errors import UnsupportedArchitectureError
from edgellm.models import llama

# one line per family file; each lists its model_types in its FAMILY table
FAMILIES: tuple[ModuleType, ...] = (llama,)
# model_type -> the module implementing it
ARCHITECTURES: dict[str, ModuleType] = {t: f for f in FAMILIES for t in f.FAMILY}


def get_model_module(model_type: str) -> ModuleType:
    """Return the module implementing `model_type` (e.g. `edgellm.models.llama`)."""
    module = ARCHITECTURES.get(model_type)
    if module is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r} (supported: {supported})"
        )
    return module


def gguf_architecture(model_type: str) -> tuple[str, bool]:
    """(llama.cpp general.architecture, q/k rows permuted) of a model_type."""
    return get_model_module(model_type).FAMILY[model_type]["gguf"]


def model_type_of_gguf(arch: str) -> str:
    """The model_type a GGUF `general.architecture` loads as (the first family that names it)."""
    for model_type, module in ARCHITECTURES.items():
        if module.FAMILY[model_type]["gguf"][0] == arch:
            return model_type
    known = sorted({m.FAMILY[t]["gguf"][0] for t, m in ARCHITECTURES.items()})
    raise UnsupportedArchitectureError(
        f"unsupported GGUF architecture {arch!r} (supported: {', '.join(known)})"
    )
