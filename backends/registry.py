"""The backend registry: name -> (available(), build(model, config)).

A new backend is one file implementing `backends.base.Backend` and one entry here.
`auto` picks the first available backend of `AUTO_ORDER`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from edgellm.backends import cuda, mlx
from edgellm.backends.base import Backend, check_backend
from edgellm.backends.llamacpp import LlamaCppBackend
from edgellm.backends.torch import TorchBackend
from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.loaders.model import LoadedModel


@dataclass(frozen=True, slots=True)
class BackendEntry:
    name: str
    description: str
    available: Callable[[], bool]  # this machine can run it (library importable, device present)
    build: Callable[[LoadedModel, EngineConfig], Backend]
    why_unavailable: Callable[[], str | None] = lambda: None  # said when asked for anyway


def _importable(module: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(module) is not None


BACKENDS: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry(
            "llamacpp",
            "llama.cpp on the CPU (GGUF)",
            _importable("llama_cpp"),
            LlamaCppBackend.build,
        ),
        BackendEntry(
            "torch",
            "PyTorch on the CPU (fused layers, our C attention and decode kernels)",
            lambda: True,
            TorchBackend.build,
        ),
        BackendEntry(
            "mlx",
            "MLX: Apple silicon's GPU (Metal); MLX's CPU build elsewhere",
            mlx.available,
            mlx.MLXBackend.build,
        ),
        BackendEntry(
            "cuda",
            "NVIDIA GPU: our Triton kernels (W4A16, paged attention), CUDA graphs",
            cuda.available,
            cuda.CUDABackend.build,
            cuda.unavailable_reason,
        ),
    )
}
# preference of `auto`: the first this machine can run: a CUDA GPU first; on Apple silicon
# MLX (Metal) before the CPU backends
AUTO_ORDER = (
    ("cuda", "mlx", "llamacpp", "torch") if mlx.apple_silicon() else ("cuda", "llamacpp", "torch")
)
CHOICES = ("auto", *BACKENDS)
# backends that attend to the whole context (no `kv_window`): `auto` passes them over for one
DENSE_ATTENTION = ("llamacpp",)


def available_backends() -> list[str]:
    return [name for name, entry in BACKENDS.items() if entry.available()]


def resolve_backend(name: str, kv_window: int = 0) -> str:
    """The concrete backend for `name`; "auto" picks the first available of AUTO_ORDER (with
    a `kv_window`, the first that masks one)."""
    if name not in CHOICES:
        raise InvalidParameterError(f"unknown backend {name!r} (available: {', '.join(CHOICES)})")
    if name == "auto":
        return next(
            b for b in AUTO_ORDER
            if BACKENDS[b].available() and not (kv_window and b in DENSE_ATTENTION)
        )  # fmt: skip
    entry = BACKENDS[name]
    if not entry.available():
        why = entry.why_unavailable()
        raise InvalidParameterError(
            f"the {name} backend cannot run on this machine" + (f": {why}" if why else "")
        )
    return name


def build_backend(name: str, loaded: LoadedModel, config: EngineConfig) -> Backend:
    """Build the backend `name` (or `auto`'s pick) for a loaded model; checked against the
    contract before the engine sees it."""
    backend = BACKENDS[resolve_backend(name)].build(loaded, config)
    check_backend(backend)
    return backend
