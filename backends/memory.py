"""Memory budgets: what a model on a backend will hold, and the KV pool that fits the rest.

`plan_memory` adds up, before anything is loaded:

- base: what the process holds already (the interpreter, torch, the libraries: its RSS);
- weights: what the backend keeps. torch: every tensor in the compute dtype, packed INT
  codes as stored, plus the source files' pages (mapped, read once while building);
  llama.cpp: the GGUF file it runs (mapped: its pages count once read), or the size its
  export will have, plus the copies its CPU backend makes of the 4-bit matmul weights it
  repacks into interleaved blocks (Q4_0, Q4_K, IQ4_NL on AVX2 / Arm dot-product CPUs);
- working: one step's activations and logits, the backend's own buffers (llama.cpp: its
  output buffer for every sequence id and its compute buffer for a micro-batch), and a
  runtime allowance measured on SmolLM2 (tokenizer, model metadata, allocator slack);
- KV: what is left, in whole blocks, as the pool size (`kv_cache_mb`).

With `kv_cache_dtype="auto"` the plan stores K/V in 8 bits where the backend can and a
16/32-bit pool would not hold one full context (`max_model_len`); the table shows every
storage the backend offers.
A budget that the weights and working memory alone exceed is refused with the numbers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import torch

from edgellm.backends.base import kv_bytes_per_token
from edgellm.backends.llamacpp import MAX_SEQ
from edgellm.backends.torch import DTYPES, resolve_dtype
from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.loaders.model import LoadedModel
from edgellm.quantize.export_gguf import GGUFExport
from edgellm.registry import packaged_llamacpp_type

MB = 2**20
PLANNED = ("torch", "llamacpp")
# what a loaded model's process holds beyond base, weights, KV and the step buffers counted
# below, measured on SmolLM2 with the pool full (32 sequences at once): with these, the
# plan's total was the peak RSS within 1% on torch and 4-10% above it on llama.cpp (whose
# worst-case buffers are only partly touched by generation) at budgets of 1.1-2.5 GB
RUNTIME_BYTES = {"torch": 140 * MB, "llamacpp": 20 * MB}  # torch: 120 on a bf16 CPU, 128 on an fp32 one
UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str | float | int) -> int:
    """Bytes from "4GB", "4 GiB", "3500MB", "512M" (binary units: a GB is 2**30) or a number
    of bytes."""
    if isinstance(text, int | float):
        size = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
        if m is None:
            raise InvalidParameterError(
                f"cannot read memory size {text!r} (examples: 4GB, 3.5GiB, 800MB)"
            )
        size = float(m.group(1)) * UNITS[m.group(2)]
    if not size > 0:
        raise InvalidParameterError(f"memory size must be positive, got {text!r}")
    return int(size)


def process_rss() -> int:
    """This process's resident memory now (bytes; 0 where /proc is not there)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        return kb * 1024
    except (OSError, StopIteration):
        return 0


@dataclass
class MemoryPlan:
    backend: str
    budget: int
    base: int
    weights: int
    working: int
    kv_dtype: str  # "auto" (the backend's float) | "int8"
    kv_per_token: int
    kv_bytes: int  # the pool: whole blocks
    block_size: int
    max_model_len: int
    # every K/V storage the backend offers -> (name, bytes per token, tokens the budget holds)
    options: dict[str, tuple[str, int, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.base + self.weights + self.working + self.kv_bytes

    @property
    def tokens(self) -> int:
        return self.kv_bytes // self.kv_per_token

    @property
    def kv_cache_mb(self) -> float:
        return self.kv_bytes / MB

    def sequences(self, length: int, kv_dtype: str | None = None) -> int:
        """Sequences of `length` tokens that fit at once (each rounded up to whole blocks)."""
        tokens = self.options[kv_dtype or self.kv_dtype][2]
        blocks = -(-length // self.block_size)
        return tokens // self.block_size // blocks

    def engine_overrides(self) -> dict:
        return {"kv_cache_mb": self.kv_cache_mb, "kv_cache_dtype": self.kv_dtype}


def plan_memory(
    loaded: LoadedModel,
    config: EngineConfig,
    backend: str,
    budget: int,
    base: int | None = None,
) -> MemoryPlan:
    """The plan for `loaded` on `backend` within `budget` bytes (see the module doc)."""
    if backend not in PLANNED:
        raise InvalidParameterError(
            f"memory budgets are planned for the {' and '.join(PLANNED)} backends, "
            f"not {backend} (give --kv-cache-mb instead)"
        )
    args = loaded.args
    base = process_rss() if base is None else base
    if backend == "torch":
        dtype = DTYPES[resolve_dtype(config.dtype)]
        # the built tensors, and the source file's pages (mapped; read once, they stay resident)
        weights = torch_weight_bytes(loaded, dtype) + source_bytes(loaded)
        storages = {"auto": (str(dtype).removeprefix("torch."), dtype), "int8": ("int8", torch.int8)}
        tokens = config.max_num_batched_tokens
        rows = max(config.max_num_seqs, 1)
        # one step: residual stream, normed input, qkv, attention out, gate+up, their product
        width = 4 * args.hidden_size + 2 * args.num_attention_heads * args.head_dim
        act = tokens * (width + 3 * args.intermediate_size) * 4
        working = act + 3 * rows * args.vocab_size * 4  # logits, probabilities, sampler copy
        slack_tokens = 0
    else:
        # the GGUF (mapped: its pages count once read) + the copies llama.cpp's CPU backend
        # makes of the tensors it repacks into interleaved blocks (its CPU_REPACK buffer)
        weights = sum(gguf_bytes(loaded, config.llamacpp_type))
        storages = {"auto": ("f16", torch.float16)}
        if config.flash_attn and args.head_dim % 32 == 0:
            storages["int8"] = ("q8_0", "q8_0")
            storages["int4"] = ("q4_0", "q4_0")
        n_batch = max(config.max_num_batched_tokens, MAX_SEQ)
        ubatch = min(512, n_batch)
        # llama.cpp's output buffer (logits for every sequence id) and compute buffer (a
        # micro-batch's logits and activations), as its own log reports them
        out_buf = MAX_SEQ * args.vocab_size * 4
        compute = ubatch * (args.vocab_size + 4 * args.hidden_size + 3 * args.intermediate_size) * 4
        working = out_buf + compute
        slack_tokens = config.max_num_batched_tokens  # n_ctx = pool + one batch of cells
    working += RUNTIME_BYTES[backend]
    per_token = {
        k: kv_bytes_per_token(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, s)
        for k, (_, s) in storages.items()
    }
    free = budget - base - weights - working
    options = {}
    for k, (name, _) in storages.items():
        pool_tokens = max(0, free // per_token[k] - slack_tokens)
        pool_tokens -= pool_tokens % config.block_size
        options[k] = (name, per_token[k], pool_tokens)
    context = min(config.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
    kv_dtype = config.kv_cache_dtype
    if kv_dtype == "auto" and "int8" in options and options["auto"][2] < context:
        kv_dtype = "int8"
    if kv_dtype not in options:
        raise InvalidParameterError(f"kv_cache_dtype {kv_dtype} is not available on {backend}")
    tokens = options[kv_dtype][2]
    if tokens < 2 * config.block_size:
        raise InvalidParameterError(
            f"a {budget / MB:,.0f} MiB memory budget does not fit {loaded.path.name} on "
            f"{backend}: this process {base / MB:,.0f} MiB + weights {weights / MB:,.0f} MiB "
            f"+ working memory {working / MB:,.0f} MiB leave {max(free, 0) / MB:,.0f} MiB, "
            f"less than two KV blocks ({2 * config.block_size} tokens at "
            f"{per_token[kv_dtype]:,} bytes)"
        )
    working += slack_tokens * per_token[kv_dtype]  # llama.cpp's cells beyond the pool
    return MemoryPlan(
        backend, budget, base, weights, working, kv_dtype, per_token[kv_dtype],
        tokens * per_token[kv_dtype], config.block_size, min(context, tokens), options,
    )  # fmt: skip


def torch_weight_bytes(loaded: LoadedModel, dtype: torch.dtype) -> int:
    """Bytes of the torch model `build_model` makes: float tensors (and dequantized GGUF
    blocks) in `dtype`, integer tensors (packed codes, zero points) as stored; a tied LM
    head shares the embeddings."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name in loaded.weights.names():
        info = loaded.weights.info(name)
        n = 1
        for d in info.shape:
            n *= d
        stored = _INT_BYTES.get(info.dtype.lower())
        total += n * (stored if stored else size)
    return total


_INT_BYTES = {"int32": 4, "i32": 4, "int64": 8, "i64": 8, "int8": 1, "i8": 1, "uint8": 1, "u8": 1}


def source_bytes(loaded: LoadedModel) -> int:
    """Bytes of the weight files a model is read from (a GGUF, or a directory's safetensors)."""
    path = Path(loaded.path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# GGML types llama.cpp's CPU backend repacks (ggml-cpu/repack.cpp: 4-bit blocks interleaved
# 4x4/4x8/8x8 for AVX2 and Arm dot products) into a second buffer, keeping the file mapped;
# 2-D matmul weights only (not the embeddings, read by row), rows a multiple of 8
REPACKED_TYPES = ("Q4_0", "Q4_K", "IQ4_NL")


def cpu_repacks() -> bool:
    """Whether this CPU takes llama.cpp's repacked kernels (x86 AVX2, Arm dot products)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "").split()
    except OSError:
        return False
    return "avx2" in flags or "asimddp" in flags


def _repacked(name: str, shape: tuple[int, ...], qtype: str) -> bool:
    return (
        qtype in REPACKED_TYPES and name.startswith("blk.") and len(shape) == 2
        and shape[0] % 8 == 0
    )  # fmt: skip


def gguf_bytes(loaded: LoadedModel, llamacpp_type: str) -> tuple[int, int]:
    """(bytes of the GGUF llama.cpp runs for `loaded`, bytes of its tensors llama.cpp repacks
    on this CPU): the file where it exists, else what its export will hold (its tensors'
    planned sizes), without writing it."""
    kind = llamacpp_type
    if kind == "auto":
        kind = packaged_llamacpp_type(loaded.path) or "file"
    repacks = cpu_repacks()
    if kind == "file" and loaded.format == "gguf":
        reader = gguf.GGUFReader(str(loaded.path))
        repacked = sum(
            int(t.n_bytes) for t in reader.tensors
            if repacks and _repacked(t.name, tuple(int(x) for x in t.shape[::-1]), t.tensor_type.name)
        )  # fmt: skip
        return Path(loaded.path).stat().st_size, repacked
    out = "auto" if kind == "file" else kind
    plans = GGUFExport(loaded, out).plan()
    repacked = sum(
        p.nbytes for p in plans
        if repacks and _repacked(p.name, p.shape, gguf.GGMLQuantizationType(p.qtype).name)
    )  # fmt: skip
    return sum(p.nbytes for p in plans), repacked
