"""A model file's hyper-parameters and tensors, checked before anything is built.

Both loaders collect a file's hyper-parameters by ModelArgs field name, as stored
(GGUF metadata, HF config.json). `model_args` checks each one's type and range and
the relations between them, then builds ModelArgs; `check_weights` holds them
against the tensors: exactly the set a model of that size has (every layer 0..n-1,
none past it), each with its shape, and the (tiny) norm weights finite. A lie is
reported as the file names it (`llama.block_count`, `blk.0.attn_q.weight`), with the
value and what was expected, in one ModelFormatError, never as a torch traceback.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch

from edgellm.errors import ModelFormatError, UnsupportedArchitectureError
from edgellm.loaders.weights import WeightSource
from edgellm.models import get_model_module
from edgellm.models.llama import ModelArgs

# integer fields -> inclusive range; bounds sit well above the largest released models
INT_LIMITS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "vocab_size": (1, 1 << 22),
    "head_dim": (0, 4096),  # 0: hidden_size // num_attention_heads
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),  # None (absent): no sliding-window layers
}
# float fields -> (exclusive lower, inclusive upper) bound; both must be finite
FLOAT_LIMITS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (1.0, 1e12),  # a base <= 1 makes every rotary frequency 1 or larger
}
BOOLS = ("tie_word_embeddings", "qkv_bias")
REQUIRED = tuple(
    f.name for f in fields(ModelArgs) if f.default is MISSING and f.default_factory is MISSING
)
# rope_scaling kinds -> their positive parameters (name, default or None when required)
ROPE_PARAMS: dict[str, tuple[tuple[str, float | None], ...]] = {
    "default": (),
    "linear": (("factor", None),),
    "llama3": (
        ("factor", None),
        ("original_max_position_embeddings", None),
        ("low_freq_factor", 1.0),
        ("high_freq_factor", 4.0),
    ),
    "freq_factors": (),
}
# tensors a checkpoint may hold beyond the model's: dropped by `Model.sanitize`
IGNORED = re.compile(r".*rotary_emb\.inv_freq")
OPTIONAL = {"lm_head.weight"}  # absent: tied to the embeddings
PACKED_PARTS = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class Naming:
    """How a file names things, so that errors use its own words."""

    where: str  # the file, e.g. ".../model.gguf" or ".../config.json"
    keys: dict[str, str]  # ModelArgs field -> the file's key
    tensor: Callable[[str], str] = str  # HF tensor name -> the file's name

    def key(self, field: str) -> str:
        return self.keys.get(field, field)

    def error(self, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self.where}: {message}")

    def bad(self, field: str, value: Any, expected: str) -> ModelFormatError:
        return self.error(f"{self.key(field)} is {show(value)}, expected {expected}")


def show(value: Any, limit: int = 60) -> str:
    """A value for a one-line message: its repr, shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- hyper-parameters -----------------------------------------------------------------


def model_args(raw: dict[str, Any], naming: Naming) -> ModelArgs:
    """ModelArgs from a file's raw hyper-parameters, every one checked first."""
    kw = dict(raw)
    for name in REQUIRED:
        if kw.get(name) is None:
            raise naming.error(f"{naming.key(name)} is missing")
    for name, (lo, hi) in INT_LIMITS.items():
        if name in kw and not (name == "sliding_window" and kw[name] is None):
            kw[name] = _int_in(kw[name], lo, hi, naming.key(name), naming)
    types = kw.get("layer_types")
    if types is not None and not (
        isinstance(types, list) and all(isinstance(t, str) for t in types)
    ):
        raise naming.bad("layer_types", types, "a list of attention types, one per layer")
    for name, (lo, hi) in FLOAT_LIMITS.items():
        if name in kw:
            kw[name] = _float_in(kw[name], lo, hi, naming.key(name), naming)
    for name in BOOLS:
        if name in kw and not isinstance(kw[name], bool):
            raise naming.bad(name, kw[name], "true or false")
    _check_token_ids(kw, naming)
    kw["head_dim"] = _head_dim(kw, naming)
    kw["rope_scaling"] = _rope_scaling(kw.get("rope_scaling"), kw["head_dim"], naming)
    return ModelArgs(**kw)


def _int_in(value: Any, lo: int, hi: int, label: str, naming: Naming) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON writers may store 64 as 64.0
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise naming.error(f"{label} is {show(value)}, expected an integer in {lo}..{hi}")
    return value


def _float_in(value: Any, lo: float, hi: float, label: str, naming: Naming) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not lo < value <= hi:
        raise naming.error(
            f"{label} is {show(value)}, expected a finite number in ({lo:g}, {hi:g}]"
        )
    return float(value)


def _check_token_ids(kw: dict[str, Any], naming: Naming) -> None:
    for name in ("bos_token_id", "eos_token_id"):
        value = kw.get(name)
        ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
        if value is not None and not all(_is_index(i) for i in ids):
            raise naming.bad(name, value, "a token id (a non-negative integer)")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _head_dim(kw: dict[str, Any], naming: Naming) -> int:
    """head_dim, given or implied, after heads/KV heads/hidden size are checked together."""
    heads, kv_heads = kw["num_attention_heads"], kw["num_key_value_heads"]
    if heads % kv_heads:
        raise naming.bad(
            "num_key_value_heads",
            kv_heads,
            f"a divisor of {naming.key('num_attention_heads')} {heads}",
        )
    head_dim, hidden = kw.get("head_dim") or 0, kw["hidden_size"]
    if head_dim == 0:
        if hidden % heads:
            raise naming.bad(
                "num_attention_heads", heads, f"a divisor of {naming.key('hidden_size')} {hidden}"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise naming.bad("head_dim", head_dim, "an even number (rotary embeddings rotate pairs)")
    return head_dim


def _rope_scaling(scaling: Any, head_dim: int, naming: Naming) -> dict | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise naming.bad("rope_scaling", scaling, "an object or null")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_PARAMS:
        raise UnsupportedArchitectureError(
            f"{naming.where}: rope scaling {show(kind)} is not supported "
            f"(supported: {', '.join(ROPE_PARAMS)})"
        )
    for param, default in ROPE_PARAMS[kind]:
        label = f"{naming.key('rope_scaling')}.{param}"
        _float_in(scaling.get(param, default), 0.0, 1e12, label, naming)
    if kind == "llama3" and scaling.get("high_freq_factor", 4.0) <= scaling.get(
        "low_freq_factor", 1.0
    ):
        raise naming.bad("rope_scaling", scaling, "high_freq_factor above low_freq_factor")
    if kind == "freq_factors":
        _check_freq_factors(scaling.get("freq_factors"), head_dim, naming)
    return scaling if kind != "default" else None


def _check_freq_factors(factors: Any, head_dim: int, naming: Naming) -> None:
    ok = isinstance(factors, list) and len(factors) == head_dim // 2
    ok = ok and all(isinstance(f, int | float) and math.isfinite(f) and f > 0 for f in factors)
    if not ok:
        raise naming.error(
            f"rope_freqs.weight holds {show(factors)}, expected {head_dim // 2} finite positive factors"
        )


# ---- tensors --------------------------------------------------------------------------


def check_weights(args: ModelArgs, weights: WeightSource, naming: Naming) -> None:
    """The file's tensors are exactly those of a model with `args`, shapes included."""
    stored = stored_shapes(weights, naming)
    _check_layers(args, stored, naming)
    _check_defining(args, stored, naming)
    expected = get_model_module(args.model_type).weight_shapes(args)
    for name, shape in expected.items():
        got = stored.get(name)
        if got is None and name not in OPTIONAL:
            raise naming.error(f"tensor {naming.tensor(name)} is missing")
        if got is not None and got != shape:
            raise naming.error(
                f"tensor {naming.tensor(name)} has shape {list(got)}, expected {list(shape)}"
            )
    for name in stored:
        if name not in expected and not IGNORED.fullmatch(name):
            raise naming.error(f"unexpected tensor {naming.tensor(name)}")
    _check_norms(weights, expected, naming)


def stored_shapes(weights: WeightSource, naming: Naming) -> dict[str, tuple[int, ...]]:
    """HF name -> shape as the model sees it; a packed Linear counts as its `.weight`."""
    names = set(weights.names())
    shapes = {}
    for name in names:
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            shapes[f"{module}.weight"] = _packed_shape(weights, names, module, naming)
        elif not name.endswith(PACKED_PARTS):
            shapes[name] = tuple(weights.info(name).shape)
    return shapes


def _packed_shape(
    weights: WeightSource, names: set[str], module: str, naming: Naming
) -> tuple[int, ...]:
    """[out, in] of a packed Linear, from its `weight_shape`, held against the rows stored."""
    name = f"{module}.weight_shape"
    values = weights.get(name).tolist() if name in names else None
    if not isinstance(values, list) or len(values) != 2 or not all(_is_index(v) for v in values):
        raise naming.error(f"tensor {name} is {show(values)}, expected [out, in] integers")
    shape = tuple(values)
    for part in (".weight_packed", ".weight_scale"):
        rows = weights.info(module + part).shape[0] if module + part in names else -1
        if rows != shape[0]:
            raise naming.error(f"tensor {module}{part} has {rows} rows, expected {shape[0]}")
    return shape


def _check_layers(args: ModelArgs, stored: dict, naming: Naming) -> None:
    found: dict[int, str] = {}
    for name in stored:
        m = _LAYER.match(name)
        if m:
            found.setdefault(int(m.group(1)), name)
    n = args.num_hidden_layers
    beyond = sorted(i for i in found if i >= n)
    if beyond:
        raise naming.bad(
            "num_hidden_layers",
            n,
            f"more: tensor {naming.tensor(found[beyond[0]])} belongs to layer {beyond[0]}",
        )
    if len(found) < n:
        gap = min(set(range(n)) - set(found))
        raise naming.bad(
            "num_hidden_layers", n, f"{len(found)} (the file has no tensors for layer {gap})"
        )


def _check_defining(args: ModelArgs, stored: dict, naming: Naming) -> None:
    """The tensors that fix each size, checked first so the message names the lying field."""
    embed = "model.embed_tokens.weight"
    shape = stored.get(embed)
    if shape is None or len(shape) != 2:
        raise naming.error(f"tensor {naming.tensor(embed)} is missing or not 2-D")
    rows_of = {
        "vocab_size": (embed, shape[0], args.vocab_size),
        "hidden_size": (embed, shape[1], args.hidden_size),
    }
    layer0 = {
        "intermediate_size": ("mlp.gate_proj.weight", args.intermediate_size),
        "num_attention_heads": (
            "self_attn.q_proj.weight",
            args.num_attention_heads * args.head_dim,
        ),
        "num_key_value_heads": (
            "self_attn.k_proj.weight",
            args.num_key_value_heads * args.head_dim,
        ),
    }
    for field, (suffix, want) in layer0.items():
        name = f"model.layers.0.{suffix}"
        if name in stored and stored[name]:
            rows_of[field] = (name, stored[name][0], want)
    for field, (name, got, want) in rows_of.items():
        if got == want:
            continue
        tensor = f"tensor {naming.tensor(name)} has shape {list(stored[name])}"
        if field.endswith("heads"):
            if got % args.head_dim:
                raise naming.bad("head_dim", args.head_dim, f"a divisor of {got} ({tensor})")
            got //= args.head_dim
            tensor += f", head_dim {args.head_dim}"
        raise naming.bad(field, getattr(args, field), f"{got} ({tensor})")


def _check_norms(weights: WeightSource, expected: dict, naming: Naming) -> None:
    """Norm weights are tiny and scale every activation: a NaN there poisons all output."""
    for name in expected:
        if name.endswith("norm.weight") and not torch.isfinite(weights.get(name)).all():
            raise naming.error(f"tensor {naming.tensor(name)} holds NaN or infinite values")
