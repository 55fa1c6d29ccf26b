"""The MLX backend: Apple silicon's GPU through Metal, and MLX's CPU build elsewhere.

The models of `models/` in MLX (`models.llama_mlx`), driven by the shared engine like every
backend: one K/V pool per layer `[num_blocks, block_size, n_kv_heads, head_dim]` holding the
engine's blocks (`kernels.paged_attention_mlx`), written through the slot mapping and read
through block tables; copy-on-write copies blocks; truncate and release leave the pool to
the block manager, as on the torch backend. An INT checkpoint runs as stored: its packed
Linears map onto MLX affine quantization without re-quantizing (`quantize.export_mlx`).
Float models run in float32, bfloat16 or float16; a GGUF is dequantized on load.

Each step's graph is evaluated with `mx.async_eval`: the pool writes and the logits are
queued together and only the logits are waited for; a step of plain-greedy decodes also
queues the next one on its lazy argmax before waiting (`_run_ahead`), as mlx-lm's generate
loop does, and the engine's next step uses it when it is exactly that step.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from edgellm.backends.base import (
    PoolStorage,
    attention_plan,
    flatten_batch,
    pool_geometry,
)
from edgellm.config import EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.kernels.paged_attention_mlx import MLXKVPool, StepAttention
from edgellm.loaders.model import LoadedModel
from edgellm.loaders.weights import DictSource
from edgellm.models.llama import ModelArgs
from edgellm.models.llama_mlx import MLXModel
from edgellm.quantize.export_mlx import MLXWeights, mlx_weights

try:  # optional: `available()` says when it cannot run
    import mlx.core as mx
except ImportError:  # pragma: no cover - exercised where MLX is not installed
    mx = None

if TYPE_CHECKING:
    from edgellm.engine.scheduler import ScheduledSeq

DTYPES = ("float32", "bfloat16", "float16")


def available() -> bool:
    return mx is not None


def apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def on_gpu() -> bool:
    return mx is not None and mx.default_device() == mx.gpu


def resolve_dtype(name: str) -> str:
    """"auto": bfloat16 on the GPU (Metal), float32 on the CPU, where MLX's CPU build
    multiplies bf16 and fp16 several times slower than float32 (measured on x86)."""
    if name != "auto":
        return name
    return "bfloat16" if on_gpu() else "float32"


def describe() -> str:
    """What the MLX backend runs here (for `edgellm info`)."""
    if mx is None:
        return "mlx backend: MLX is not installed (make setup installs it where it has wheels)"
    device = "GPU (Metal)" if on_gpu() else "CPU"
    auto = "auto picks it first on Apple silicon" if apple_silicon() else "-b mlx to use it"
    return f"mlx backend: MLX {mx.__version__} on the {device}, dtype auto = {resolve_dtype('auto')}; {auto}"


@dataclass(slots=True)
class _Ahead:
    """A decode step queued before the engine asked for it (`MLXBackend._run_ahead`)."""

    seqs: list  # the sequences, in batch order
    starts: list[int]  # the position each computes
    tokens: object  # mx int32 [B]: the greedy tokens it assumed
    logits: object  # mx [B, vocab]

    def matches(self, batch: list[ScheduledSeq]) -> bool:
        if len(batch) != len(self.seqs):
            return False
        for item, seq, start in zip(batch, self.seqs, self.starts, strict=True):
            if (item.seq is not seq or item.num_tokens != 1 or item.logit_rows != 1
                    or seq.num_computed_tokens != start or seq.spec_token_ids):  # fmt: skip
                return False
        return [item.input_ids()[0] for item in batch] == np.array(self.tokens).tolist()


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_linears(tensors: dict, bits: int) -> tuple[dict[str, int], int]:
    """`mx.quantize` every decoder Linear's float weight in place (affine, group 64, or the
    largest of 128/32 that divides its inputs); embeddings and the LM head stay float."""
    groups = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        w = tensors[name]
        group = next((g for g in (64, 128, 32) if w.shape[1] % g == 0), None)
        if group is None:
            raise InvalidParameterError(
                f"{name}: {w.shape[1]} inputs take no MLX group size (32, 64, 128)"
            )
        prefix = name.removesuffix(".weight")
        q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        tensors |= {name: q, f"{prefix}.scales": scales, f"{prefix}.biases": biases}
        groups[prefix] = group
    return groups, bits


class MLXBackend(PoolStorage):
    name = "mlx"
    run_ahead = True  # pipelining of plain-greedy decode steps (`_run_ahead`); tests turn it off

    def __init__(self, args: ModelArgs, weights: MLXWeights, config: EngineConfig):
        if mx is None:
            raise InvalidParameterError("the mlx backend needs MLX (pip install 'edgellm[mlx]')")
        if config.kv_cache_dtype == "int4":
            raise InvalidParameterError(
                "kv_cache_dtype int4 is on the llamacpp backend only (q4_0 K/V); the mlx "
                "backend takes auto or int8"
            )
        dtype = getattr(mx, resolve_dtype(config.dtype))
        # K/V in the compute dtype, or int8 rows (codes + fp32 scale, as the torch backend's)
        kv_dtype = mx.int8 if config.kv_cache_dtype == "int8" else dtype
        kv_torch = torch.int8 if config.kv_cache_dtype == "int8" else getattr(
            torch, resolve_dtype(config.dtype)
        )
        self.args = args
        self.block_size = config.block_size
        self.vocab_size = args.vocab_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        windows = attention_plan(args, config)
        _, self.num_blocks, self.max_model_len = pool_geometry(
            args, config, kv_torch, windows, backend="mlx"
        )
        self.attention_window = (windows.everywhere, windows.kept_sinks)
        tensors = {}
        for name, t in weights.tensors.items():
            if t.dtype == torch.uint32:  # packed codes as they are
                tensors[name] = mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
            else:  # floats (and scales/biases) in the compute dtype
                tensors[name] = mx.array(t.float().numpy()).astype(dtype)
        groups, bits = weights.groups, weights.bits
        if config.mlx_quantize != "off" and bits is None:
            groups, bits = quantize_linears(tensors, int(config.mlx_quantize[1:]))
        self.model = MLXModel(args, tensors, groups, bits)
        for layer, w, s in zip(self.model.layers, windows.layers, windows.sinks, strict=True):
            layer.window, layer.sinks = w, s
        mx.eval(tensors)
        self.kv = MLXKVPool(args.num_hidden_layers, self.num_blocks, self.block_size,
                            args.num_key_value_heads, args.head_dim, kv_dtype)  # fmt: skip
        self.dtype = dtype
        self.weights_bytes = sum(a.nbytes for a in tensors.values())
        self._ahead: _Ahead | None = None

    @classmethod
    def build(cls, loaded: LoadedModel, config: EngineConfig) -> MLXBackend:
        # torch only samples from the logits here: one thread. Its OpenMP pool, idle while MLX
        # computes, took ~8 ms per step to wake for a 49k-entry check (measured, SmolLM2)
        torch.set_num_threads(1)
        return cls(loaded.args, mlx_weights(loaded, scale_dtype="float32"), config)

    @classmethod
    def from_torch(cls, model: torch.nn.Module, config: EngineConfig) -> MLXBackend:
        """From a float torch model of `models/` (tests: the same weights on every backend)."""
        state = {k: v.detach() for k, v in model.state_dict().items()}
        loaded = LoadedModel(None, "hf", model.args, DictSource(state), None, None)
        return cls(model.args, mlx_weights(loaded, scale_dtype="float32"), config)

    def close(self) -> None:
        self._ahead = None
        self.kv.close()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:  # (queued after any step run ahead: the pool's writes stay in order)
            self.kv.copy_blocks([s for s, _ in copies], [d for _, d in copies])

    def forward(self, batch: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not all_logits and ahead.matches(batch):
            logits = ahead.logits  # computed while the engine sampled the previous step
        else:
            logits = self._logits(batch, all_logits)
        mx.async_eval(logits, *self.kv.arrays)  # queue the pool writes with the logits
        if self.run_ahead and not all_logits:
            self._ahead = self._run_ahead(batch, logits)
        return torch.from_numpy(np.array(logits, copy=True))  # waits for the logits only

    def _logits(self, batch: list[ScheduledSeq], all_logits: bool):
        flat = flatten_batch(batch, self.block_size, all_logits)
        return self._model(*flat, [item.seq.block_table for item in batch])

    def _model(self, ids, pos, slots, rows, q_lens, starts, tables):
        attn = StepAttention(q_lens, starts, tables, self.block_size)
        i32 = lambda xs: xs if isinstance(xs, mx.array) else mx.array(np.asarray(xs, np.int32))  # noqa: E731
        return self.model(i32(ids), i32(pos), self.kv, i32(slots), attn, i32(rows))

    def _run_ahead(self, batch: list[ScheduledSeq], logits) -> _Ahead | None:
        """mlx-lm's pipelining under the engine: for a step of plain-greedy decodes, queue the
        next step on the lazy argmax tokens before this step's logits are waited for, so that
        building and running it overlaps the engine's sampling and scheduling. Used only when
        the next step is exactly that (same sequences, one token each, the predicted tokens:
        `_Ahead.matches`); otherwise it is dropped. Its one K/V write per sequence goes to the
        slot after the sequence's last token, in the block that token was just written to (the
        sequence's own, not full, so never cached): a position no one has computed, which the
        real next step overwrites."""
        bs = self.block_size
        if not batch or len(batch) > self.max_num_batched_tokens:
            return None
        nxt = []
        for item in batch:
            seq = item.seq
            p = seq.num_computed_tokens  # this step's token
            if (item.num_tokens != 1 or item.logit_rows != 1 or seq.spec_token_ids
                    or not seq.params.plain_greedy or (p + 1) % bs == 0
                    or len(seq.output_ids) + 2 > seq.params.max_tokens):  # fmt: skip
                return None
            nxt.append(p + 1)
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        tables = [item.seq.block_table for item in batch]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, nxt, strict=True)]
        n = len(batch)
        ahead = self._model(tokens, nxt, slots, list(range(n)), [1] * n, nxt, tables)
        mx.async_eval(ahead, tokens, *self.kv.arrays)
        return _Ahead([item.seq for item in batch], nxt, tokens, ahead)

    def describe(self) -> str:
        return describe()

