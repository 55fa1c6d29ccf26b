"""Group-wise round-to-nearest (RTN) integer quantization: the common base of every method.

Convention (compressed-tensors): a weight row is split into groups of `group_size`
input columns; each group has a float `scale` and, when asymmetric, an integer
`zero` point; integer codes are signed, q in [-2^(b-1), 2^(b-1) - 1], and

    w ≈ (q - zero) * scale

Symmetric groups have zero = 0. `group_size=-1` means one group per output row
(per-channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgellm.quantize.format import QuantConfig


@dataclass(slots=True)
class QuantizedWeight:
    """Integer codes and group parameters of one linear weight."""

    q: torch.Tensor  # int8 [out, in], signed
    scale: torch.Tensor  # float32 [out, n_groups]
    zero: torch.Tensor | None  # int8 [out, n_groups], signed; None when symmetric
    config: QuantConfig
    error: float = 0.0  # mean squared reconstruction error against the float weight

    def dequantize(self) -> torch.Tensor:  # float32 [out, in]
        return dequantize(self.q, self.scale, self.zero, self.config)


def compute_qparams(
    w: torch.Tensor,  # [rows, group_len] (or [out, n_groups, group_len])
    config: QuantConfig,
    clip: torch.Tensor | float = 1.0,  # shrink the range (AWQ/GPTQ clip search)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) of each group from its value range: [...], [...]."""
    lo, hi = torch.aminmax(w.float(), dim=-1)  # one pass, no |w| copy
    return qparams_of_range(lo, hi, config, clip)


def qparams_of_range(
    lo: torch.Tensor, hi: torch.Tensor, config: QuantConfig, clip: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`compute_qparams` from each group's min and max [...] (a clip search scans one range
    with many clips)."""
    if config.symmetric:
        amax = torch.maximum(hi, -lo) * clip  # = max |w|, exactly
        # map [-amax, amax] onto [qmin, qmax] centred on zero (amax / 7.5 for 4 bits)
        scale = (2 * amax / (config.qmax - config.qmin)).clamp(min=1e-10)
        return scale, None
    wmax = (hi * clip).clamp(min=0)
    wmin = (lo * clip).clamp(max=0)
    scale = ((wmax - wmin) / (config.qmax - config.qmin)).clamp(min=1e-10)
    zero = (config.qmin - torch.round(wmin / scale)).clamp(config.qmin, config.qmax)
    return scale, zero.to(torch.int8)


def quantize_values(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, config: QuantConfig
) -> torch.Tensor:
    """Codes of w [..., group_len] given per-group scale/zero [...]: int8, signed."""
    q = torch.round(w.float() / scale[..., None])
    if zero is not None:
        q = q + zero[..., None].float()
    return q.clamp(config.qmin, config.qmax).to(torch.int8)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, config: QuantConfig
) -> torch.Tensor:
    """(q - zero) * scale for q [out, in] and group parameters [out, n_groups]."""
    out, inp = q.shape
    g = config.group_len(inp)
    qg = q.view(out, inp // g, g).float()
    if zero is not None:
        qg = qg - zero[..., None].float()
    return (qg * scale[..., None].float()).view(out, inp)


def quantize_rtn(
    w: torch.Tensor, config: QuantConfig, clip: torch.Tensor | float = 1.0
) -> QuantizedWeight:
    """Round-to-nearest of w [out, in]; returns the codes and the reconstruction error."""
    out, inp = w.shape
    wg = w.float().view(out, config.groups(inp), config.group_len(inp))
    scale, zero = compute_qparams(wg, config, clip)
    q = quantize_values(wg, scale, zero, config).view(out, inp)
    qw = QuantizedWeight(q, scale, zero, config)
    qw.error = float((qw.dequantize() - w.float()).pow(2).mean())
    return qw
