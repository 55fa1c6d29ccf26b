"""This process's memory as the OS sees it."""

from __future__ import annotations

import ctypes


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`). Building a model or
    quantizing a layer frees many large temporaries (dequantized blocks, casts, activations)
    that glibc keeps mapped otherwise, and the resident set creeps up layer after layer."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
