"""Llama family (Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2/2.5) in torch.

One implementation; what differs between architectures is data (`FAMILY`).
Tokens of all sequences in a step are flattened into one `[T, ...]` batch and
attention reads/writes K/V through paged blocks (see `kernels.paged_attention`).
Module and parameter names follow Hugging Face so HF checkpoints load as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from edgellm.errors import UnsupportedArchitectureError
from edgellm.kernels.paged_attention import AttentionMetadata, paged_attention, write_kv

# Per-architecture facts that HF configs leave implicit. `gguf`: llama.cpp's
# general.architecture, and whether its converter permutes q/k rows (interleaved RoPE).
FAMILY: dict[str, dict] = {
    "llama": {"qkv_bias": False, "gguf": ("llama", True)},
    "mistral": {"qkv_bias": False, "gguf": ("llama", True)},
    "qwen2": {"qkv_bias": True, "gguf": ("qwen2", False)},
}

# llama.cpp tensor names -> HF names: per decoder layer (blk.{i}.*), and global
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# AWQ scale groups: (op before the linears that absorbs 1/s, linears sharing its output,
# module whose output measures the loss or None for the linears'); paths within a layer
AWQ_SCALE_GROUPS: list[tuple[str, list[str], str | None]] = [
    # q and k act through the attention scores: judged by the attention's output (as AutoAWQ
    # and llm-compressor do) where the caller gives whole sequences, else by q, k, v's outputs
    (
        "input_layernorm",
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "self_attn",
    ),
    # attention mixes v per channel, so v's rows can absorb 1/s when each o input is one v
    # output (no GQA); checked at run time from the shapes
    ("self_attn.v_proj", ["self_attn.o_proj"], None),
    ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp"),
    ("mlp.up_proj", ["mlp.down_proj"], None),
]
# inspected modules that mix tokens: scored on whole calibration sequences (awq.SequenceProbe)
AWQ_SEQUENCE_MODULES = ("self_attn",)


# Linear layers of a decoder layer in the order data flows through them; each stage's
# inputs depend on the stages before it (GPTQ quantizes stage by stage).
QUANT_STAGES: list[list[str]] = [
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    ["self_attn.o_proj"],
    ["mlp.gate_proj", "mlp.up_proj"],
    ["mlp.down_proj"],
]


@dataclass(slots=True)
class ModelArgs:
    """Hyper-parameters, built from an HF config.json or from GGUF metadata."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # sliding-window attention: a layer of type "sliding_attention" lets the query at
    # position p see keys p - sliding_window < k <= p (HF's rule); None: every layer full
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.rms_norm_eps, self.rope_theta = float(self.rms_norm_eps), float(self.rope_theta)
        if self.model_type not in FAMILY:
            raise UnsupportedArchitectureError(f"unsupported architecture {self.model_type!r}")
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedArchitectureError(
                f"{self.num_attention_heads} heads are not a multiple of {self.num_key_value_heads} KV heads"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                "full_attention", "sliding_attention"
            }:
                raise UnsupportedArchitectureError(
                    f"layer_types must name full_attention or sliding_attention for each of the "
                    f"{self.num_hidden_layers} layers, got {self.layer_types!r}"
                )
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise UnsupportedArchitectureError("sliding_attention layers need a sliding_window")

    def layer_windows(self) -> list[int]:
        """Each layer's attention window in tokens (0: the whole context)."""
        if not self.sliding_window:
            return [0] * self.num_hidden_layers
        types = self.layer_types or ["sliding_attention"] * self.num_hidden_layers
        return [self.sliding_window if t == "sliding_attention" else 0 for t in types]

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelArgs:
        """Build from a config.json dict; unknown keys are ignored. Trusts the values:
        loaders check a file's with `edgellm.loaders.validate` first."""
        return cls(**hf_fields(config))

    def to_hf_config(self) -> dict:
        """The config.json transformers expects for this model."""
        arch = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
        }
        cfg = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.model_type == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        windows = self.layer_windows()
        if self.model_type == "mistral":
            cfg["sliding_window"] = self.sliding_window if all(windows) else None
        if self.model_type == "qwen2":
            # Qwen2: layers from max_window_layers on slide (when use_sliding_window)
            first = next((i for i, w in enumerate(windows) if w), len(windows))
            cfg |= {
                "use_sliding_window": any(windows),
                "sliding_window": self.sliding_window if any(windows) else None,
                "max_window_layers": first,
            }
        if any(windows):
            cfg["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
        return cfg


def hf_fields(config: dict) -> dict:
    """ModelArgs fields from a config.json dict, values as stored (not yet checked)."""
    model_type = config.get("model_type", "")
    if not isinstance(model_type, str) or model_type not in FAMILY:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r} (supported: {', '.join(FAMILY)})"
        )
    names = {f.name for f in fields(ModelArgs)} - {"extra"}
    kw = {k: v for k, v in config.items() if k in names}
    if kw.get("num_key_value_heads") is None:  # HF's default: no grouped-query attention
        kw["num_key_value_heads"] = config.get("num_attention_heads")
    kw.update(_hf_rope(config))
    kw["qkv_bias"] = config.get("attention_bias", FAMILY[model_type]["qkv_bias"])
    if kw.get("head_dim") is None:
        kw.pop("head_dim", None)
    kw.update(_hf_windows(model_type, config))
    return kw


def _hf_windows(model_type: str, config: dict) -> dict:
    """sliding_window / layer_types as transformers reads them: Mistral slides in every layer
    when `sliding_window` is set; Qwen2 only with `use_sliding_window`, from layer
    `max_window_layers` on; Llama never. An explicit `layer_types` list wins."""
    window = config.get("sliding_window")
    if model_type == "llama" or not window:
        return {"sliding_window": None, "layer_types": None}
    n = config.get("num_hidden_layers")
    types = config.get("layer_types")
    if model_type == "qwen2":
        if not config.get("use_sliding_window", False):
            return {"sliding_window": None, "layer_types": None}
        if types is None and isinstance(n, int):
            first = config.get("max_window_layers", n)
            types = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
    return {"sliding_window": window, "layer_types": types}


def _hf_rope(config: dict) -> dict:
    """rope_theta/rope_scaling from either the v4 keys or v5's `rope_parameters`."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling")
    if params and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return {"rope_theta": theta, "rope_scaling": scaling}


def attention_windows(
    args: ModelArgs, kv_window: int = 0, kv_sinks: int = 0
) -> tuple[list[int], list[int]]:
    """(window, sinks) of each layer: the model's own sliding windows, narrowed by a runtime
    window `kv_window` (which keeps `kv_sinks` first tokens where it is the narrower)."""
    windows, sinks = [], []
    for w in args.layer_windows():
        if kv_window and (not w or kv_window < w):
            windows.append(kv_window)
            sinks.append(kv_sinks)
        else:
            windows.append(w)
            sinks.append(0)
    return windows, sinks


def weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor `Model(args)` loads (its state dict), without
    building it: loaders hold a file's tensors against this before anything is built."""
    d, f, v = args.hidden_size, args.intermediate_size, args.vocab_size
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    layer = {
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    if args.qkv_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,)}
        layer |= {"self_attn.v_proj.bias": (kv,)}
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(args.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes | {"model.norm.weight": (d,), "lm_head.weight": (v, d)}


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:  # [head_dim // 2]
    """Inverse frequencies, with llama3-style or linear scaling when configured."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    scale_fn = _ROPE_SCALING.get(kind)
    if scale_fn is None:
        raise UnsupportedArchitectureError(f"unsupported rope scaling {kind!r}")
    return scale_fn(inv, scaling).float()


def _llama3_scaling(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
    return torch.where(is_mid, mid, scaled)


def _freq_factors(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # GGUF stores llama3 scaling as per-dimension divisors (tensor rope_freqs.weight)
    return inv / torch.as_tensor(s["freq_factors"], dtype=inv.dtype)


_ROPE_SCALING = {
    "default": lambda inv, s: inv,
    "linear": lambda inv, s: inv / s["factor"],
    "llama3": _llama3_scaling,
    "freq_factors": _freq_factors,
}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position (HF rotate-half convention); cos/sin [T, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0):
        super().__init__()
        # the keys a query sees: the last `window` (0: all) plus the first `sinks`
        self.window, self.sinks = window, 0
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        d, hd, bias = args.hidden_size, args.head_dim, args.qkv_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.scale = hd**-0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(x, cos, sin, kv_cache, meta))

    def attend(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Everything before o_proj: [T, D] -> [T, H * head_dim]."""
        t = x.shape[0]  # x: [T, D]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, self.sinks)
        return o.reshape(t, -1)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, f = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0):
        super().__init__()
        self.self_attn = Attention(args, window)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_stages(self, x, cos, sin, kv_cache, meta):
        """`forward`, pausing with the input of each QUANT_STAGES entry (yielded in order) so
        a quantizer can replace that stage's weights before the rest runs; returns the output."""
        a = self.input_layernorm(x)
        yield a
        o_in = self.self_attn.attend(a, cos, sin, kv_cache, meta)
        yield o_in
        h = x + self.self_attn.o_proj(o_in)
        m = self.post_attention_layernorm(h)
        yield m
        d = nn.functional.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m)
        yield d
        return h + self.mlp.down_proj(d)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, w) for w in args.layer_windows())
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(nn.Module):
    """Causal LM over a flattened batch of sequences with a paged KV cache."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos(), emb.sin()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,  # [N] rows that need logits
    ) -> torch.Tensor:  # [N, vocab] float32
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv, meta)
        if logits_indices is not None:
            h = h[logits_indices]
        return self.lm_head(self.model.norm(h)).float()

    def set_windows(self, windows: list[int], sinks: list[int]) -> None:
        """Each layer's attention window and sink tokens (see `attention_windows`)."""
        for layer, w, s in zip(self.model.layers, windows, sinks, strict=True):
            layer.self_attn.window, layer.self_attn.sinks = w, s

    def sanitize(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Drop tensors the model does not use; share the embedding when tied."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings or "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return weights
