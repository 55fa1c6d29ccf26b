"""The CUDA backend: our models on our Triton kernels, under the shared engine.

- Linears: 4-bit layers run as stored through the W4A16 kernel (`kernels/triton_w4a16.py`),
  q|k|v and gate|up fused into one launch each; float layers (and INT widths the kernel
  does not take, with a warning) run as dense matmuls in the model dtype (bf16 by default).
  `EngineConfig.quantize_lm_head` quantizes the LM head to INT4 (group 128, round to
  nearest) at load: on small models with tied embeddings it is the largest weight read per
  token (SmolLM2-135M: 28 of 135 M parameters).
- K/V: one pool per layer on the device, the engine's blocks (`models/llama_triton.py`
  writes and reads it through the slot mapping and block tables).
- Decode-only steps of up to `max_num_seqs` sequences replay CUDA graphs, captured once
  per padded batch size (1, 2, 4, 8, 16, 32, ...) on first use.
- Offloading: with `swap_space_mb`, a preempted sequence's blocks can be copied to pinned
  host memory and back (`HostSwap`) instead of being recomputed; the scheduler picks by
  measured cost.

`TRITON_INTERPRET=1` runs the same code on the CPU (device "cpu", float32): that is how it
is tested on machines without a GPU. `build` (what `-b cuda` calls) requires CUDA.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from edgellm.backends.base import (
    HostSwap,
    PoolStorage,
    attention_plan,
    copy_pool_blocks,
    flatten_batch,
    pool_geometry,
)
from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.kernels.paged_attention import AttentionMetadata
from edgellm.loaders.model import LoadedModel
from edgellm.quantize.build import build_model
from edgellm.quantize.format import QuantConfig, pack_int32, unpack_int32
from edgellm.quantize.linear import QuantLinear
from edgellm.quantize.rtn import quantize_rtn

try:  # Triton is optional: without it the backend is simply unavailable
    from edgellm.kernels.triton_attention import TILE_N, decode_splits
    from edgellm.kernels.triton_w4a16 import W4A16Weight, prepare_w4a16, w4a16_matmul
    from edgellm.models.llama_triton import StepTensors, TritonModel

    TRITON_ERROR = None
except ImportError as e:  # pragma: no cover - triton is part of the dev install
    TRITON_ERROR = str(e)

if TYPE_CHECKING:
    from edgellm.engine.scheduler import ScheduledSeq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_SWAP_MB = 2048  # pinned host memory for swapped-out K/V when swap_space_mb is None


def available() -> bool:
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why `-b cuda` cannot run here, or None."""
    if importlib.util.find_spec("triton") is None or TRITON_ERROR is not None:
        return f"Triton is not installed ({TRITON_ERROR or 'pip install triton'})"
    if not torch.cuda.is_available():
        build = torch.version.cuda or "CPU-only"
        return f"no CUDA device visible to torch {torch.__version__} ({build} build)"
    return None


def describe() -> str:
    why = unavailable_reason()
    if why:
        return f"cuda backend: unavailable: {why}"
    name = torch.cuda.get_device_name()
    return (
        f"cuda backend: {name}; W4A16 + paged attention in Triton; dtype auto = bfloat16; "
        "CUDA graphs for decode"
    )


class QuantProjection:
    """x @ W.T (+ bias) through the W4A16 kernel."""

    def __init__(self, weight: W4A16Weight, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return w4a16_matmul(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class DenseProjection:
    """x @ W.T (+ bias) as one dense matmul (cuBLAS)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


def _w4(module: QuantLinear, device, scale_dtype) -> W4A16Weight:
    zp = module.weight_zero_point
    zeros = None if zp is None else unpack_int32(zp, 4, module.out_features, dim=0)
    return prepare_w4a16(
        module.weight_packed, module.weight_scale, zeros, module.in_features, device, scale_dtype
    )


def _kernel_takes(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear) and module.qconfig.bits == 4


def _dense(module: nn.Module) -> torch.Tensor:
    if isinstance(module, QuantLinear):
        return module.dequantize()
    return module.weight.detach()


class CUDABackend(HostSwap, PoolStorage):
    name = "cuda"

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        device: torch.device | str = "cuda",
        dtype: torch.dtype | None = None,
    ):
        if TRITON_ERROR is not None:
            raise InvalidParameterError(f"the cuda backend needs Triton: {TRITON_ERROR}")
        if config.kv_cache_dtype == "int4":
            raise InvalidParameterError(
                "kv_cache_dtype int4 is on the llamacpp backend only (q4_0 K/V); the cuda "
                "backend takes auto or int8"
            )
        args = model.args
        self.device = torch.device(device)
        self.dtype = dtype or next(model.parameters()).dtype
        self.block_size = config.block_size
        self.vocab_size = args.vocab_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.fallbacks: list[str] = []  # layers not on our kernels, and why
        windows = attention_plan(args, config)
        # K/V in the compute dtype, or int8 rows: head_dim codes + the row's fp32 scale
        kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else self.dtype
        per_token, self.num_blocks, self.max_model_len = pool_geometry(
            args, config, kv_dtype, windows, backend="cuda"
        )
        self.attention_window = (windows.everywhere, windows.kept_sinks)
        self.table_width = -(-self.max_model_len // self.block_size)
        row = args.head_dim + (4 if kv_dtype == torch.int8 else 0)
        shape = (self.num_blocks, self.block_size, args.num_key_value_heads, row)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
                torch.zeros(shape, dtype=kv_dtype, device=self.device),
            )
            for _ in range(args.num_hidden_layers)
        ]
        self.n_kv_heads = args.num_key_value_heads
        head = self._quantized_head(model) if config.quantize_lm_head else None
        self.model = TritonModel(model, self._projection, self.device, self.dtype, head)
        self.model.windows, self.model.sinks = windows.layers, windows.sinks
        self.projection_bytes = (
            sum(
                p.nbytes
                for layer in self.model.layers
                for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
            + self.model.lm_head.nbytes
        )
        self.use_graphs = (
            config.cuda_graphs and self.device.type == "cuda" and self.model.kernel_attention
        )
        self.graphs: dict[int, _DecodeGraph] = {}
        self._graph_pool = None
        swap_mb = DEFAULT_SWAP_MB if config.swap_space_mb is None else config.swap_space_mb
        self.init_swap(swap_mb, per_token)

    @classmethod
    def build(cls, loaded: LoadedModel, config: EngineConfig) -> CUDABackend:
        why = unavailable_reason()
        if why:
            raise InvalidParameterError(f"-b cuda cannot run here: {why}")
        name = "bfloat16" if config.dtype == "auto" else config.dtype
        model = build_model(loaded, DTYPES[name])
        return cls(model, config, "cuda", DTYPES[name])

    # ---- weights ---------------------------------------------------------------------------
    def _projection(self, modules: list[nn.Module]):
        biases = [getattr(m, "bias", None) for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b.detach() if b is not None else torch.zeros(m.out_features)
                    for b, m in zip(biases, modules, strict=True)
                ]
            ).to(device=self.device, dtype=torch.float32)
        same = len({(m.in_features, m.qconfig) for m in modules if isinstance(m, QuantLinear)}) == 1
        if all(_kernel_takes(m) for m in modules) and same:
            weight = W4A16Weight.concat([_w4(m, self.device, torch.float32) for m in modules])
            return QuantProjection(weight, bias)
        for m in modules:
            if isinstance(m, QuantLinear) and not _kernel_takes(m):
                why = f"{m.extra_repr()}: not 4-bit, dequantized to dense"
                self.fallbacks.append(why)
                warnings.warn(f"the W4A16 kernel cannot take {why}", stacklevel=2)
        weight = torch.cat([_dense(m).float() for m in modules])
        return DenseProjection(
            weight.to(device=self.device, dtype=self.dtype),
            None if bias is None else bias.to(self.dtype),
        )

    def _quantized_head(self, model: nn.Module) -> QuantProjection:
        w = model.lm_head.weight.detach().float()
        group = 128 if w.shape[1] % 128 == 0 else 64 if w.shape[1] % 64 == 0 else -1
        qw = quantize_rtn(w, QuantConfig(4, group, True))
        weight = prepare_w4a16(
            pack_int32(qw.q, 4), qw.scale, None, w.shape[1], self.device, torch.float32
        )
        return QuantProjection(weight, None)

    def describe_weights(self) -> str:
        mb = self.projection_bytes / 2**20
        return f"{mb:.1f} MiB of projections on {self.device}" + (
            f"; {len(self.fallbacks)} dense fallbacks" if self.fallbacks else ""
        )

    # ---- the step --------------------------------------------------------------------------
    def close(self) -> None:
        self.graphs.clear()
        self.kv_caches = []
        self.close_swap()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_pool_blocks(self.kv_caches, copies)

    @torch.inference_mode()
    def forward(self, batch: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        ids, pos, slots, rows, q_lens, starts = flatten_batch(batch, self.block_size, all_logits)
        ctx = [s + n for s, n in zip(starts, q_lens, strict=True)]
        tables = [item.seq.block_table for item in batch]
        graphable = max(q_lens) == 1 and len(rows) == len(batch)  # one token, one logit row each
        if self.use_graphs and graphable and len(batch) <= min(self.max_num_seqs, 256):
            return self._graph_step(ids, pos, slots, tables, ctx)
        step = self._step_tensors(ids, pos, slots, tables, ctx, q_lens, rows)
        return self.model(step, self.kv_caches).cpu()

    def _step_tensors(self, ids, pos, slots, tables, ctx, q_lens, rows) -> StepTensors:
        dev = self.device
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for b, t in enumerate(tables):
            bt[b, : len(t)] = torch.tensor(t, dtype=torch.int32).clamp_(min=0)  # freed: masked
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        total = qsl[-1]
        splits = decode_splits(max(ctx), len(tables), self.n_kv_heads, dev.type == "cuda")
        meta = None
        if not self.model.kernel_attention:  # the torch reference reads host-side lengths
            meta = AttentionMetadata(
                torch.tensor(slots, device=dev), qsl, ctx, bt.to(device=dev, dtype=torch.long)
            )
        return StepTensors(
            torch.tensor(ids, device=dev),
            torch.tensor(pos, device=dev),
            torch.tensor(slots, device=dev),
            bt.to(dev),
            torch.tensor(ctx, dtype=torch.int32, device=dev),
            torch.tensor(qsl, dtype=torch.int32, device=dev),
            max(q_lens),
            splits,
            None if len(rows) == total else torch.tensor(rows, dtype=torch.long, device=dev),
            meta,
        )

    def _graph_step(self, ids, pos, slots, tables, ctx) -> torch.Tensor:
        b = len(ids)
        size = next(s for s in GRAPH_SIZES if s >= b)
        graph = self.graphs.get(size)
        if graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = _DecodeGraph(self, size, self._graph_pool)
            self.graphs[size] = graph
        return graph.run(ids, pos, slots, tables, ctx)


class _DecodeGraph:
    """One decode step of `size` sequences captured as a CUDA graph over static buffers;
    smaller batches are padded (context 0, slot -1: nothing written, zeros computed)."""

    def __init__(self, backend: CUDABackend, size: int, pool):
        dev = backend.device
        self.size = size
        self.host = torch.zeros((4, size), dtype=torch.int64).pin_memory()  # ids, pos, slot, ctx
        self.host_tables = torch.zeros((size, backend.table_width), dtype=torch.int32).pin_memory()
        splits = decode_splits(backend.max_model_len, size, backend.n_kv_heads, True)
        splits = min(splits, -(-backend.max_model_len // TILE_N))
        self.step = StepTensors(
            torch.zeros(size, dtype=torch.int64, device=dev),
            torch.zeros(size, dtype=torch.int64, device=dev),
            torch.full((size,), -1, dtype=torch.int64, device=dev),
            torch.zeros((size, backend.table_width), dtype=torch.int32, device=dev),
            torch.zeros(size, dtype=torch.int32, device=dev),
            torch.arange(size + 1, dtype=torch.int32, device=dev),
            1,
            splits,
            None,
        )
        self.ctx64 = torch.zeros(size, dtype=torch.int64, device=dev)
        model, kv = backend.model, backend.kv_caches
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up: compile the kernels outside the capture
            model(self.step, kv)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = model(self.step, kv)

    def run(self, ids, pos, slots, tables, ctx) -> torch.Tensor:
        b = len(ids)
        h = self.host
        h.zero_()
        h[2].fill_(-1)
        h[0, :b] = torch.tensor(ids)
        h[1, :b] = torch.tensor(pos)
        h[2, :b] = torch.tensor(slots)
        h[3, :b] = torch.tensor(ctx)
        self.host_tables.zero_()
        for i, t in enumerate(tables):
            self.host_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32).clamp_(min=0)
        s = self.step
        s.input_ids.copy_(h[0], non_blocking=True)
        s.positions.copy_(h[1], non_blocking=True)
        s.slot_mapping.copy_(h[2], non_blocking=True)
        self.ctx64.copy_(h[3], non_blocking=True)
        s.context_lens.copy_(self.ctx64)
        s.block_tables.copy_(self.host_tables, non_blocking=True)
        self.graph.replay()
        return self.logits[:b].cpu()
