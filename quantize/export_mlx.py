"""Our models in mlx-lm's layout: the weights the MLX backend runs and `edgellm export mlx`.

An INT checkpoint maps onto MLX affine quantization without re-quantizing (see
`/work/shared/FORMATS.md`): MLX's `weight` is uint32 `[out, in * bits / 32]` with
sequential `bits`-wide unsigned fields, which is our `weight_packed` bit for bit (codes
are stored as q + 2^(bits-1) in both); `w = q_u * scale + bias`, so `scales` are ours and
`bias = -scale * (zero + 2^(bits-1))`. The biases are computed in float32 from the
stored scales, where they are exact; they are stored in float16 only when every one of
them (and every scale) is exact there, else in float32, so an export never changes a
weight. Float tensors (embeddings, norms, biases, dense Linears) are copied as stored.

Nothing here needs MLX itself: the backend turns these tensors into `mx.array`s and the
export writes them with safetensors, which `mlx_lm.load` reads as it is.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgellm.errors import InvalidParameterError, UnsupportedArchitectureError
from edgellm.fsutil import atomic_path, check_output
from edgellm.loaders.model import LoadedModel, load_model
from edgellm.quantize.export_hf import generation_config
from edgellm.quantize.format import read_quant_config, unpack_int32
from edgellm.registry import resolve_model

MLX_GROUPS = (32, 64, 128)  # group sizes of MLX's affine kernels
MLX_BITS = (2, 4, 8)  # widths whose MLX packing is our dense bit stream (no field straddles)
SCALE_DTYPES = ("auto", "float16", "float32")
FLOAT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(slots=True)
class MLXWeights:
    """Tensors under mlx-lm's names: quantized Linears as `<m>.weight` (uint32), `<m>.scales`
    and `<m>.biases`; everything else as a float tensor. `groups` maps each quantized Linear
    to its group size."""

    tensors: dict[str, torch.Tensor]
    bits: int | None = None  # None: a float model
    groups: dict[str, int] = field(default_factory=dict)
    scale_dtype: torch.dtype | None = None

    @property
    def quantization(self) -> dict | None:
        """config.json's `quantization` entry: the most common group size as the default and
        each Linear that differs named with its own (mlx-lm's per-layer form)."""
        if self.bits is None:
            return None
        common = Counter(self.groups.values()).most_common(1)[0][0]
        entry: dict = {"group_size": common, "bits": self.bits, "mode": "affine"}
        for name, g in sorted(self.groups.items()):
            if g != common:
                entry[name] = {"group_size": g, "bits": self.bits, "mode": "affine"}
        return entry


def affine_from_packed(
    packed: torch.Tensor,  # int32 [out, in * bits / 32]
    scale: torch.Tensor,  # [out, n_groups]
    zero_packed: torch.Tensor | None,  # int32 [ceil(out * bits / 32), n_groups], None: symmetric
    bits: int,
    shape: tuple[int, int],  # (out, in)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed Linear -> MLX (weight uint32, scales float32, biases float32), exact."""
    out_features, in_features = shape
    n_groups = scale.shape[1]
    group = in_features // n_groups
    if bits not in MLX_BITS:
        raise UnsupportedArchitectureError(
            f"MLX cannot take {bits}-bit weights as stored (it packs {', '.join(map(str, MLX_BITS))}"
            " bits as we do)"
        )
    if group not in MLX_GROUPS or group * n_groups != in_features:
        raise UnsupportedArchitectureError(
            f"MLX's affine kernels take group sizes {', '.join(map(str, MLX_GROUPS))}; this "
            f"layer ({out_features}x{in_features}) has groups of {in_features / n_groups:g} "
            "(re-quantize with --group-size 32, 64 or 128)"
        )
    zero = torch.zeros(out_features, n_groups, dtype=torch.float32)
    if zero_packed is not None:
        zero = unpack_int32(zero_packed, bits, out_features, dim=0).float()
    scales = scale.float()
    biases = -scales * (zero + (1 << (bits - 1)))  # exact in float32: |zero + 2^(b-1)| < 2^8
    return packed.contiguous().view(torch.uint32), scales, biases


def mlx_weights(
    loaded: LoadedModel, float_dtype: str = "auto", scale_dtype: str = "auto"
) -> MLXWeights:
    """The model's tensors in mlx-lm's layout (see the module docstring).

    float_dtype: "auto" keeps float tensors as stored, else casts them; scale_dtype: "auto"
    is float16 when every scale and bias is exact there, else float32."""
    if scale_dtype not in SCALE_DTYPES:
        raise InvalidParameterError(
            f"unknown scale dtype {scale_dtype!r} (choose from {', '.join(SCALE_DTYPES)})"
        )
    if float_dtype != "auto" and float_dtype not in FLOAT_DTYPES:
        raise InvalidParameterError(
            f"unknown dtype {float_dtype!r} (choose from auto, {', '.join(FLOAT_DTYPES)})"
        )
    qconfig = read_quant_config(loaded.config or {})
    names = loaded.weights.names()
    suffix = ".weight_packed"
    packed = [n.removesuffix(suffix) for n in names if n.endswith(suffix)]
    owned = {f"{p}.{s}" for p in packed for s in ("weight_packed", "weight_scale",
                                                   "weight_shape", "weight_zero_point")}  # fmt: skip
    out = MLXWeights({}, qconfig.bits if packed and qconfig else None)
    for prefix in packed:
        get = loaded.weights.get
        shape = tuple(int(s) for s in get(f"{prefix}.weight_shape").tolist())
        zp = get(f"{prefix}.weight_zero_point") if f"{prefix}.weight_zero_point" in names else None
        try:
            w, s, b = affine_from_packed(get(f"{prefix}.weight_packed"),
                                         get(f"{prefix}.weight_scale"), zp, out.bits, shape)  # fmt: skip
        except UnsupportedArchitectureError as e:
            raise UnsupportedArchitectureError(f"{prefix}: {e}") from e
        out.tensors |= {f"{prefix}.weight": w, f"{prefix}.scales": s, f"{prefix}.biases": b}
        out.groups[prefix] = shape[1] // s.shape[1]
    cast = FLOAT_DTYPES.get(float_dtype)
    for name in names:
        if name in owned or "rotary_emb.inv_freq" in name:
            continue
        t = loaded.weights.get(name)
        if not t.is_floating_point():
            raise UnsupportedArchitectureError(f"{name}: integer tensor outside a packed Linear")
        out.tensors[name] = t if cast is None else t.to(cast)
    if loaded.args.tie_word_embeddings:
        out.tensors.pop("lm_head.weight", None)
    if packed:
        out.scale_dtype = _scale_dtype(out, scale_dtype)
        for prefix in packed:
            for part in ("scales", "biases"):
                out.tensors[f"{prefix}.{part}"] = out.tensors[f"{prefix}.{part}"].to(out.scale_dtype)
    return out


def _scale_dtype(w: MLXWeights, choice: str) -> torch.dtype:
    if choice != "auto":
        return FLOAT_DTYPES[choice]
    for prefix in w.groups:
        for part in ("scales", "biases"):
            t = w.tensors[f"{prefix}.{part}"]
            half = t.half()
            if not (torch.isfinite(half).all() and torch.equal(half.float(), t)):
                return torch.float32
    return torch.float16


def export_mlx(
    model: str | Path | None,
    out_dir: str | Path,
    dtype: str = "auto",
    scale_dtype: str = "auto",
    force: bool = False,
) -> tuple[Path, MLXWeights]:
    """Write a directory `mlx_lm.load` opens as it is: config.json (with `quantization` for an
    INT checkpoint), model.safetensors, generation_config.json and the tokenizer files (with
    the chat template). Written under a temporary name and renamed when complete."""
    check_output(out_dir, force, source=resolve_model(model), is_dir=True)
    loaded = load_model(model)
    scaling = loaded.args.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "freq_factors":
        raise UnsupportedArchitectureError(
            "this GGUF stores llama3 RoPE scaling as per-dimension factors, which mlx-lm's config "
            "cannot express; export from the Hugging Face model instead"
        )
    weights = mlx_weights(loaded, dtype, scale_dtype)
    config = loaded.args.to_hf_config()
    if weights.quantization is not None:
        config["quantization"] = weights.quantization
    embed = weights.tensors["model.embed_tokens.weight"].dtype  # mlx-lm computes in this dtype
    config["torch_dtype"] = str(embed).removeprefix("torch.")
    with atomic_path(out_dir, force=force, is_dir=True) as tmp:
        tensors = {n: t.contiguous() for n, t in weights.tensors.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps(generation_config(loaded), indent=2)
        )
        loaded.tokenizer.save_pretrained(tmp)
    return Path(out_dir), weights


def describe_export(weights: MLXWeights) -> str:
    if weights.bits is None:
        return "float weights"
    groups = sorted(set(weights.groups.values()))
    scale = str(weights.scale_dtype).removeprefix("torch.")
    return (
        f"{len(weights.groups)} Linears as MLX affine int{weights.bits}, group "
        f"{'/'.join(map(str, groups))}, scales and biases in {scale} (exact)"
    )

