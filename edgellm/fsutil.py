"""Outputs appear complete or not at all, and nothing but the output is ever touched.

`check_output` vets an output location before any work starts: it is not the
source model, does not contain it and is not inside it; its parent can be
created and written; an existing output is only replaced with `force`, and a
directory only when it holds a model (never a folder of unrelated files).
`atomic_path` writes under a temporary sibling and renames it when complete; an
exception, Ctrl-C or SIGTERM removes the temporary and leaves the old output.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgellm.errors import InvalidParameterError, OutputExistsError

# files that mark a directory as a model (ours or Hugging Face's), so --force may replace it
MODEL_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json")


def check_output(
    path: str | Path, force: bool, source: str | Path | None = None, is_dir: bool = False
) -> None:
    """Raise before any work if writing `path` could lose anything but a previous output."""
    path = Path(path).expanduser()
    out = path.resolve()
    if source is not None:
        src = Path(source).expanduser().resolve()
        if out == src:
            raise InvalidParameterError(f"output {path} is the source model itself")
        if out in src.parents:
            raise InvalidParameterError(f"output {path} contains the source model {src}")
        if src.is_dir() and src in out.parents:
            raise InvalidParameterError(f"output {path} is inside the source model {src}")
    _check_parent(path, out)
    if not (path.exists() or path.is_symlink()):
        return
    if not force:
        raise OutputExistsError(f"{path} exists; pass --force to replace it")
    if path.is_symlink():
        raise InvalidParameterError(f"{path} is a symbolic link; remove it or choose another -o")
    if path.is_dir() and not is_dir:
        raise InvalidParameterError(f"{path} is a directory; the output here is a file")
    if (
        path.is_dir()
        and any(path.iterdir())
        and not any((path / m).exists() for m in MODEL_MARKERS)
    ):
        raise InvalidParameterError(
            f"{path} is a directory of other files (no {MODEL_MARKERS[0]}); --force only "
            "replaces a previous model output"
        )


def _check_parent(path: Path, out: Path) -> None:
    """The nearest existing ancestor is a directory we may create entries in."""
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidParameterError(f"cannot write {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidParameterError(f"cannot write {path}: {parent} is not writable")


class Terminated(SystemExit):
    """SIGTERM, raised in the main thread so that cleanup runs as it does for Ctrl-C."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


@contextmanager
def terminate_raises() -> Iterator[None]:
    """While active (main thread only), SIGTERM raises `Terminated` instead of killing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def atomic_path(path: str | Path, force: bool = False, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write into; it becomes `path` only on success."""
    path = Path(path).expanduser()
    check_output(path, force, is_dir=is_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with terminate_raises():
        _remove(tmp)
        if is_dir:
            tmp.mkdir()
        try:
            yield tmp
            _normal_permissions(tmp)
            if path.exists():  # --force: swap in the new output, then drop the old one
                old = path.with_name(f".{path.name}.old-{os.getpid()}")
                path.rename(old)
                tmp.rename(path)
                _remove(old)
            else:
                tmp.rename(path)
        except BaseException:
            _remove(tmp)
            raise


def _normal_permissions(p: Path) -> None:
    """Files as `open()` would create them (some writers use private 0600 temp files)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]:
        f.chmod(0o666 & ~umask)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()
