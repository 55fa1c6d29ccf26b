"""Our CPU kernels (`cpu_kernels.c`), compiled on first use and loaded with ctypes.

The source is built with the machine's C compiler for this CPU (`-O3 -march=native
-fopenmp`) into `~/.cache/edgellm/kernels/<hash>.so`, the hash covering the source, the
flags and the CPU, so a change of any of them rebuilds it; the build takes about a
second and goes to a temporary name first. The library links the OpenMP runtime torch
already loaded, so its threads are torch's threads. Where no compiler works, `library()`
is None and callers take the torch reference path (`paged_attention`); `status()` says
why, for `edgellm info`. EDGELLM_REFERENCE=1 turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from edgellm.kernels.paged_attention import AttentionMetadata

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
CACHE = Path(os.environ.get("EDGELLM_CACHE", Path.home() / ".cache" / "edgellm")) / "kernels"

_state: dict[str, str] = {}
# the paged-attention kernel for each cache dtype (int8: rows of codes + their fp32 scale)
_KERNELS = {
    torch.float32: "paged_attention_f32",
    torch.bfloat16: "paged_attention_bf16",
    torch.int8: "paged_attention_q8",
}


def reference_only() -> bool:
    """EDGELLM_REFERENCE=1: every fast path off (the reference twins run instead)."""
    return os.environ.get("EDGELLM_REFERENCE", "") not in ("", "0")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:  # x86 "flags", Arm "Features"
            flags = next(ln for ln in f if ln.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags.partition(':')[2].strip()}"


def native_bf16() -> bool:
    """Whether the CPU has bf16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16,
    Arm BF16); without them torch's bf16 matmuls convert to fp32 and run slower."""
    flags = set(_cpu_id().split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def auto_dtype() -> str:
    """What "auto" means for torch compute here: bfloat16 where the CPU multiplies it
    natively, float32 elsewhere (where bf16 matmuls run several times slower, on AVX2)."""
    return "bfloat16" if native_bf16() else "float32"


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS, _cpu_id()]).encode())
    lib = CACHE / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        part = Path(tmp) / lib.name
        done = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", str(part), "-lm"], capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-400:]}")
        os.replace(part, lib)  # whole or absent: a concurrent build renames the same bytes
    return lib


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (reference path) with the reason in `status()`."""
    if reference_only():
        _state["status"] = "off (EDGELLM_REFERENCE=1)"
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as e:
        _state["status"] = f"unavailable ({e}); torch reference path"
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _KERNELS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float, i64, i64]
        fn.restype = ctypes.c_int
    lib.linear_rows_f32.argtypes = [ptr] * 4 + [i64] * 3
    lib.linear_rows_f32.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.add_rms_norm_f32.argtypes = [ptr] * 5 + [i64, i64, f32]
    lib.rope_f32.argtypes = [ptr] * 4 + [i64] * 4
    lib.silu_mul_f32.argtypes = [ptr, ptr, i64, i64]
    for name in ("add_rms_norm_f32", "rope_f32", "silu_mul_f32"):
        getattr(lib, name).restype = None
    lib.bind_threads.argtypes = [ptr, ctypes.c_int32]
    lib.bind_threads.restype = ctypes.c_int
    _state["status"] = "compiled C (OpenMP, -march=native)"
    return lib


def status() -> str:
    library()
    return _state["status"]


def bind_threads(cpus: list[int]) -> int:
    """Pin torch's OpenMP threads one per CPU of `cpus`; returns how many were pinned."""
    lib = library()
    if lib is None or not cpus:
        return 0
    arr = (ctypes.c_int32 * len(cpus))(*cpus)
    return lib.bind_threads(arr, len(cpus))


def supports(k_cache: torch.Tensor) -> bool:
    return k_cache.dtype in _KERNELS and library() is not None


def paged_attention_rows(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [N, bs, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int64
    row_seq: torch.Tensor,  # [T] int64: which block table each row reads
    row_len: torch.Tensor,  # [T] int64: keys each row attends to (its position + 1)
    scale: float,
    window: int = 0,  # only the last `window` of those keys (0: all) ...
    sinks: int = 0,  # ... and the first `sinks`
) -> torch.Tensor:  # [T, H, D] in q's dtype
    """Causal paged attention of arbitrary rows (see cpu_kernels.c)."""
    lib = library()
    t, h, d = q.shape
    n, bs, kvh, _ = k_cache.shape
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    tables = block_tables.contiguous()
    rows, lens = row_seq.contiguous(), row_len.contiguous()
    failed = getattr(lib, _KERNELS[k_cache.dtype])(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        rows.data_ptr(), lens.data_ptr(), out.data_ptr(),
        t, h, kvh, d, bs, tables.shape[1], scale, window, sinks,
    )  # fmt: skip
    if failed:
        raise MemoryError("paged attention could not allocate its scratch buffer")
    return out.to(q.dtype)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) in fp32 for small M (a weight stream; see the C)."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[0])
    library().linear_rows_f32(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        y.data_ptr(), x.shape[0], weight.shape[0], x.shape[1],
    )  # fmt: skip
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + residual, RMSNorm of it), fp32 rows [T, D] (contiguous)."""
    h, out = torch.empty_like(x), torch.empty_like(x)
    t, d = x.shape
    library().add_rms_norm_f32(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), h.data_ptr(), out.data_ptr(),
        t, d, eps,
    )  # fmt: skip
    return h, out


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions, heads: int):
    """Rotate the first `heads` heads of each row of qkv [T, W] in place; cos/sin [P, D]."""
    t, width = qkv.shape
    library().rope_f32(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
        t, width, heads, cos.shape[-1],
    )  # fmt: skip
    return qkv


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from [T, 2F] -> [T, F]."""
    t, f2 = gate_up.shape
    out = gate_up.new_empty(t, f2 // 2)
    library().silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), t, f2 // 2)
    return out


def row_metadata(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: its sequence index and how many keys it sees (causal within a chunk)."""
    qsl = meta.query_start_loc
    counts = torch.tensor([qsl[b + 1] - qsl[b] for b in range(len(meta.context_lens))])
    row_seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    ends = torch.tensor(meta.context_lens)[row_seq]  # [T] each row's sequence context
    chunk_end = torch.tensor(qsl[1:])[row_seq]  # one past the row's chunk
    row_len = ends - (chunk_end - 1 - torch.arange(qsl[-1]))  # later rows see more keys
    return row_seq, row_len
