"""Compile every Triton kernel for a GPU without one: the pre-flight of the CUDA backend.

Triton's interpreter (the CPU tests) checks what the kernels compute, not that they
compile for a GPU, nor what they cost there. `compile_all` compiles each kernel through
Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the `ptxas` Triton ships)
for a target such as Hopper (sm_90: H100/H200) with the launch configurations our
wrappers choose for typical shapes (SmolLM2-135M and Llama-3-8B sizes), and reads each
cubin's registers, spilled bytes and shared memory with the bundled `cuobjdump`.

    python -m edgellm.kernels.triton_aot            # sm_90; --arch 80 for Ampere

It must run without TRITON_INTERPRET (the interpreter replaces `triton.jit`); the test
suite runs it in a subprocess.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from edgellm.kernels import triton_attention as attn
from edgellm.kernels import triton_fused as fused
from edgellm.kernels import triton_w4a16 as w4

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024, 89: 99 * 1024}  # bytes a block may use
FLOAT_ARGS = {"scale", "eps"}


@dataclass(frozen=True, slots=True)
class Compiled:
    name: str
    registers: int
    spilled: int  # bytes of local memory per thread (register spills)
    shared: int  # bytes of shared memory per block
    seconds: float

    def __str__(self) -> str:
        return (
            f"{self.name:58s} regs {self.registers:3d}  spill {self.spilled:4d} B  "
            f"shared {self.shared / 1024:6.1f} KiB  ({self.seconds:.1f} s)"
        )


def _variants() -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, pointer types, constexprs) in the configurations the wrappers launch."""
    out = []
    w4_ptrs = {"X": "*bf16", "W": "*i32", "S": "*fp32", "Z": "*i8", "B": "*fp32", "OUT": "*bf16"}
    for m, n, k, group, zero in [(1, 4096, 4096, 128, False), (1, 1536, 576, 64, True),
                                 (4, 14336, 4096, 128, False), (16, 4096, 4096, 128, True),
                                 (64, 4096, 14336, 128, False)]:  # fmt: skip
        cfg = w4.launch_config(m, n, k, group, on_gpu=True)
        cfg.pop("split_k")
        out.append((
            f"w4a16 M={m} ({n}, {k}) g{group}{' asym' if zero else ''}", w4._w4a16_kernel,
            w4_ptrs, {"GROUP": group, "HAS_ZERO": zero, "HAS_BIAS": zero, **cfg},
        ))  # fmt: skip
    cfg = w4.launch_config(16, 256, 576, 64, on_gpu=True)
    cfg.pop("split_k")
    out.append((
        "w4a16 M=16 float32 (the tests' path on a GPU)", w4._w4a16_kernel,
        {**w4_ptrs, "X": "*fp32", "OUT": "*fp32"},
        {"GROUP": 64, "HAS_ZERO": True, "HAS_BIAS": True, **cfg},
    ))  # fmt: skip
    out.append((
        "w4a16 split-K reduce", w4._splitk_reduce_kernel,
        {"PART": "*fp32", "B": "*fp32", "OUT": "*bf16"},
        {"SPLITS": 4, "HAS_BIAS": True, "BLOCK": 1024},
    ))  # fmt: skip
    out.append((
        "w4a16 dequantize g128", w4._dequant_kernel,
        {"W": "*i32", "S": "*fp32", "Z": "*i8", "OUT": "*bf16"},
        {"GROUP": 128, "HAS_ZERO": True, "BLOCK_N": 32, "BLOCK_K": 128},
    ))  # fmt: skip
    kv = {"Q": "*bf16", "KC": "*bf16", "VC": "*bf16", "OUT": "*bf16", "BT": "*i32",
          "CTX": "*i32", "QSL": "*i32", "PART_O": "*fp32", "PART_LSE": "*fp32"}  # fmt: skip
    for h, kvh, d in [(9, 3, 64), (32, 8, 128)]:
        g = h // kvh
        for max_q in (1, 512):
            g_pad, block_q = attn.mixed_config(max_q, g)
            out.append((
                f"attention mixed {h}/{kvh}x{d} q<={max_q}", attn._mixed_kernel, kv,
                {"H": h, "KVH": kvh, "G": g, "G_PAD": g_pad, "D": d,
                 "BLOCK_D": triton.next_power_of_2(d), "BLOCK_Q": block_q, "BLOCK_SIZE": 16,
                 "TILE": attn.TILE_N, "Q8": False},
            ))  # fmt: skip
        out.append((
            f"attention split-KV decode {h}/{kvh}x{d}", attn._decode_kernel, kv,
            {"H": h, "KVH": kvh, "G": g, "ROWS": max(16, triton.next_power_of_2(g)), "D": d,
             "BLOCK_D": triton.next_power_of_2(d), "BLOCK_SIZE": 16, "TILE": attn.TILE_N,
             "NUM_SPLITS": 16, "Q8": False},
        ))  # fmt: skip
        out.append((
            f"attention reduce {h}x{d}", attn._reduce_kernel, kv,
            {"H": h, "D": d, "BLOCK_D": triton.next_power_of_2(d), "NUM_SPLITS": 16,
             "SPLITS_PAD": 16},
        ))  # fmt: skip
    # int8 K/V (codes + fp32 scale per row), Llama-3-8B's heads
    kv8 = {**kv, "KC": "*i8", "VC": "*i8"}
    g_pad, block_q = attn.mixed_config(512, 4)
    out.append((
        "attention mixed 32/8x128 int8 K/V", attn._mixed_kernel, kv8,
        {"H": 32, "KVH": 8, "G": 4, "G_PAD": g_pad, "D": 128, "BLOCK_D": 128,
         "BLOCK_Q": block_q, "BLOCK_SIZE": 16, "TILE": attn.TILE_N, "Q8": True},
    ))  # fmt: skip
    out.append((
        "attention split-KV decode 32/8x128 int8 K/V", attn._decode_kernel, kv8,
        {"H": 32, "KVH": 8, "G": 4, "ROWS": 16, "D": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16,
         "TILE": attn.TILE_N, "NUM_SPLITS": 16, "Q8": True},
    ))  # fmt: skip
    fp32 = {k: "*fp32" if v == "*bf16" else v for k, v in kv.items()}
    g_pad, block_q = attn.mixed_config(8, 3)
    out.append((
        "attention mixed 6/2x16 float32 (the tests' path)", attn._mixed_kernel, fp32,
        {"H": 6, "KVH": 2, "G": 3, "G_PAD": g_pad, "D": 16, "BLOCK_D": 16, "BLOCK_Q": block_q,
         "BLOCK_SIZE": 4, "TILE": attn.TILE_N, "Q8": False},
    ))  # fmt: skip
    out += [
        ("rms_norm + residual 4096", fused._rms_norm_kernel,
         {"X": "*bf16", "R": "*bf16", "W": "*bf16", "OUT": "*bf16"},
         {"HAS_RESIDUAL": True, "BLOCK": 4096}),
        ("silu_and_mul", fused._silu_mul_kernel, {"X": "*bf16", "OUT": "*bf16"}, {"BLOCK": 1024}),
        ("rope + cache write 32/8x128", fused._rope_cache_kernel,
         {"QKV": "*bf16", "POS": "*i64", "INV_FREQ": "*fp32", "Q_OUT": "*bf16", "KC": "*bf16",
          "VC": "*bf16", "SLOTS": "*i64"},
         {"H": 32, "KVH": 8, "D": 128, "HALF": 64, "BLOCK_H": 64, "Q8": False}),
        ("rope + int8 cache write 32/8x128", fused._rope_cache_kernel,
         {"QKV": "*bf16", "POS": "*i64", "INV_FREQ": "*fp32", "Q_OUT": "*bf16", "KC": "*i8",
          "VC": "*i8", "SLOTS": "*i64"},
         {"H": 32, "KVH": 8, "D": 128, "HALF": 64, "BLOCK_H": 64, "Q8": True}),
    ]  # fmt: skip
    return out


def _resources(cubin: bytes) -> tuple[int, int, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", text))
    return int(fields["REG"]), int(fields["LOCAL"]), int(fields["SHARED"])


def compile_all(arch: int = 90) -> list[Compiled]:
    """Compile every kernel variant for sm_`arch`; raises on a compile error."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    target = GPUTarget("cuda", arch, 32)
    results = []
    for name, kernel, ptrs, consts in _variants():
        signature, constexprs = {}, {}
        for i, param in enumerate(kernel.params):
            arg = param.name
            if param.is_constexpr:
                signature[arg] = "constexpr"
                constexprs[(i,)] = consts[arg]
            elif arg in ptrs:
                signature[arg] = ptrs[arg]
            else:
                signature[arg] = "fp32" if arg in FLOAT_ARGS else "i32"
        t0 = time.perf_counter()
        options = {"num_warps": consts["num_warps"]} if "num_warps" in consts else None
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs), target=target, options=options
        )
        regs, local, _ = _resources(compiled.asm["cubin"])
        shared = max(compiled.metadata.shared, 0)
        results.append(Compiled(name, regs, local, shared, time.perf_counter() - t0))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    args = ap.parse_args()
    results = compile_all(args.arch)
    for r in results:
        print(r)
    limit = SHARED_LIMIT.get(args.arch, 48 * 1024)
    bad = [r for r in results if r.spilled or r.shared > limit]
    if bad:
        raise SystemExit(f"{len(bad)} kernel(s) spill registers or exceed shared memory")
    print(f"{len(results)} kernels compiled for sm_{args.arch}: no spills, shared memory fits")


if __name__ == "__main__":
    main()
