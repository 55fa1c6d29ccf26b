"""Which of vLLM's fast INT GPU kernels will take a checkpoint, at each tensor-parallel size.

vLLM serves compressed-tensors W4A16 checkpoints (ours) through mixed-precision kernels it
chooses per linear layer at load. The two fast ones have shape and group rules (vLLM's
`marlin_utils.py` and `machete_utils.py`; see README "Beyond one machine"):

- Marlin (Ampere or newer, sm80+): 4 or 8 bits without zero points, 4 bits with them; group
  size -1 (per channel), 32, 64 or 128; per rank, output features a multiple of 64 and input
  features a multiple of 128, and the group divides the rank's input features.
- Machete (Hopper, sm90): 4 or 8 bits; group size -1 or 128; per rank, input features a
  multiple of 64 and output features a multiple of 128.

vLLM fuses q|k|v and gate|up into one linear each. Tensor parallelism splits the outputs of
those (column-parallel) and the inputs of o_proj and down_proj (row-parallel); with fewer KV
heads than ranks, each rank keeps one (replicated) KV head. A checkpoint neither kernel takes
falls back to slower kernels where vLLM has one for its shapes, or fails to load. Depends on
nothing else in quantize/ but the format.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgellm.quantize.format import QuantConfig


class VllmKernelWarning(UserWarning):
    """A checkpoint vLLM's fast GPU kernels will not take (it still loads elsewhere)."""


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    gpus: str
    bits_sym: tuple[int, ...]
    bits_asym: tuple[int, ...]
    groups: tuple[int, ...]
    in_multiple: int  # input features per rank
    out_multiple: int  # output features per rank


MARLIN = Kernel("Marlin", "Ampere or newer (sm80+)", (4, 8), (4,), (-1, 32, 64, 128), 128, 64)
MACHETE = Kernel("Machete", "Hopper (sm90)", (4, 8), (4, 8), (-1, 128), 64, 128)
KERNELS = (MARLIN, MACHETE)


def tensor_parallel_sizes(args, limit: int = 8) -> list[int]:
    """The tensor-parallel sizes vLLM can split this model over (up to `limit`): the query
    heads and MLP width divide evenly, and KV heads divide evenly or are replicated."""

    kv = args.num_key_value_heads
    return [
        tp
        for tp in (1, 2, 4, 8, 16)
        if tp <= limit
        and args.num_attention_heads % tp == 0
        and args.intermediate_size % tp == 0
        and (kv % tp == 0 or tp % kv == 0)
    ]


def rank_linears(args, tp: int = 1) -> list[tuple[str, int, int, int]]:
    """(name, whole input features, input and output features on one rank) of each
    quantized linear as vLLM builds it."""

    hd, hidden, inter = args.head_dim, args.hidden_size, args.intermediate_size
    q = args.num_attention_heads * hd
    kv = max(1, args.num_key_value_heads // tp) * hd
    return [
        ("qkv_proj", hidden, hidden, q // tp + 2 * kv),
        ("o_proj", q, q // tp, hidden),
        ("gate_up_proj", hidden, hidden, 2 * inter // tp),
        ("down_proj", inter, inter // tp, hidden),
    ]


def blockers(kernel: Kernel, args, qconfig: QuantConfig, tp: int = 1) -> list[str]:
    """Why `kernel` will not take the checkpoint at tensor-parallel size `tp` ([] if it will)."""

    out: list[str] = []
    bits = kernel.bits_sym if qconfig.symmetric else kernel.bits_asym
    if qconfig.bits not in bits:
        kind = "symmetric" if qconfig.symmetric else "asymmetric (zero points)"
        out.append(f"{qconfig.bits}-bit {kind} weights (takes {', '.join(map(str, bits))} bits)")
    per = " per rank" if tp > 1 else ""
    for name, whole, k, n in rank_linears(args, tp):
        g = qconfig.for_features(whole).group_size  # what the checkpoint stores for it
        if g not in kernel.groups:
            out.append(f"{name}: group size {g} (takes {', '.join(map(str, kernel.groups))})")
        elif g != -1 and k % g:
            out.append(f"{name}: group size {g} does not divide its {k} input features{per}")
        if k % kernel.in_multiple:
            out.append(f"{name}: {k} input features{per}, not a multiple of {kernel.in_multiple}")
        if n % kernel.out_multiple:
            out.append(f"{name}: {n} output features{per}, not a multiple of {kernel.out_multiple}")
    return out


@dataclass(slots=True)
class KernelFit:
    kernel: Kernel
    tp_sizes: list[int]  # tensor-parallel sizes the kernel takes
    blockers: list[str]  # at tensor-parallel size 1


def vllm_kernel_fit(args, qconfig: QuantConfig, limit: int = 8) -> list[KernelFit]:
    """For each fast kernel: the tensor-parallel sizes it takes and why not at size 1."""

    sizes = tensor_parallel_sizes(args, limit)
    return [
        KernelFit(k, [tp for tp in sizes if not blockers(k, args, qconfig, tp)],
                  blockers(k, args, qconfig, 1))
        for k in KERNELS
    ]  # fmt: skip


def vllm_warning(args, qconfig: QuantConfig) -> str | None:
    """One message when a fast kernel will not take the checkpoint on one GPU (Marlin
    refusing is enough: it is the kernel for every GPU before Hopper); None when both do.
    Tensor-parallel sizes that lose a kernel are named as well."""

    fits = vllm_kernel_fit(args, qconfig)
    parts = []
    for f in fits:
        if f.blockers:
            more = f"; and {len(f.blockers) - 3} more" if len(f.blockers) > 3 else ""
            parts.append(f"{f.kernel.name} ({f.kernel.gpus}): {'; '.join(f.blockers[:3])}{more}")
    if parts:
        return (
            "vLLM's fast INT GPU kernels will not take this checkpoint: " + " | ".join(parts)
            + ". On GPUs vLLM falls back to a slower kernel where one fits these shapes, or "
            "refuses to load it; its CPU build is not affected."
        )  # fmt: skip
    sizes = tensor_parallel_sizes(args)
    lost = [
        f"{f.kernel.name} not at tensor-parallel size {', '.join(map(str, sorted(set(sizes) - set(f.tp_sizes))))}"
        for f in fits
        if set(sizes) - set(f.tp_sizes)
    ]  # fmt: skip
    if lost:
        return "vLLM's fast INT GPU kernels take this checkpoint on one GPU; " + "; ".join(lost)
    return None


def describe_fit(args, qconfig: QuantConfig) -> dict:
    """What the checkpoint records: per kernel, the tensor-parallel sizes it takes."""

    return {
        f.kernel.name.lower(): {"tensor_parallel": f.tp_sizes, "blockers": f.blockers}
        for f in vllm_kernel_fit(args, qconfig)
    }
