"""Outputs appear complete or not at all: write under a temporary name, then rename."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgellm.errors import OutputExistsError


def check_output(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise OutputExistsError(f"{path} exists; pass --force to replace it")


@contextmanager
def atomic_path(path: str | Path, force: bool = False, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write into; it becomes `path` only on success."""
    path = Path(path)
    check_output(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
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
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
