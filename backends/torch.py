"""The torch reference backend (CPU): paged K/V tensors per layer, our own model code."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from edgellm.backends.base import (
    HostSwap,
    PoolStorage,
    attention_plan,
    copy_pool_blocks,
    flatten_batch,
    kv_row_bytes,
    pool_geometry,
)
from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.kernels import cpu
from edgellm.kernels.paged_attention import AttentionMetadata
from edgellm.loaders.model import LoadedModel
from edgellm.models.fused import FusedModel
from edgellm.quantize.build import build_model
from edgellm.sysmem import trim_heap

if TYPE_CHECKING:
    from edgellm.engine.scheduler import ScheduledSeq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> str:
    """`EngineConfig.dtype` made concrete: "auto" is bfloat16 where the CPU multiplies bf16
    natively (AVX512-BF16, AMX, Arm BF16) and float32 elsewhere, where torch's bf16 matmul
    converts and runs several times slower than fp32 (measured on AVX2)."""
    if name != "auto":
        return name
    return cpu.auto_dtype()


def describe() -> str:
    """What the torch backend runs on this CPU (for `edgellm info`)."""
    dtype = resolve_dtype("auto")
    why = "native bf16 dot products" if cpu.native_bf16() else "no native bf16 dot products"
    path = "reference (EDGELLM_REFERENCE=1)" if cpu.reference_only() else "fused serving path"
    return (
        f"torch backend: dtype auto = {dtype} ({why}); {path}; kernels: {cpu.status()}; "
        f"{len(os.sched_getaffinity(0))} threads, one pinned per core. auto puts llama.cpp "
        "first: faster at one stream and up to ~32 concurrent requests; -b torch for heavier "
        "concurrency (README: the torch engine against vLLM's CPU build)"
    )


def kv_storage(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype: the model's float dtype, or int8 rows (codes + scale)."""
    if config.kv_cache_dtype == "int4":
        raise InvalidParameterError(
            "kv_cache_dtype int4 is on the llamacpp backend only (q4_0 K/V); "
            "the torch backend takes auto or int8"
        )
    return torch.int8 if config.kv_cache_dtype == "int8" else dtype


class TorchBackend(HostSwap, PoolStorage):
    name = "torch"

    def __init__(self, model: torch.nn.Module, config: EngineConfig):
        args = model.args
        self.block_size = config.block_size
        self.vocab_size = args.vocab_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        dtype = next(model.parameters()).dtype  # the embeddings': the model's float dtype
        kv_dtype = kv_storage(config, dtype)
        windows = attention_plan(args, config)
        per_token, self.num_blocks, self.max_model_len = pool_geometry(
            args, config, kv_dtype, windows
        )
        # the block manager frees blocks out of every layer's window (see BlockManager)
        self.attention_window = (windows.everywhere, windows.kept_sinks)
        row = (
            kv_row_bytes(args.head_dim, kv_dtype) // torch.empty((), dtype=kv_dtype).element_size()
        )
        # the serving form unless EDGELLM_REFERENCE=1 (the reference model runs as is)
        if not (cpu.reference_only() or isinstance(model, FusedModel)):
            model = FusedModel(model, self.max_model_len)
        for layer, w, s in zip(model.model.layers, windows.layers, windows.sinks, strict=True):
            attn = getattr(layer, "self_attn", layer)  # a FusedLayer holds them itself
            attn.window, attn.sinks = w, s
        self.model = model
        self.dtype = dtype
        shape = (self.num_blocks, config.block_size, args.num_key_value_heads, row)
        # [num_blocks, block_size, n_kv_heads, head_dim (+ 4 scale slots if int8)] per
        # layer, for K and V
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
            for _ in range(args.num_hidden_layers)
        ]
        # the pool is host memory already: swapping only when asked (tests, a memory cap)
        self.init_swap(config.swap_space_mb or 0, per_token)

    @classmethod
    def build(cls, loaded: LoadedModel, config: EngineConfig) -> TorchBackend:
        threads = config.threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        if threads <= len(os.sched_getaffinity(0)):  # one thread per core, none migrating
            cpu.bind_threads(sorted(os.sched_getaffinity(0))[:threads])
        model = build_model(loaded, DTYPES[resolve_dtype(config.dtype)])
        if not cpu.reference_only():  # fused here, so the unfused weights go before the pool
            dtype = next(model.parameters()).dtype
            _, _, max_len = pool_geometry(
                loaded.args, config, kv_storage(config, dtype), attention_plan(loaded.args, config)
            )
            model = FusedModel(model, max_len)
        trim_heap()  # the build's and the fusion's freed temporaries back to the OS
        return cls(model, config)

    def close(self) -> None:
        self.kv_caches = []
        self.close_swap()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_pool_blocks(self.kv_caches, copies)

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        inputs = prepare_inputs(batch, self.block_size, all_logits)
        return self.model(
            inputs["input_ids"],
            inputs["positions"],
            self.kv_caches,
            inputs["meta"],
            inputs["logits_indices"],
        )


def prepare_inputs(batch: list[ScheduledSeq], block_size: int, all_logits: bool = False) -> dict:
    """Flatten a scheduled batch into token ids, positions, slot mapping and block tables."""
    ids, pos, slots, rows, q_lens, starts = flatten_batch(batch, block_size, all_logits)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    ctx = [s + n for s, n in zip(starts, q_lens, strict=True)]
    width = max(len(item.seq.block_table) for item in batch)
    tables = torch.zeros(len(batch), width, dtype=torch.long)
    for b, item in enumerate(batch):
        # released window blocks (NULL_BLOCK) read block 0, masked like the padding
        tables[b, : len(item.seq.block_table)] = torch.tensor(item.seq.block_table).clamp_(min=0)
    meta = AttentionMetadata(torch.tensor(slots), qsl, ctx, tables)
    return {
        "input_ids": torch.tensor(ids),
        "positions": torch.tensor(pos),
        "meta": meta,
        "logits_indices": torch.tensor(rows, dtype=torch.long),
    }
