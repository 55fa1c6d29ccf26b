"""Structured pruning: a smaller model of the same architecture, chosen by measured importance.

One pass over calibration windows, one float decoder layer resident at a time (the
quantizer's layer-wise runner), measures three importances:

- a layer's Block Influence (ShortGPT): 1 - mean cosine(input, output) of its hidden
  states over the calibration tokens; the layers that change their input least go first
  (`drop_layers`);
- an MLP channel's mean |silu(gate) * up| (the activation down_proj reads; FLAP/Minitron's
  activation criterion); each layer keeps its `mlp_width` strongest channels;
- a KV head group's attention output norm: the mean L2 norm of its query heads' outputs
  (what o_proj reads); each layer keeps its `heads / G` strongest groups, so grouped-query
  attention keeps its ratio G = heads / kv_heads.

The pruned weights are plain slices of the teacher's (rows of q/k/v/gate/up, columns of
o/down), written as a Hugging Face directory (config with explicit head_dim,
safetensors, tokenizer, generation config) under a temporary name and renamed when
complete: every backend loads it and `edgellm export gguf` converts it. Distillation from
the unpruned teacher is what recovers the lost quality (the rest of `edgellm distill`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgellm.errors import InvalidParameterError
from edgellm.fsutil import atomic_path, check_output
from edgellm.loaders.model import LoadedModel, load_model
from edgellm.loaders.weights import layer_prefix
from edgellm.models.llama import ModelArgs
from edgellm.quantize.calibration import calibration_tokens
from edgellm.quantize.export_hf import generation_config
from edgellm.quantize.layerwise import LayerRunner, embed, load_layer
from edgellm.quantize.pipeline import LayerBar
from edgellm.registry import resolve_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class PruneOptions:
    drop_layers: int = 0  # decoder layers removed (lowest Block Influence first)
    mlp_width: int | None = None  # MLP channels kept per layer (None: all)
    heads: int | None = None  # query heads kept per layer, whole KV groups (None: all)
    multiple_of: int = 32  # kept widths stay divisible by this (INT4 groups, GGUF blocks)
    calib: str = "sotu"
    n_samples: int = 32
    seq_len: int = 256
    seed: int = 0
    dtype: str = "bfloat16"  # of the written weights


@dataclass(slots=True)
class Importance:
    """What one calibration pass measured, per layer."""

    block_influence: list[float] = field(default_factory=list)
    mlp: list[torch.Tensor] = field(default_factory=list)  # [intermediate] per layer
    kv_groups: list[torch.Tensor] = field(default_factory=list)  # [kv_heads] per layer


@dataclass(frozen=True, slots=True)
class PrunePlan:
    """Which layers, channels and KV groups survive (indices into the teacher's)."""

    layers: list[int]
    mlp_channels: list[list[int]]  # per kept layer, sorted
    kv_groups: list[list[int]]  # per kept layer, sorted

    def args(self, teacher: ModelArgs) -> ModelArgs:
        g = teacher.num_attention_heads // teacher.num_key_value_heads
        kv = len(self.kv_groups[0])
        return dataclasses.replace(
            teacher,
            num_hidden_layers=len(self.layers),
            intermediate_size=len(self.mlp_channels[0]),
            num_key_value_heads=kv,
            num_attention_heads=kv * g,
            head_dim=teacher.head_dim,  # explicit: no longer hidden_size / heads
        )


def check_options(args: ModelArgs, opts: PruneOptions) -> None:
    """One clear error for options that cannot give a valid smaller model."""
    if not 0 <= opts.drop_layers < args.num_hidden_layers:
        raise InvalidParameterError(
            f"--drop-layers {opts.drop_layers}: the model has {args.num_hidden_layers} layers "
            "(at least one must stay)"
        )
    m = opts.multiple_of
    if opts.mlp_width is not None:
        if not 0 < opts.mlp_width <= args.intermediate_size or opts.mlp_width % m:
            raise InvalidParameterError(
                f"--mlp-width {opts.mlp_width}: must be a multiple of {m} in "
                f"[{m}, {args.intermediate_size}] (the model's MLP width)"
            )
    if opts.heads is not None:
        g = args.num_attention_heads // args.num_key_value_heads
        if not 0 < opts.heads <= args.num_attention_heads or opts.heads % g:
            raise InvalidParameterError(
                f"--heads {opts.heads}: must be a multiple of {g} (query heads per KV head) in "
                f"[{g}, {args.num_attention_heads}]"
            )
    if opts.n_samples < 1 or opts.seq_len < 2:
        raise InvalidParameterError("pruning needs at least 1 calibration window of 2 tokens")


@torch.inference_mode()
def measure_importance(
    loaded: LoadedModel, tokens: list[list[int]], advance=lambda: None
) -> Importance:
    """One layer-wise pass of the float teacher over `tokens` (windows of equal length)."""
    args, source = loaded.args, loaded.weights
    hidden = embed(source, torch.tensor(tokens))  # [N, L, D]
    runner = LayerRunner(args, hidden.shape[1])
    imp = Importance()
    g, d = args.num_attention_heads // args.num_key_value_heads, args.head_dim
    for i in range(args.num_hidden_layers):
        layer = load_layer(args, source, i)
        seen: dict[int, torch.Tensor] = {}
        out = runner.staged(layer, hidden, 4, seen.__setitem__)  # stage -> its inputs
        heads = seen[1].view(-1, args.num_attention_heads, d).norm(dim=-1)  # [T, H]
        imp.kv_groups.append(heads.mean(0).view(args.num_key_value_heads, g).sum(1))
        imp.mlp.append(seen[3].abs().mean(0))  # [intermediate]
        cos = torch.nn.functional.cosine_similarity(
            hidden.flatten(0, 1).float(), out.flatten(0, 1).float(), dim=-1
        )
        imp.block_influence.append(float(1 - cos.mean()))
        hidden = out
        del layer
        advance()
    return imp


def plan(args: ModelArgs, imp: Importance, opts: PruneOptions) -> PrunePlan:
    """The surviving layers (all but the `drop_layers` of lowest influence), and in each the
    strongest MLP channels and KV groups."""
    check_options(args, opts)
    order = sorted(range(args.num_hidden_layers), key=lambda i: imp.block_influence[i])
    layers = sorted(set(range(args.num_hidden_layers)) - set(order[: opts.drop_layers]))
    width = opts.mlp_width or args.intermediate_size
    g = args.num_attention_heads // args.num_key_value_heads
    groups = (opts.heads or args.num_attention_heads) // g
    return PrunePlan(
        layers,
        [sorted(imp.mlp[i].topk(width).indices.tolist()) for i in layers],
        [sorted(imp.kv_groups[i].topk(groups).indices.tolist()) for i in layers],
    )


def pruned_tensors(loaded: LoadedModel, p: PrunePlan) -> dict[str, torch.Tensor]:
    """The student's weights (HF names): slices of the teacher's, layers renumbered."""
    args, source = loaded.args, loaded.weights
    d = args.head_dim
    g = args.num_attention_heads // args.num_key_value_heads
    out = {}
    for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if n in source.names() and not (args.tie_word_embeddings and n == "lm_head.weight"):
            out[n] = source.get(n)
    for new, (old, channels, groups) in enumerate(
        zip(p.layers, p.mlp_channels, p.kv_groups, strict=True)
    ):
        src, dst = layer_prefix(old), layer_prefix(new)
        ch = torch.tensor(channels)
        kv_rows = torch.cat([torch.arange(k * d, (k + 1) * d) for k in groups])
        q_heads = [k * g + j for k in groups for j in range(g)]
        q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in q_heads])
        rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        for name in source.names():
            if not name.startswith(src):
                continue
            rest = name[len(src) :]
            t = source.get(name)
            part = rest.split(".")[-2] if rest.count(".") >= 2 else ""
            if part in rows:  # q/k/v weight rows or bias entries
                t = t[rows[part]]
            elif part == "o_proj":
                t = t[:, q_rows]
            elif part in ("gate_proj", "up_proj"):
                t = t[ch]
            elif part == "down_proj":
                t = t[:, ch]
            out[dst + rest] = t.contiguous()
    return out


def prune(
    model: str | None,
    out_dir: str | Path,
    options: PruneOptions | None = None,
    force: bool = False,
    progress: bool = False,
) -> tuple[Path, PrunePlan, Importance]:
    """Prune a float model (HF directory or GGUF) into an HF directory `out_dir`."""
    opts = options or PruneOptions()
    if opts.dtype not in DTYPES:
        raise InvalidParameterError(f"unknown dtype {opts.dtype!r} (choose from {', '.join(DTYPES)})")
    check_output(out_dir, force, source=resolve_model(model), is_dir=True)
    loaded = load_model(model)
    if loaded.config and loaded.config.get("quantization_config"):
        raise InvalidParameterError(
            f"{loaded.path} is an INT checkpoint: prune its float model, then quantize"
        )
    check_options(loaded.args, opts)
    tokens = calibration_tokens(loaded.tokenizer, opts.calib, opts.n_samples, opts.seq_len, opts.seed)
    with LayerBar(progress, loaded.args.num_hidden_layers, "prune: importance") as advance:
        imp = measure_importance(loaded, tokens, advance)
    p = plan(loaded.args, imp, opts)
    student = p.args(loaded.args)
    tensors = pruned_tensors(loaded, p)
    with atomic_path(out_dir, force=force, is_dir=True) as tmp:
        dtype = DTYPES[opts.dtype]
        save_file(
            {n: t.to(dtype).contiguous() for n, t in tensors.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        config = {**student.to_hf_config(), "torch_dtype": opts.dtype}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(loaded), indent=2))
        loaded.tokenizer.save_pretrained(tmp)
        (tmp / "pruning.json").write_text(
            json.dumps(
                {
                    "teacher": str(loaded.path),
                    "options": dataclasses.asdict(opts),
                    "kept_layers": p.layers,
                    "block_influence": imp.block_influence,
                },
                indent=2,
            )
        )
    return Path(out_dir), p, imp
