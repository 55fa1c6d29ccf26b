"""QuantLinear: a Linear whose weight stays packed (compressed-tensors layout) at run time.

Buffers carry the checkpoint's names, so a model built on `meta`, passed through
`swap_linears` and loaded with `load_state_dict(assign=True)` runs the checkpoint
as stored. `forward` takes the fast path (torch's CPU int4 kernel, see
`kernels.int4_matmul`) when it can, else the dequantize-then-matmul reference.
"""

from __future__ import annotations

import math
import os
from typing import ClassVar

import torch
from torch import nn

from edgellm.kernels.int4_matmul import (
    Int4Weight,
    dequantize_matmul,
    dequantize_weight,
    int4_matmul,
    kernel_group,
    prepare_int4,
)
from edgellm.quantize.format import unpack_int32
from edgellm.quantize.rtn import QuantConfig


class QuantLinear(nn.Module):
    """y = x @ ((q - zero) * scale).T + bias with q packed into int32 words."""

    # False (or EDGELLM_QUANT_REFERENCE=1): always dequantize-then-matmul, for tests and debugging
    use_fast: ClassVar[bool] = os.environ.get("EDGELLM_QUANT_REFERENCE", "") in ("", "0")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        qconfig: QuantConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.qconfig = in_features, out_features, qconfig
        bits, groups = qconfig.bits, qconfig.groups(in_features)
        empty = dict(device=device)
        # [out, ceil(in*bits/32)] int32: codes + 2^(bits-1) as a dense bit stream per row
        self.register_buffer(
            "weight_packed",
            torch.empty(
                out_features, math.ceil(in_features * bits / 32), dtype=torch.int32, **empty
            ),
        )
        self.register_buffer(
            "weight_scale", torch.empty(out_features, groups, dtype=dtype, **empty)
        )
        self.register_buffer("weight_shape", torch.empty(2, dtype=torch.int64, **empty))
        if not qconfig.symmetric:  # [ceil(out*bits/32), groups]: packed along the output rows
            zp_rows = math.ceil(out_features * bits / 32)
            self.register_buffer(
                "weight_zero_point", torch.empty(zp_rows, groups, dtype=torch.int32, **empty)
            )
        else:
            self.weight_zero_point = None
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, **empty)) if bias else None
        self._fast: Int4Weight | None = None  # the kernel's repacked weight, built on first use
        self._dense: torch.Tensor | None = None  # fallback when the kernel cannot take the layer

    def codes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Signed codes int8 [out, in] and zero points int8 [out, n_groups] (None if symmetric)."""
        bits = self.qconfig.bits
        q = unpack_int32(self.weight_packed, bits, self.in_features)
        zp = self.weight_zero_point
        return q, None if zp is None else unpack_int32(zp, bits, self.out_features, dim=0)

    def dequantize(self) -> torch.Tensor:  # float32 [out, in]
        q, zero = self.codes()
        return dequantize_weight(q, self.weight_scale, zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if not self.use_fast:
            q, zero = self.codes()
            return dequantize_matmul(x, q, self.weight_scale, zero, self.bias)
        if self._fast is None and self._dense is None:
            self._prepare()
        if self._fast is not None:
            y = int4_matmul(x, self._fast)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return nn.functional.linear(x, self._dense.to(x.dtype), self.bias)

    def _prepare(self) -> None:
        q, zero = self.codes()
        group = self.qconfig.group_len(self.in_features)
        kgroup = kernel_group(self.out_features, group) if self.qconfig.bits == 4 else None
        if kgroup is not None:
            self._fast = prepare_int4(q, self.weight_scale, zero, kgroup)
        else:  # other bit widths / shapes: dequantize once, run dense
            self._dense = dequantize_weight(q, self.weight_scale, zero).to(self.weight_scale.dtype)

    def _load_from_state_dict(self, *args, **kwargs):
        self._fast = self._dense = None  # new tensors: repack on next use
        super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        c = self.qconfig
        kind = "sym" if c.symmetric else "asym"
        return f"in={self.in_features}, out={self.out_features}, int{c.bits} g{c.group_size} {kind}"


def swap_linears(
    model: nn.Module,
    qconfig: QuantConfig,
    ignore: tuple[str, ...] = ("lm_head",),
    include: set[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Replace nn.Linear modules by empty QuantLinear of the same shape, on the same device.

    `ignore` lists module names (or last name parts) kept dense; `include`, when given,
    limits the swap to those full names (e.g. the Linears a checkpoint stores packed).
    Returns the swapped names. Build the model on `meta`, swap, then
    `load_state_dict(..., assign=True)`.
    """
    swapped = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or name in ignore or name.rsplit(".", 1)[-1] in ignore:
            continue
        if include is not None and name not in include:
            continue
        device = mod.weight.device
        cfg = qconfig.for_features(mod.in_features)
        new = QuantLinear(
            mod.in_features, mod.out_features, mod.bias is not None, cfg, dtype, device
        )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        swapped.append(name)
    return swapped
