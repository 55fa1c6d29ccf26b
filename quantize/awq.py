"""Activation-aware weight quantization (AWQ, Lin et al. 2023) of one decoder layer.

Input channels with large activations (mean |x|) matter most, and rounding their
weights costs the most output error. AWQ multiplies those weight columns by s > 1
before rounding and divides the op that feeds them (a norm or a linear) by s, so
the float function is unchanged while the rounding error on salient channels
shrinks. Per group of linears that share one input, s = mean|x|^alpha with alpha
grid-searched to minimise the quantized output error; then the range of every
weight group is clipped by a searched factor.

The caller captures each linear's float inputs from the float layer; the layer's
float weights are left scaled, so the caller can run it again (or its quantized
twin) to produce the next layer's inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call

from edgellm.errors import InvalidParameterError
from edgellm.models import get_model_module  # noqa: E402
from edgellm.quantize.layerwise import compute_autocast
from edgellm.quantize.rtn import (
    QuantConfig,
    QuantizedWeight,
    compute_qparams,
    qparams_of_range,
    quantize_rtn,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScaleGroup:
    """Linears that share one input, and the op before them that absorbs 1/s."""

    prev: str  # a norm (weight /= s) or a linear (output rows and bias /= s)
    linears: list[str]  # weight columns *= s; paths relative to the decoder layer
    inspect: str | None = None  # module whose output measures the loss; None: the linears'
    # the inspected module mixes tokens (attention): scored on whole sequences (`SequenceProbe`)
    whole_sequences: bool = False

    @property
    def on_tokens(self) -> ScaleGroup:
        """The group as scored on a sample of tokens: a module that mixes tokens cannot be,
        so there its linears' own outputs measure the loss."""
        return replace(self, inspect=None, whole_sequences=False) if self.whole_sequences else self


@dataclass(frozen=True, slots=True)
class SequenceProbe:
    """Whole calibration sequences on which to score a module that mixes tokens (attention):
    its output at a token depends on the tokens before it, so a sample of tokens cannot
    score it. x: the module's float input [T, in] (its linears' input, before any scaling);
    args: the rest of its forward's arguments for these sequences (rope tables, a KV buffer,
    the attention metadata); sinks: [T] bool, the massive tokens: left out of the loss (as
    from the sample), their outputs only admit candidates (see `search_scale`'s protect)."""

    x: torch.Tensor
    args: tuple
    sinks: torch.Tensor


def awq_quantize_layer(
    layer: nn.Module,
    inputs: dict[str, torch.Tensor],
    config: QuantConfig,
    model_type: str,
    n_grid: int = 20,
    clip_grid: int = 20,
    max_shrink: float = 0.5,
    sample_tokens: int | None = 4096,
    screen_tokens: int = 1024,
    screen_keep: int = 2,
    guard_tokens: int = 1024,
    protect: dict[str, torch.Tensor] | None = None,
    protect_share: float = 0.0,
    outputs: dict[str, torch.Tensor] | None = None,
    duo: bool = False,
    compute: torch.dtype = torch.float32,
    sequences: dict[str, SequenceProbe] | None = None,
    sampled: frozenset[str] = frozenset(),
) -> dict[str, QuantizedWeight]:
    """AWQ-quantize every linear of `layer`; returns the codes per linear name.

    inputs: float activations entering each group's first linear, [n_tokens, in],
    captured from the float layer before any scaling. The layer is modified in
    place: scales are folded into its norms/linears (float function unchanged).
    n_grid: alpha steps in [0, 1); clip_grid: clip factors in [1 - max_shrink, 1]
    (max_shrink=0 disables clipping); sample_tokens: evenly spaced tokens used for
    the searches (None: all); screen_tokens, screen_keep: see `search_scale` (0: every
    candidate scored on every token); guard_tokens: evenly spaced tokens on which each
    output row's clipped weights must not raise the row's whole output error (see
    `guard_clip`; 0: no guard); protect: per linear, the inputs [n, in] of tokens left out
    of the searches whose outputs the clips must not worsen either (attention sinks);
    protect_share: the share of all calibration tokens they stand for: the scales' activation
    statistic mean|x| counts them at that share (left out of it, channels that only the sinks
    use get scales < 1 and the sinks' outputs through them lose their precision);
    outputs: per inspected module (a group's `inspect`, e.g. "mlp"), its float output on the
    tokens of `inputs` (row for row), where the caller's forward already computed it: the
    scale search's reference, not computed again; duo: the scale candidates of AutoAWQ's
    and llm-compressor's default ("duo scaling", see `search_scale`); compute: the dtype an
    inspected module's matrix products run in when candidates are scored (as the caller's
    forward that produced `outputs`, see `LayerRunner`); sequences: per inspected module that
    mixes tokens (a group with `whole_sequences`, e.g. "self_attn"), whole calibration
    sequences to score its group's candidates on; a group whose module has none is scored by
    its linears' outputs on the sample; sampled: linears whose `inputs` hold the `protect`
    tokens at their rate (their inputs to them are not massive): their scale search still
    admits candidates by the protected tokens' error, but the clip guard leaves them to the
    sample's whole-output check.
    """
    sequences = sequences or {}
    groups = scale_groups(model_type)
    _check_options(n_grid, clip_grid, max_shrink, sample_tokens)
    if guard_tokens < 0:
        raise InvalidParameterError(f"guard_tokens must be >= 0, got {guard_tokens}")
    if screen_tokens < 0 or screen_keep < 1:
        raise InvalidParameterError(
            f"screen_tokens must be >= 0 and screen_keep >= 1, got {screen_tokens}, {screen_keep}"
        )
    screen = (screen_tokens, screen_keep)
    with torch.no_grad():
        # check everything before the first fold, so a bad call leaves the layer as it was
        pairs = [_group_input(inputs, g, sample_tokens, outputs) for g in groups]
        xs, refs = [p[0] for p in pairs], [p[1] for p in pairs]  # [n, in], [n, out] | None
        for name in (name for group in groups for name in group.linears):
            config.for_features(layer.get_submodule(name).in_features)
        if not 0 <= protect_share < 1:
            raise InvalidParameterError(f"protect_share must be in [0, 1), got {protect_share}")
        # each group's protected inputs, float32 once: [m, in] or None
        sinks = [(protect or {}).get(g.linears[0]) for g in groups]
        sinks = [None if t is None else t.float() for t in sinks]
        scales = [
            _scale_group(
                layer, g, x, config, n_grid, screen, _mean_abs(x, t, protect_share), t, ref, duo,
                compute, sequences.get(g.inspect) if g.whole_sequences else None,
            )
            for g, x, t, ref in zip(groups, xs, sinks, refs, strict=True)
        ]
        out: dict[str, QuantizedWeight] = {}
        for group, x, s in zip(groups, xs, scales, strict=True):  # after all folds: final weights
            x = x / s  # what the group's linears see once 1/s is folded before them
            for name in group.linears:
                w = layer.get_submodule(name).weight
                clip = search_clip(w, x, config, clip_grid, max_shrink)
                if guard_tokens:
                    keep = protect.get(name) if protect and name not in sampled else None
                    keep = None if keep is None else keep.float() / s
                    clip = guard_clip(w, _evenly(x, guard_tokens), config, clip, keep)
                out[name] = quantize_rtn(w, config.for_features(w.shape[1]), clip=clip)
    return out


def scale_groups(model_type: str) -> list[ScaleGroup]:
    """The architecture's scale groups, data in its models/ file."""
    family = get_model_module(model_type)
    mixing = set(getattr(family, "AWQ_SEQUENCE_MODULES", ()))
    return [
        ScaleGroup(prev, list(linears), inspect, inspect in mixing)
        for prev, linears, inspect in family.AWQ_SCALE_GROUPS
    ]


def _check_options(n_grid: int, clip_grid: int, max_shrink: float, sample_tokens: int | None):
    if n_grid < 1 or clip_grid < 1:
        raise InvalidParameterError(
            f"grids need >= 1 step, got n_grid={n_grid}, clip_grid={clip_grid}"
        )
    if not 0 <= max_shrink < 1:
        raise InvalidParameterError(f"max_shrink must be in [0, 1), got {max_shrink}")
    if sample_tokens is not None and sample_tokens < 1:
        raise InvalidParameterError(f"sample_tokens must be positive or None, got {sample_tokens}")


def _group_input(
    inputs: dict[str, torch.Tensor],
    group: ScaleGroup,
    n: int | None,
    outputs: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The group's float inputs [n_tokens, in] as float32, subsampled to n tokens, and its
    inspected module's outputs on them [n_tokens, out] where `outputs` has them."""
    name = group.linears[0]
    if name not in inputs:
        raise InvalidParameterError(f"AWQ needs the captured inputs of {name!r}")
    x = inputs[name].detach().float()
    x = x.reshape(-1, x.shape[-1])  # [n_tokens, in]
    ref = (outputs or {}).get(group.inspect) if group.inspect else None
    if ref is not None:
        ref = ref.detach().float().reshape(-1, ref.shape[-1])
        if ref.shape[0] != x.shape[0]:
            raise InvalidParameterError(
                f"{ref.shape[0]} outputs of {group.inspect!r} for {x.shape[0]} inputs"
            )
    idx = None if n is None else _evenly_index(x.shape[0], n)
    if idx is None:
        return x, ref
    return x[idx], None if ref is None else ref[idx]


def _mean_abs(x: torch.Tensor, sinks: torch.Tensor | None, share: float) -> torch.Tensor:
    """mean|x| [in] over all calibration tokens: the sample's, mixed with the protected
    tokens' (sinks [m, in]) at their share."""
    mean = x.abs().mean(0)
    if sinks is None or not sinks.shape[0] or share == 0:
        return mean
    return (1 - share) * mean + share * sinks.abs().mean(0)


def _scale_group(
    layer: nn.Module,
    group: ScaleGroup,
    x: torch.Tensor,
    config: QuantConfig,
    n_grid: int,
    screen: tuple[int, int] = (0, 1),
    x_mean: torch.Tensor | None = None,
    protect: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    duo: bool = False,
    compute: torch.dtype = torch.float32,
    probe: SequenceProbe | None = None,
) -> torch.Tensor:  # s [in]
    """Search the group's scales and fold them in; ones when the shapes forbid folding."""
    prev = layer.get_submodule(group.prev)
    linears = [layer.get_submodule(n) for n in group.linears]
    width = prev.out_features if isinstance(prev, nn.Linear) else prev.weight.numel()
    heads = None
    if any(lin.in_features != width for lin in linears):
        heads = _kv_heads(layer, group, prev, linears)
        if heads is None:
            log.info(
                "AWQ skips %s -> %s: %d outputs cannot scale %d inputs",
                group.prev, ",".join(group.linears), width, linears[0].in_features,
            )  # fmt: skip
            return torch.ones(x.shape[1], device=x.device)
    tie = None if heads is None else lambda s: _tie(s, heads)
    s = search_scale(
        layer, group, x, config, n_grid, *screen, x_mean=x_mean, protect=protect, ref=ref,
        duo=duo, tie=tie, compute=compute, probe=probe,
    )  # fmt: skip
    fold_scale(prev, linears, s, None if heads is None else _first_head(s, heads))
    return s


def _kv_heads(layer, group, prev, linears) -> tuple[int, int, int] | None:
    """Grouped-query attention: (KV heads, query heads per KV head, head dim) where `prev` is
    v_proj and the linears take the attention's output (o_proj), else None. o's input
    (head h, dim d) is v's output (h // r, d), so o's columns can take scales tied across
    the r query heads of each KV head, and v's rows 1 / s: the float function is unchanged.
    AutoAWQ and llm-compressor skip this pair under GQA; on SmolLM2 (9 heads over 3) the
    tied scales lowered o_proj's output error to 0.54-0.99x plain RTN's, layer by layer."""
    attn = layer.get_submodule(group.prev.rpartition(".")[0]) if "." in group.prev else layer
    h, kv, hd = (getattr(attn, a, 0) for a in ("n_heads", "n_kv_heads", "head_dim"))
    if not isinstance(prev, nn.Linear) or not (h and kv and hd) or h % kv:
        return None
    if prev.out_features != kv * hd or any(lin.in_features != h * hd for lin in linears):
        return None
    return kv, h // kv, hd


def _tie(s: torch.Tensor, heads: tuple[int, int, int]) -> torch.Tensor:
    """s [H * hd] -> each KV head's mean over its r query heads, repeated to [H * hd]."""
    kv, r, hd = heads
    return s.view(kv, r, hd).mean(1, keepdim=True).expand(kv, r, hd).reshape(kv * r * hd)


def _first_head(s: torch.Tensor, heads: tuple[int, int, int]) -> torch.Tensor:
    """Tied s [H * hd] -> the value each v output carries [KV * hd] (exactly, no mean)."""
    kv, r, hd = heads
    return s.view(kv, r, hd)[:, 0].reshape(kv * hd)


def search_scale(
    layer: nn.Module,
    group: ScaleGroup,
    x: torch.Tensor,
    config: QuantConfig,
    n_grid: int,
    screen_tokens: int = 0,
    screen_keep: int = 2,
    x_mean: torch.Tensor | None = None,
    protect: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    duo: bool = False,
    tie=None,
    compute: torch.dtype = torch.float32,
    probe: SequenceProbe | None = None,
) -> torch.Tensor:  # s [in]
    """Grid-search s = mean|x|^alpha, alpha in [0, 1), minimising the group's output MSE
    on x (mean|x| over x unless `x_mean` gives it). With `duo`, s = mean|x|^alpha /
    mean|w|^(1 - alpha) as AutoAWQ's and llm-compressor's default ("duo scaling"; mean|w|
    per input channel over the group's weights, each weight group scaled to a maximum of
    1), except that alpha 0 stays plain RTN (s = 1) rather than 1 / mean|w|. With
    `protect` [m, in] (tokens left out of x: the attention sinks), only candidates whose
    output error on those tokens stays within SINK_SLACK of plain RTN's (alpha 0) are
    admitted.

    Where a candidate's loss costs time in proportion to the tokens (a module's output, or
    a linear wider than the tokens, such as down_proj), every candidate is first scored on
    `screen_tokens` evenly spaced tokens, and only the `screen_keep` best of them (plain RTN,
    alpha 0, among them only if it screens so) are scored on all of x: on Qwen 1.5B the
    MLP's candidates cost 1.7 s each on 4096 tokens, 0.4 s on 1024 (a fifth of a layer's
    time went to scoring the best three and RTN on all tokens). screen_tokens=0 or >= the
    tokens: all on all.
    `ref`: the inspected module's float output on x, where the caller has it (else computed
    here, once: the screening tokens' is a part of it). `tie`: s -> s with the entries that
    must share one value averaged (see `_kv_heads`), applied to every candidate. `compute`:
    the dtype an inspected module's matrix products run in (see `LayerRunner`). `probe`:
    whole sequences on which every candidate is scored instead, by the inspected module's
    output (which mixes tokens) on its tokens other than the sinks, the sinks' admitting
    (x still gives mean|x|; `protect` is then unused).
    """
    linears = [layer.get_submodule(n) for n in group.linears]
    weights = [lin.weight.float() for lin in linears]  # [out_i, in]
    x_mean = x.abs().mean(0) if x_mean is None else x_mean  # [in]
    w_mean = _weight_mean(weights, config) if duo else None
    cands = []
    for i in range(n_grid):
        s = x_mean.pow(i / n_grid)
        if w_mean is not None and i > 0:
            s = s / (w_mean.pow(1 - i / n_grid) + 1e-4)
        s = s.clamp(min=1e-4) if tie is None else tie(s.clamp(min=1e-4))
        cands.append(s / (s.max() * s.min()).sqrt())  # centre around 1: neither side overflows

    def quantized(s: torch.Tensor) -> list[torch.Tensor]:
        return [fake_quantize(w, config, col_scale=s) for w in weights]

    if probe is not None:
        score = _probe_score(layer, group, probe, weights, compute)
        screened = False
    else:
        group = group.on_tokens
        if group.inspect is not None and ref is None:
            ref = _inspected(layer, group, compute)(x)
        loss_fn = _loss_fn(layer, group, x, weights, ref, compute)
        screened = 0 < screen_tokens < x.shape[0] and _costs_per_token(group, x)
        screened = screened and n_grid > screen_keep
        # one pass over the candidates, one fake quantization each: the sinks' error
        # (admission) and the loss on all tokens, or on the screening tokens when screened
        first_fn = loss_fn
        if screened:
            idx = _evenly_index(x.shape[0], screen_tokens)
            first_fn = _loss_fn(
                layer, group, x[idx], weights, None if ref is None else ref[idx], compute
            )
        sink_fn = None
        if protect is not None and protect.shape[0]:
            sink_fn = _loss_fn(layer, group, protect.float(), weights, compute=compute)

        def score(q: list[torch.Tensor]) -> tuple[float, float | None]:
            return first_fn(q), None if sink_fn is None else sink_fn(q)

    first, sink = {}, {}
    for i, s in enumerate(cands):
        first[i], e = score(quantized(s))
        if e is not None:
            sink[i] = e
    admitted = [i for i in first if not sink or sink[i] <= sink[0] * (1 + SINK_SLACK)]
    if screened:
        kept = sorted(admitted, key=lambda i: (first[i], i))[:screen_keep]
        losses = {i: loss_fn(quantized(cands[i])) for i in sorted(kept)}
    else:
        losses = {i: first[i] for i in admitted}
    best = min(losses, key=lambda i: (losses[i], i))  # the smaller alpha on ties
    # against RTN on the tokens both were scored on (the screening ones, when screened)
    ratio = first[best] / first[0] if first[0] > 0 else 1.0
    free = min(first, key=lambda i: (first[i], i))  # unconstrained by the sinks
    log.info(
        "AWQ %s: alpha %.2f, output error %.3fx RTN (%d of %d admitted by the sinks; "
        "best without them: alpha %.2f, %.3fx RTN)",
        group.prev, best / n_grid, ratio, len(admitted), len(first), free / n_grid,
        first[free] / first[0] if first[0] > 0 else 1.0,
    )  # fmt: skip
    return cands[best]


def _probe_score(
    layer: nn.Module,
    group: ScaleGroup,
    probe: SequenceProbe,
    weights: list[torch.Tensor],
    compute: torch.dtype = torch.float32,
):
    """Candidate weights -> (output MSE of the inspected module over the probe's tokens other
    than the sinks, that over the sinks or None), against its output with `weights`."""
    module = layer.get_submodule(group.inspect)
    prefix = group.inspect + "."
    names = [n.removeprefix(prefix) + ".weight" for n in group.linears]
    dtype = layer.get_submodule(group.linears[0]).weight.dtype
    xd = probe.x.to(dtype)
    sinks = probe.sinks.to(torch.bool)
    if sinks.shape != (xd.shape[0],):
        raise InvalidParameterError(f"probe sinks {tuple(sinks.shape)} for {xd.shape[0]} tokens")
    keep = ~sinks

    def run(cand: list[torch.Tensor]) -> torch.Tensor:
        params = {n: c.to(dtype) for n, c in zip(names, cand, strict=True)}
        with compute_autocast(compute):
            return functional_call(module, params, (xd, *probe.args)).float()

    ref = run(weights)

    def score(cand: list[torch.Tensor]) -> tuple[float, float | None]:
        err = (run(cand) - ref).pow(2).mean(1)  # [T]
        return float(err[keep].mean()), float(err[sinks].mean()) if sinks.any() else None

    return score


def _weight_mean(weights: list[torch.Tensor], config: QuantConfig) -> torch.Tensor:
    """Per input channel, the mean over the group's rows of |w| / (its weight group's max |w|
    + 1e-6): how large each input's weights are within their quantization groups [in]."""
    w = torch.cat(weights)  # [sum out, in]
    out, inp = w.shape
    cfg = config.for_features(inp)
    wg = w.abs().view(out, cfg.groups(inp), cfg.group_len(inp))
    return (wg / (wg.amax(-1, keepdim=True) + 1e-6)).view(out, inp).mean(0)


# a scale candidate may raise the protected (sink) tokens' output error by this share over RTN's
SINK_SLACK = 0.0


def _costs_per_token(group: ScaleGroup, x: torch.Tensor) -> bool:
    """Whether `_loss_fn` runs over the tokens (else through their Gram matrix, once)."""
    return group.inspect is not None or x.shape[0] < x.shape[1]


def _inspected(layer: nn.Module, group: ScaleGroup, compute: torch.dtype = torch.float32):
    """x -> the group's inspected module's float32 output on x (in the layer's dtype, its
    products in `compute`)."""
    module = layer.get_submodule(group.inspect)
    dtype = layer.get_submodule(group.linears[0]).weight.dtype

    def run(x: torch.Tensor) -> torch.Tensor:
        with compute_autocast(compute):
            return module(x.to(dtype)).float()

    return run


def _loss_fn(
    layer: nn.Module,
    group: ScaleGroup,
    x: torch.Tensor,
    weights: list[torch.Tensor],
    ref: torch.Tensor | None = None,
    compute: torch.dtype = torch.float32,
):
    """Output MSE of candidate weights (acting on the unscaled x) against the float weights
    (for an inspected module: against `ref`, its float output on x, computed if not given,
    the module's products in `compute`)."""
    group = group.on_tokens
    if group.inspect is None:
        # mean over tokens and outputs of (x d^T)^2 = sum((d @ G) * d) / n_out with G = x^T x / n:
        # through the Gram matrix when the tokens outnumber the inputs (2 out in^2 flops per
        # candidate), else directly (2 n in out: 2.2x fewer for a 8960-wide down_proj at 4096)
        n_out = sum(w.shape[0] for w in weights)
        if x.shape[0] < x.shape[1]:

            def direct(cand: list[torch.Tensor]) -> float:
                ds = [c - w for c, w in zip(cand, weights, strict=True)]
                return float(sum((x @ d.T).pow(2).sum() for d in ds) / (x.shape[0] * n_out))

            return direct
        gram = x.T @ x / x.shape[0]  # [in, in]

        def loss(cand: list[torch.Tensor]) -> float:
            ds = [c - w for c, w in zip(cand, weights, strict=True)]
            return float(sum(((d @ gram) * d).sum() for d in ds) / n_out)

        return loss
    module = layer.get_submodule(group.inspect)
    prefix = group.inspect + "."
    names = [n.removeprefix(prefix) + ".weight" for n in group.linears]
    dtype = layer.get_submodule(group.linears[0]).weight.dtype
    xd = x.to(dtype)
    ref = _inspected(layer, group, compute)(x) if ref is None else ref

    def loss(cand: list[torch.Tensor]) -> float:
        params = {n: c.to(dtype) for n, c in zip(names, cand, strict=True)}
        with compute_autocast(compute):
            y = functional_call(module, params, (xd,))
        return float((y.float() - ref).pow(2).mean())

    return loss


def fold_scale(
    prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor, prev_s: torch.Tensor | None = None
) -> None:
    """W <- W * s (input columns), prev <- prev / s: the float function is unchanged.
    prev_s: what prev divides by where its outputs feed several inputs each (default s)."""
    p = s if prev_s is None else prev_s
    _mul_(prev.weight, (1 / p)[:, None] if isinstance(prev, nn.Linear) else 1 / p)
    if getattr(prev, "bias", None) is not None:
        _mul_(prev.bias, 1 / p)
    for lin in linears:
        _mul_(lin.weight, s[None, :])


def _mul_(p: torch.Tensor, factor: torch.Tensor) -> None:
    p.copy_(p.float() * factor)  # in float32 whatever p's dtype, one rounding


def fake_quantize(
    w: torch.Tensor,
    config: QuantConfig,
    clip: torch.Tensor | float = 1.0,
    col_scale: torch.Tensor | None = None,
    group_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """RTN quantize-dequantize of w [out, in] (no codes, no error bookkeeping): float32
    [out, in], equal to `quantize_rtn(w, config, clip).dequantize()` value for value. With
    `col_scale` s [in], of w * s, divided by s again (AWQ's candidates); `group_range`: the
    groups' (min, max) [out, n_groups] of what is quantized, when the caller has them. One
    fresh tensor, the rest in place: the searches call this for every candidate."""
    out, inp = w.shape
    config = config.for_features(inp)
    wg = (w.float() * col_scale if col_scale is not None else w.float().clone()).view(
        out, config.groups(inp), config.group_len(inp)
    )
    if group_range is None:
        scale, zero = compute_qparams(wg, config, clip)
    else:
        scale, zero = qparams_of_range(*group_range, config, clip)
    scale = scale[..., None]
    # quantize_values then dequantize, in place: integers are exact in float32
    wg.div_(scale).round_()
    if zero is not None:
        z = zero[..., None].float()
        wg.add_(z).clamp_(config.qmin, config.qmax).sub_(z)
    else:
        wg.clamp_(config.qmin, config.qmax)
    wg.mul_(scale)
    wq = wg.view(out, inp)
    return wq.div_(col_scale) if col_scale is not None else wq


def search_clip(
    w: torch.Tensor, x: torch.Tensor, config: QuantConfig, clip_grid: int, max_shrink: float
) -> torch.Tensor | float:  # [out, n_groups] or 1.0
    """Per weight group, the range shrink in [1 - max_shrink, 1] minimising its output error.

    w [out, in] is the final (scaled) weight and x [n, in] its inputs. A group's error
    is the mean over tokens of its partial output x_g . (w_g - q(w_g))^2, computed from
    the per-group Gram matrix, so memory and time do not grow with the token count.
    """
    if max_shrink == 0 or clip_grid < 2:
        return 1.0
    out, inp = w.shape
    config = config.for_features(inp)
    n_groups, g = config.groups(inp), config.group_len(inp)
    xg = x.float().view(-1, n_groups, g).transpose(0, 1)  # [G, n, g]
    gram = xg.transpose(1, 2) @ xg / x.shape[0]  # [G, g, g]
    best_err = torch.full((out, n_groups), float("inf"), device=w.device)
    best_clip = torch.ones(out, n_groups, device=w.device)
    group_range = torch.aminmax(w.float().view(out, n_groups, g), dim=-1)  # once, not per clip
    for c in torch.linspace(1.0, 1.0 - max_shrink, clip_grid).tolist():
        d = fake_quantize(w, config, c, group_range=group_range).sub_(w).view(out, n_groups, g)
        err = group_output_error(d, gram)  # [out, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_clip = torch.where(better, c, best_clip)
    return best_clip


def guard_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    config: QuantConfig,
    clip: torch.Tensor | float,
    protect: torch.Tensor | None = None,
) -> torch.Tensor | float:
    """Keep a row's searched clip only where it does not raise that row's output error.

    `search_clip` scores each weight group alone, so it cannot see errors that add up across
    a row's groups. On tokens whose inputs line up with the weights that is what happens:
    Qwen2.5-1.5B's layer-2 down_proj writes the first token's massive activation (7,000x
    the other tokens' update), and clipping every group of those rows a little doubles
    that token's output error while lowering the per-group sums. Here the whole output
    error of each row, sum over tokens of (x . d_row)^2, with and without the clip decides;
    with `protect` [m, in] (tokens the searches left out), the row's error on those must not
    rise either.
    """
    if not isinstance(clip, torch.Tensor):
        return clip
    ds = [fake_quantize(w, config, c).sub_(w.float()) for c in (clip, 1.0)]
    keep = torch.ones(w.shape[0], dtype=torch.bool, device=w.device)
    for t in (x, protect):
        if t is not None and t.shape[0]:
            t = t.to(w.device, torch.float32)
            errs = [(t @ d.T).pow_(2).sum(0) for d in ds]
            keep &= errs[0] <= errs[1]
    return torch.where(keep[:, None], clip, torch.ones_like(clip))


def _evenly(x: torch.Tensor, n: int) -> torch.Tensor:
    """n evenly spaced rows of x (all of them when it has no more)."""
    idx = _evenly_index(x.shape[0], n)
    return x if idx is None else x[idx]


def _evenly_index(rows: int, n: int) -> torch.Tensor | None:
    """The indices of n evenly spaced rows of `rows` (None: all of them)."""
    if rows <= n:
        return None
    return torch.linspace(0, rows - 1, n).round().long()


def group_output_error(d: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """mean_t (x_g(t) . d_g)^2 = d_g^T G_g d_g for d [out, G, g], gram [G, g, g]: [out, G]."""
    dt = d.transpose(0, 1)  # [G, out, g]: one batched product per group, no copy of d
    return torch.bmm(dt, gram).mul_(dt).sum(-1).T
