"""The MLX backend: Apple silicon's GPU through Metal, and MLX's CPU build elsewhere.

The models of `models/` in MLX (`models.llama_mlx`), driven by the shared engine like every
backend: one K/V pool per layer `[num_blocks, block_size, n_kv_heads, head_dim]` holding the
engine's blocks (`kernels.paged_attention_mlx`), written through the slot mapping and read
through block tables; copy-on-write copies blocks; truncate and release leave the pool to
the block manager, as on the torch backend. An INT checkpoint runs as stored: its packed
Linears map onto MLX affine quantization without re-quantizing (`quantize.export_mlx`).
Float models run in float32, bfloat16 or float16; a GGUF is dequantized on load.

Each step's graph is evaluated with `mx.async_eval`: the pool writes and the logits are
queued together and only the logits are waited for, as mlx-lm's generate loop does.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from edgellm.backends.base import kv_bytes_per_token
from edgellm.config import EngineConfig, kv_pool_blocks
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
    from edgellm.engine.sequence import Sequence

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


class MLXBackend:
    name = "mlx"

    def __init__(self, args: ModelArgs, weights: MLXWeights, config: EngineConfig):
        if mx is None:
            raise InvalidParameterError("the mlx backend needs MLX (pip install 'edgellm[mlx]')")
        dtype = getattr(mx, resolve_dtype(config.dtype))
        self.args = args
        self.block_size = config.block_size
        self.vocab_size = args.vocab_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        per_token = kv_bytes_per_token(
            args.num_hidden_layers, args.num_key_value_heads, args.head_dim,
            getattr(torch, resolve_dtype(config.dtype)),
        )  # fmt: skip
        self.num_blocks = kv_pool_blocks(config.kv_cache_mb, config.block_size, per_token)
        limit = min(
            config.max_model_len or args.max_position_embeddings, args.max_position_embeddings
        )
        self.max_model_len = min(limit, self.num_blocks * config.block_size)
        tensors = {}
        for name, t in weights.tensors.items():
            if t.dtype == torch.uint32:  # packed codes as they are
                tensors[name] = mx.array(t.view(torch.int32).numpy()).view(mx.uint32)
            else:  # floats (and scales/biases) in the compute dtype
                tensors[name] = mx.array(t.float().numpy()).astype(dtype)
        self.model = MLXModel(args, tensors, weights.groups, weights.bits)
        mx.eval(tensors)
        self.kv = MLXKVPool(args.num_hidden_layers, self.num_blocks, self.block_size,
                            args.num_key_value_heads, args.head_dim, dtype)  # fmt: skip
        self.dtype = dtype
        self.weights_bytes = sum(a.nbytes for a in tensors.values())

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
        return cls.build(loaded, config)

    def bind(self, uncache: Callable[[int], None]) -> None:
        pass  # K/V live in the block pool itself: whatever the cache keeps stays valid

    def block_cached(self, block_id: int) -> None:
        pass

    def block_evicted(self, block_id: int) -> None:
        pass

    def close(self) -> None:
        self.kv.close()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.kv.copy_blocks([s for s, _ in copies], [d for _, d in copies])

    def release(self, seq: Sequence) -> None:
        pass  # storage is the shared block pool; the block manager owns it

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        pass  # K/V past num_tokens is simply overwritten; the block manager trims the table

    def forward(self, batch: list[ScheduledSeq], all_logits: bool = False) -> torch.Tensor:
        ids, pos, slots, rows, q_lens, starts = [], [], [], [], [], []
        bs, total = self.block_size, 0
        for item in batch:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_tokens
            ids += item.input_ids()
            table = seq.block_table
            pos += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            first = total if all_logits else total + n - item.logit_rows
            rows += range(first, total + n)
            q_lens.append(n)
            starts.append(start)
            total += n
        attn = StepAttention(q_lens, starts, [item.seq.block_table for item in batch], bs)
        i32 = lambda xs: mx.array(np.asarray(xs, dtype=np.int32))  # noqa: E731
        logits = self.model(i32(ids), i32(pos), self.kv, i32(slots), attn, i32(rows))
        # queue the pool writes with the logits; only the logits are waited for
        mx.async_eval(logits, *self.kv.arrays)
        return torch.from_numpy(np.array(logits, copy=True))

    def describe(self) -> str:
        return describe()

