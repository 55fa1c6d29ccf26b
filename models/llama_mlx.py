"""The Llama family (Llama, Mistral, Qwen2) in MLX: the MLX backend's twin of `models.llama`.

The same flattened-batch forward as the torch model: every token of every sequence in a
step is one row, K/V go through the paged pool (`kernels.paged_attention_mlx`). Weights
arrive in mlx-lm's layout (`quantize.export_mlx`): a quantized Linear runs as stored through
`mx.quantized_matmul`. q/k/v and gate/up are fused into one matmul each (their rows
concatenated once at load: packed codes, scales and biases alike), RMSNorm and RoPE are
MLX's fused kernels. Positions are per row, so chunks, decodes and verifies mix freely.
"""

from __future__ import annotations

import numpy as np

from edgellm.kernels.paged_attention_mlx import MLXKVPool, StepAttention
from edgellm.models.llama import ModelArgs, rope_inv_freq

try:  # optional: the MLX backend says when it cannot run
    import mlx.core as mx
except ImportError:  # pragma: no cover - exercised where MLX is not installed
    mx = None


class Linear:
    """y = x @ W.T + b, W float or MLX affine-quantized (weight, scales, biases)."""

    __slots__ = ("weight", "scales", "biases", "bias", "group_size", "bits")

    def __init__(self, weight, scales=None, biases=None, bias=None, group_size=0, bits=0):
        self.weight, self.scales, self.biases, self.bias = weight, scales, biases, bias
        self.group_size, self.bits = group_size, bits

    @classmethod
    def from_tensors(cls, t: dict, prefix: str, groups: dict, bits: int | None) -> Linear:
        bias = t.get(f"{prefix}.bias")
        if prefix in groups:
            return cls(t[f"{prefix}.weight"], t[f"{prefix}.scales"], t[f"{prefix}.biases"], bias,
                       groups[prefix], bits)  # fmt: skip
        return cls(t[f"{prefix}.weight"], bias=bias)

    def __call__(self, x):
        if self.scales is None:
            y = x @ self.weight.T
        else:
            y = mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                    group_size=self.group_size, bits=self.bits)  # fmt: skip
        return y if self.bias is None else y + self.bias

    @classmethod
    def fuse(cls, parts: list[Linear]) -> Linear | None:
        """One Linear whose output is the parts' outputs side by side; None when they cannot
        share one matmul (float and quantized mixed, different group sizes)."""
        first = parts[0]
        if any((p.scales is None) != (first.scales is None) or p.group_size != first.group_size
               for p in parts) or len({p.bias is None for p in parts}) > 1:  # fmt: skip
            return None
        cat = lambda xs: None if xs[0] is None else mx.concatenate(xs, axis=0)  # noqa: E731
        return cls(
            cat([p.weight for p in parts]), cat([p.scales for p in parts]),
            cat([p.biases for p in parts]), cat([p.bias for p in parts]), first.group_size,
            first.bits,
        )  # fmt: skip


class DecoderLayer:
    def __init__(self, args: ModelArgs, t: dict, prefix: str, groups: dict, bits):
        lin = lambda name: Linear.from_tensors(t, prefix + name, groups, bits)  # noqa: E731
        q, k, v = lin("self_attn.q_proj"), lin("self_attn.k_proj"), lin("self_attn.v_proj")
        gate, up = lin("mlp.gate_proj"), lin("mlp.up_proj")
        self.qkv = Linear.fuse([q, k, v])
        self.qkv_parts = None if self.qkv else (q, k, v)
        self.gate_up = Linear.fuse([gate, up])
        self.gate_up_parts = None if self.gate_up else (gate, up)
        self.o_proj, self.down_proj = lin("self_attn.o_proj"), lin("mlp.down_proj")
        self.input_norm = t[prefix + "input_layernorm.weight"]
        self.post_norm = t[prefix + "post_attention_layernorm.weight"]
        self.eps = args.rms_norm_eps
        self.n_heads, self.n_kv, self.head_dim = (
            args.num_attention_heads, args.num_key_value_heads, args.head_dim,
        )  # fmt: skip
        self.scale = args.head_dim**-0.5
        self.window, self.sinks = 0, 0  # attention window and sinks (the backend sets them)

    def __call__(self, h, rope, kv: MLXKVPool, i: int, slots, attn: StepAttention):
        t = h.shape[0]
        x = mx.fast.rms_norm(h, self.input_norm, self.eps)
        hq, hk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
            q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
        else:
            q, k, v = (p(x) for p in self.qkv_parts)
        q = rope(q.reshape(t, self.n_heads, 1, self.head_dim))[:, :, 0]
        k = rope(k.reshape(t, self.n_kv, 1, self.head_dim))[:, :, 0]
        kv.write(i, k, v.reshape(t, self.n_kv, self.head_dim), slots)
        h = h + self.o_proj(attn(q, kv.k[i], kv.v[i], self.scale, self.window, self.sinks))
        x = mx.fast.rms_norm(h, self.post_norm, self.eps)
        if self.gate_up is not None:
            gu = self.gate_up(x)
            gate, up = gu[:, : gu.shape[1] // 2], gu[:, gu.shape[1] // 2 :]
        else:
            gate, up = (p(x) for p in self.gate_up_parts)
        return h + self.down_proj(gate * mx.sigmoid(gate) * up)


class MLXModel:
    """Causal LM over a flattened batch with a paged KV pool, in MLX."""

    def __init__(self, args: ModelArgs, tensors: dict, groups: dict, bits: int | None):
        self.args = args
        self.embed = tensors["model.embed_tokens.weight"]
        self.layers = [
            DecoderLayer(args, tensors, f"model.layers.{i}.", groups, bits)
            for i in range(args.num_hidden_layers)
        ]
        self.norm = tensors["model.norm.weight"]
        head = "lm_head.weight" if "lm_head.weight" in tensors else None
        self.lm_head = Linear.from_tensors(tensors, "lm_head", groups, bits) if head else None
        # MLX's rope takes the wavelengths (1 / inverse frequency), scaling already applied
        inv = rope_inv_freq(args).double().numpy()
        self.rope_freqs = mx.array((1.0 / inv).astype(np.float32))

    def __call__(self, ids, positions, kv: MLXKVPool, slots, attn: StepAttention, rows):
        """ids, positions, slots [T] int32; rows [N]: the rows that need logits -> [N, vocab]."""
        d = self.args.head_dim

        def rope(x):  # [T, heads, 1, D], one position per row
            return mx.fast.rope(x, d, traditional=False, base=None, scale=1.0, offset=positions,
                                freqs=self.rope_freqs)  # fmt: skip

        h = self.embed[ids]
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, kv, i, slots, attn)
        h = mx.fast.rms_norm(h[rows], self.norm, self.args.rms_norm_eps)
        logits = h @ self.embed.T if self.lm_head is None else self.lm_head(h)
        return logits.astype(mx.float32)
