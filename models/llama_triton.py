"""The Llama family on our Triton kernels (the CUDA backend's model; the CPU interpreter runs
it too, which is how it is tested without a GPU).

Built from a reference `models.llama.Model`: the same weights, with
- q|k|v and gate|up fused into one projection each; projections are callables the
  backend makes (`Projection`: the W4A16 kernel for 4-bit layers, a dense matmul else);
- RMSNorm with the residual add in one kernel, RoPE + K/V cache write in one kernel,
  SiLU-and-mul in one kernel (`kernels/triton_fused.py`);
- paged attention: the split-KV decode kernel when every sequence decodes one token, the
  mixed kernel otherwise (`kernels/triton_attention.py`).
Everything a step needs sits in device tensors (`StepTensors`), so a decode step can be
captured in a CUDA graph and replayed with new contents.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from edgellm.kernels.paged_attention import AttentionMetadata, paged_attention
from edgellm.kernels.triton_attention import (
    HEAD_DIMS,
    kernel_takes,
    paged_attention_triton,
    paged_decode_triton,
)
from edgellm.kernels.triton_fused import rms_norm, rope_and_cache, silu_and_mul
from edgellm.models.llama import Model

# [T, in] -> [T, out]; the backend builds one per (fused) projection
Projection = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class StepTensors:
    """One step's inputs on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 (-1: padding, nothing written)
    block_tables: torch.Tensor  # [B, W] int32
    context_lens: torch.Tensor  # [B] int32 (0: padding row)
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    num_splits: int  # split-KV programs per sequence on decode-only steps
    logits_indices: torch.Tensor | None  # [N] rows that need logits; None: all
    meta: AttentionMetadata | None = None  # for the reference attention (`kernel_attention`)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class TritonLayer:
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    input_norm: torch.Tensor
    post_norm: torch.Tensor


class TritonModel:
    def __init__(
        self,
        model: Model,
        make_projection: Callable[[list[torch.nn.Module]], Projection],
        device: torch.device,
        dtype: torch.dtype,
        lm_head: Projection | None = None,  # None: the model's head, dense
    ):
        args = model.args
        self.args = args
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.eps = args.rms_norm_eps
        self.scale = args.head_dim**-0.5
        # each layer's attention window and sinks (the backend sets them; 0: the whole context)
        self.windows, self.sinks = args.layer_windows(), [0] * args.num_hidden_layers
        # head sizes the attention kernels cannot take run the torch reference instead
        self.kernel_attention = kernel_takes(args.head_dim)
        if not self.kernel_attention:
            warnings.warn(
                f"head_dim {args.head_dim} is outside the attention kernels' {HEAD_DIMS}: "
                "attention runs the torch reference (slower, no CUDA graphs)",
                stacklevel=2,
            )

        def vec(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=device, dtype=dtype).contiguous()

        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                TritonLayer(
                    make_projection([a.q_proj, a.k_proj, a.v_proj]),
                    make_projection([a.o_proj]),
                    make_projection([m.gate_proj, m.up_proj]),
                    make_projection([m.down_proj]),
                    vec(layer.input_layernorm.weight),
                    vec(layer.post_attention_layernorm.weight),
                )
            )
        self.embed = vec(model.model.embed_tokens.weight)
        self.norm = vec(model.model.norm.weight)
        self.lm_head = lm_head or make_projection([model.lm_head])
        self.inv_freq = model.inv_freq.detach().to(device=device, dtype=torch.float32)

    def __call__(
        self, step: StepTensors, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:  # [N, vocab] float32
        h = torch.nn.functional.embedding(step.input_ids, self.embed)
        residual = h.clone()
        x = rms_norm(h, self.layers[0].input_norm, self.eps)
        t = h.shape[0]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i:
                x = rms_norm(h, layer.input_norm, self.eps, residual)
            q = rope_and_cache(
                layer.qkv(x), step.positions, self.inv_freq, k_cache, v_cache,
                step.slot_mapping, self.n_heads,
            )  # fmt: skip
            o = self._attention(q, k_cache, v_cache, step, self.windows[i], self.sinks[i])
            h = layer.o(o.view(t, -1))
            x = rms_norm(h, layer.post_norm, self.eps, residual)
            h = layer.down(silu_and_mul(layer.gate_up(x)))
        if step.logits_indices is not None:
            h, residual = h[step.logits_indices], residual[step.logits_indices]
        return self.lm_head(rms_norm(h, self.norm, self.eps, residual)).float()

    def _attention(self, q, k_cache, v_cache, step: StepTensors, window: int, sinks: int):
        if not self.kernel_attention:
            return paged_attention(q, k_cache, v_cache, step.meta, self.scale, window, sinks)
        if step.decode_only:
            return paged_decode_triton(
                q, k_cache, v_cache, step.block_tables, step.context_lens, self.scale,
                step.num_splits, window=window, sinks=sinks,
            )  # fmt: skip
        return paged_attention_triton(
            q, k_cache, v_cache, step.block_tables, step.context_lens, step.query_start_loc,
            step.max_query_len, self.scale, window=window, sinks=sinks,
        )  # fmt: skip
