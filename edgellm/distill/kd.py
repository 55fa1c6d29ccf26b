"""Logit distillation on the CPU: a student learns the float teacher's next-token
distributions (forward KL, token-averaged) on calibration windows.

Two kinds of student share one training loop:

- a float model (e.g. a pruned teacher): every weight trains except, optionally, the
  embeddings and a tied LM head;
- an INT checkpoint (DWQ-style): the codes stay fixed and each quantized Linear learns its
  per-group scales (multiplicatively, `scale0 * exp(a)`) and, when asymmetric, its zero
  points (kept integer by a straight-through rounding); norms and biases train too.

Whatever trains is rounded in the forward pass to the dtype it is stored in (bf16 scales,
integer zero points, bf16 norms; straight-through gradients), so the model that learned
is exactly the model written: `Student.export()` gives the checkpoint's tensors, and the
INT layout, bits/weight and exact GGUF/MLX export are those of `edgellm quantize`.

`train` is deterministic for a seed: the windows of step k are a function of (seed, k), so
a run interrupted and resumed from its saved state (`TrainState`) ends bit-identical to
an uninterrupted one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from edgellm.quantize.format import pack_int32
from edgellm.quantize.linear import QuantLinear

LOSSES = ("kl", "ce")
Windows = torch.Tensor | list[list[int]]  # token windows [n, L]


@dataclass(frozen=True, slots=True)
class KDOptions:
    steps: int = 120
    batch: int = 2  # windows per step (gradients accumulated one window at a time)
    lr: float = 1e-4
    # INT students: zero points learn at lr x this. They move to another integer only when
    # the gradient pushes them 0.5 steadily; 10x on a tiny model made flips that hurt the KL
    zero_lr: float = 1.0
    warmup: int = 10
    temperature: float = 1.0
    loss: str = "kl"  # kl: to the teacher's distribution | ce: plain next-token cross-entropy
    freeze_embeddings: bool = True  # embeddings and a tied LM head stay as the teacher's
    seed: int = 0


def train_forward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Differentiable logits [B, L, V] of a Llama-family `Model` over whole windows [B, L]
    (causal, no KV cache): the reference model's modules, batched for training."""
    args = model.args
    b, n = tokens.shape
    h = model.model.embed_tokens(tokens)  # [B, L, D]
    cos, sin = model.rope(torch.arange(n))  # [L, 1, Dh]
    cos, sin = cos.transpose(0, 1)[None].to(h.dtype), sin.transpose(0, 1)[None].to(h.dtype)
    hd, nh, nkv = args.head_dim, args.num_attention_heads, args.num_key_value_heads
    for layer in model.model.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(b, n, nh, hd).transpose(1, 2)  # [B, H, L, Dh]
        k = a.k_proj(x).view(b, n, nkv, hd).transpose(1, 2)
        v = a.v_proj(x).view(b, n, nkv, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.scale, enable_gqa=True)
        h = h + a.o_proj(o.transpose(1, 2).reshape(b, n, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h)).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def kl_to_teacher(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Forward KL(teacher || student) per token, averaged: sum p_t (log p_t - log p_s).

    The teacher's side is computed without a graph, so training holds one vocabulary-wide
    tensor per token fewer than the textbook expression."""
    if temperature != 1.0:
        teacher_logits, student_logits = teacher_logits / temperature, student_logits / temperature
    with torch.no_grad():
        t = F.log_softmax(teacher_logits, dim=-1)
        p = t.exp()
        neg_entropy = (p * t).sum(-1)
        del t
    s = F.log_softmax(student_logits, dim=-1)
    return (neg_entropy - (p * s).sum(-1)).mean() * temperature**2


def next_token_ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


@torch.no_grad()
def held_out_kl(student: nn.Module, teacher: nn.Module, windows: Windows) -> float:
    """Mean per-token KL(teacher || student) over `windows`, one window at a time."""
    total = 0.0
    for w in windows:
        x = torch.as_tensor(w)[None]
        total += float(kl_to_teacher(train_forward(student, x), train_forward(teacher, x)))
    return total / len(windows)


@torch.no_grad()
def windows_ppl(model: nn.Module, windows: Windows) -> float:
    """Perplexity of the next tokens inside each window (no context across windows)."""
    nll, n = 0.0, 0
    for w in windows:
        x = torch.as_tensor(w)[None]
        nll += float(next_token_ce(train_forward(model, x), x)) * (len(w) - 1)
        n += len(w) - 1
    return math.exp(nll / n)


def _ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` forward, identity gradient to `x` (straight-through)."""
    return x + (rounded - x).detach()


class StorageRound(nn.Module):
    """Parametrization: a float32 master weight seen through its storage dtype (bf16...)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _ste(w, w.to(self.dtype).to(w.dtype))


def _dequantize(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
    n, k = q.shape
    qg = q.view(n, s.shape[1], -1).float()
    if z is not None:
        qg = qg - z[..., None]
    return (qg * s[..., None]).view(n, k)


class _QuantMatmul(torch.autograd.Function):
    """y = x @ ((q - z) * s).T + b, keeping only x for the backward pass: the float weight is
    rebuilt there from the int8 codes, so training holds no float copy of any weight."""

    @staticmethod
    def forward(ctx, x, q, s, z, bias):
        ctx.save_for_backward(x, q, s, z)
        return F.linear(x, _dequantize(q, s, z), bias)

    @staticmethod
    def backward(ctx, g):
        x, q, s, z = ctx.saved_tensors
        w = _dequantize(q, s, z)
        gx = g @ w
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gw = (g2.t() @ x2).view(q.shape[0], s.shape[1], -1)  # [out, groups, group_len]
        qz = q.view_as(gw).float()
        if z is not None:
            qz = qz - z[..., None]
        gs = (gw * qz).sum(-1)
        gz = None if z is None else -(gw.sum(-1) * s)
        gb = g2.sum(0) if ctx.needs_input_grad[4] else None
        return gx, None, gs, gz, gb


class LearnedQuantLinear(nn.Module):
    """A QuantLinear whose per-group scales (and zero points) train; its codes stay fixed.

    scale = scale0 * exp(log_scale), seen rounded to the storage dtype; zero points are
    float masters seen rounded to integers in [qmin, qmax]. The forward pass is the
    dequantize-then-matmul of the checkpoint these values export to."""

    def __init__(self, ql: QuantLinear, scale_dtype: torch.dtype):
        super().__init__()
        q, zero = ql.codes()
        self.qconfig, self.scale_dtype = ql.qconfig, scale_dtype
        self.in_features, self.out_features = ql.in_features, ql.out_features
        self.register_buffer("q", q, persistent=False)  # int8 [out, in]
        self.register_buffer("scale0", ql.weight_scale.detach().float(), persistent=False)
        self.log_scale = nn.Parameter(torch.zeros_like(self.scale0))
        self.zero = None if zero is None else nn.Parameter(zero.float())
        self.bias = None if ql.bias is None else nn.Parameter(ql.bias.detach().float())

    def scale(self) -> torch.Tensor:
        s = self.scale0 * self.log_scale.exp()
        return _ste(s, s.to(self.scale_dtype).float())

    def zero_point(self) -> torch.Tensor | None:
        if self.zero is None:
            return None
        z = self.zero.clamp(self.qconfig.qmin, self.qconfig.qmax)
        return _ste(z, z.round())

    def weight(self) -> torch.Tensor:  # float32 [out, in]
        return _dequantize(self.q, self.scale(), self.zero_point())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantMatmul.apply(x, self.q, self.scale(), self.zero_point(), self.bias)

    @torch.no_grad()
    def export(self) -> dict[str, torch.Tensor]:
        out = {"weight_scale": self.scale().to(self.scale_dtype)}
        z = self.zero_point()
        if z is not None:
            out["weight_zero_point"] = pack_int32(z.to(torch.int8), self.qconfig.bits, dim=0)
        return out


@dataclass(slots=True)
class Student:
    """A model prepared for training: what trains, and how it maps back to stored tensors."""

    model: nn.Module
    params: dict[str, nn.Parameter]  # stable names -> float32 masters
    quantized: dict[str, LearnedQuantLinear] = field(default_factory=dict)
    stored: dict[str, nn.Module] = field(default_factory=dict)  # HF name -> owning module
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    @torch.no_grad()
    def export(self) -> dict[str, torch.Tensor]:
        """Trained tensors under their checkpoint names, in their storage dtypes."""
        out = {}
        for name, mod in self.quantized.items():
            for suffix, t in mod.export().items():
                out[f"{name}.{suffix}"] = t
            if mod.bias is not None:
                out[f"{name}.bias"] = mod.bias.to(self.dtypes[f"{name}.bias"])
        for name, mod in self.stored.items():
            attr = name.rsplit(".", 1)[1]
            out[name] = getattr(mod, attr).to(self.dtypes[name]).contiguous()
        return out


def prepare_student(
    model: nn.Module, dtypes: dict[str, torch.dtype], freeze_embeddings: bool = True
) -> Student:
    """Make `model` (float32, from `build_model`) trainable in place.

    `dtypes` are the checkpoint's storage dtypes by tensor name. QuantLinears become
    LearnedQuantLinear; for an INT student the other Linears' weights (a float LM head)
    stay frozen, while norms and biases train. A float student trains every weight."""
    model.requires_grad_(False)
    quantized: dict[str, LearnedQuantLinear] = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantLinear):
            new = LearnedQuantLinear(mod, dtypes[f"{name}.weight_scale"])
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            quantized[name] = new
    frozen = {"model.embed_tokens.weight", "lm_head.weight"} if freeze_embeddings else set()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    stored: dict[str, nn.Module] = {}
    for full, p in list(model.named_parameters()):
        mod_name, _, attr = full.rpartition(".")
        mod = model.get_submodule(mod_name)
        if isinstance(mod, LearnedQuantLinear) or full in frozen:
            continue
        if tied and full == "lm_head.weight":
            continue  # the embedding's (below)
        if quantized and isinstance(mod, nn.Linear):
            continue  # INT student: a float LM head stays the teacher's
        dtype = dtypes.get(full, torch.float32)
        if dtype != p.dtype:
            parametrize.register_parametrization(mod, attr, StorageRound(dtype))
        stored[full] = mod
    if tied and "model.embed_tokens.weight" in stored:  # the head sees the rounded embedding too
        emb = model.model.embed_tokens
        if parametrize.is_parametrized(emb, "weight"):
            model.lm_head.weight = emb.parametrizations.weight.original
            parametrize.register_parametrization(model.lm_head, "weight", StorageRound(
                emb.parametrizations.weight[0].dtype))
    student = Student(model, {}, quantized, stored, dict(dtypes))
    for n, mod in quantized.items():
        student.params[f"{n}.log_scale"] = mod.log_scale
        if mod.zero is not None:
            student.params[f"{n}.zero"] = mod.zero
        if mod.bias is not None:
            student.params[f"{n}.bias"] = mod.bias
    for n, mod in stored.items():
        attr = n.rsplit(".", 1)[1]
        if parametrize.is_parametrized(mod, attr):
            p = mod.parametrizations[attr].original
        else:
            p = getattr(mod, attr)
        student.params[n] = p
    for p in student.params.values():
        p.requires_grad_(True)
    return student


@dataclass(slots=True)
class TrainState:
    """Everything a resumed run needs: the step reached, the trained values, the optimizer."""

    step: int = 0
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "tokens", ...}


def window_order(n_windows: int, steps: int, batch: int, seed: int) -> list[list[int]]:
    """The windows of every step: seeded shuffles, epoch after epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        perm = list(range(n_windows))
        rng.shuffle(perm)
        order += perm
    return [order[k * batch : (k + 1) * batch] for k in range(steps)]


def lr_factor(step: int, opts: KDOptions) -> float:
    """Linear warmup, then cosine decay to zero."""
    if step < opts.warmup:
        return (step + 1) / opts.warmup
    frac = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    return 0.5 * (1 + math.cos(math.pi * frac))


def train(
    student: Student,
    teacher: nn.Module | None,
    windows: Windows,
    opts: KDOptions,
    state: TrainState | None = None,
    on_step: Callable[[int, float], None] = lambda step, loss: None,
    after_step: Callable[[TrainState], None] = lambda state: None,
) -> TrainState:
    """Train `student` on `windows` from `state.step` to `opts.steps`; returns the state.

    `after_step` runs after every step with the current state (to evaluate, or to save it
    for a resume: the state then holds references to live tensors, save a copy)."""
    if opts.loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}")
    if opts.loss == "kl" and teacher is None:
        raise ValueError("KL distillation needs a teacher")
    torch.manual_seed(opts.seed)
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    params = student.params
    zeros = [p for n, p in params.items() if n.endswith(".zero")]
    rest = [p for n, p in params.items() if not n.endswith(".zero")]
    groups = [{"params": rest, "lr": opts.lr, "base": opts.lr}]
    if zeros:
        zlr = opts.lr * opts.zero_lr
        groups.append({"params": zeros, "lr": zlr, "base": zlr})
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    state = state or TrainState()
    if state.params:
        with torch.no_grad():
            for n, t in state.params.items():
                params[n].copy_(t)
        opt.load_state_dict(state.optimizer)
    order = window_order(len(windows), opts.steps, opts.batch, opts.seed)
    student.model.train()
    for step in range(state.step, opts.steps):
        for group in opt.param_groups:
            group["lr"] = group["base"] * lr_factor(step, opts)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in order[step]:
            x = torch.as_tensor(windows[i])[None]
            logits = train_forward(student.model, x)
            if opts.loss == "kl":
                with torch.no_grad():
                    target = train_forward(teacher, x)
                loss = kl_to_teacher(logits, target, opts.temperature)
            else:
                loss = next_token_ce(logits, x)
            (loss / opts.batch).backward()
            total += float(loss.detach()) / opts.batch
        torch.nn.utils.clip_grad_norm_(rest, 1.0)
        opt.step()
        state.step = step + 1
        state.losses.append(total)
        state.params = dict(params)
        state.optimizer = opt.state_dict()
        on_step(step, total)
        after_step(state)
    student.model.eval()
    return state
