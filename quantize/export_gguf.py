"""Export to GGUF (llama.cpp) without re-quantizing: one INT4 group = whole Q4_0/Q4_1 blocks.

Our codes are signed, q in [-8, 7], with w = (q - zero) * scale per group (see
`quantize.rtn`). A group of 32·k columns becomes k GGUF blocks that share its scale:

    symmetric 4-bit  -> Q4_0: nibble = q + 8, d = scale           (w = (nibble - 8) * d)
    asymmetric 4-bit -> Q4_1: nibble = q + 8, d = scale,
                              m = -(zero + 8) * scale              (w = nibble * d + m)
    symmetric 8-bit  -> Q8_0: int8 = q, d = scale                  (w = q * d)

Only `d` and `m` are rounded (to fp16); every code is copied. Float models export to
F16 or Q8_0. Tensors are produced one at a time (header first, then data), so memory
stays at about one tensor; the file appears under its name only when complete.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import torch
from rich.progress import Progress

from edgellm.errors import InvalidParameterError
from edgellm.fsutil import atomic_path, check_output
from edgellm.loaders.gguf import gguf_name
from edgellm.loaders.gguf_tokenizer import gguf_vocab
from edgellm.loaders.model import LoadedModel, load_model
from edgellm.models import gguf_architecture
from edgellm.models.llama import rope_inv_freq
from edgellm.quantize.format import read_quant_config, unpack_int32
from edgellm.quantize.rtn import QuantConfig, dequantize
from edgellm.registry import cache_dir, resolve_model

Q = gguf.GGMLQuantizationType
EXPORT_TYPES = ("auto", "q4_0", "q4_1", "q8_0", "f16")
EXPORT_VERSION = "1"  # bump when the writer's output changes: invalidates cached exports
DENSE_TYPES = ("auto", "f16", "q8_0")
BLOCK = 32  # Q4_0, Q4_1 and Q8_0 all use blocks of 32 weights

FILE_TYPES = {
    Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    Q.F16: gguf.LlamaFileType.MOSTLY_F16,
}
_FLOAT_TYPES = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}


# ---- blocks -------------------------------------------------------------------------------


def _fp16(x: torch.Tensor) -> np.ndarray:  # [..., 1] float -> [..., 2] uint8
    return x.to(torch.float16).numpy().view(np.uint8)


def _group_params(scale: torch.Tensor, zero: torch.Tensor | None, in_features: int):
    """Per-block scale (and zero) [out, in/32] from per-group [out, n_groups]."""
    group = in_features // scale.shape[1]
    if group % BLOCK:
        raise InvalidParameterError(
            f"group size {group} is not a multiple of {BLOCK}: GGUF blocks cannot hold it exactly"
        )
    rep = group // BLOCK
    zero = None if zero is None else zero.repeat_interleave(rep, dim=1)
    return scale.float().repeat_interleave(rep, dim=1), zero


def _nibbles(q: torch.Tensor) -> np.ndarray:
    """Signed 4-bit codes [out, nb, 32] -> GGUF qs [out, nb, 16]: byte j = u[j] | u[j+16] << 4."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., :16] | (u[..., 16:] << 4)).numpy()


def int_blocks(
    q: torch.Tensor,  # int8 [out, in], signed codes
    scale: torch.Tensor,  # [out, n_groups]
    zero: torch.Tensor | None,  # int8 [out, n_groups] or None (symmetric)
    bits: int,
    qtype: Q,
) -> np.ndarray:
    """The bytes of one quantized weight as GGUF blocks: uint8 [out, in/32 * block_bytes]."""
    out, inp = q.shape
    s, z = _group_params(scale, zero, inp)
    d = s[..., None]  # [out, nb, 1]
    qb = q.view(out, inp // BLOCK, BLOCK)
    if qtype == Q.Q4_0 and bits == 4 and z is None:
        parts = [_fp16(d), _nibbles(qb)]
    elif qtype == Q.Q4_1 and bits == 4:
        m = -(8 + (0 if z is None else z.float()[..., None])) * d
        parts = [_fp16(d), _fp16(m), _nibbles(qb)]
    elif qtype == Q.Q8_0 and bits == 8 and z is None:
        parts = [_fp16(d), qb.numpy().view(np.uint8)]
    else:
        kind = "symmetric" if zero is None else "asymmetric"
        raise InvalidParameterError(
            f"a {kind} {bits}-bit checkpoint cannot be written as {qtype.name} without "
            "re-quantizing; use --type auto (or f16)"
        )
    return np.concatenate(parts, axis=-1).reshape(out, -1)


def exact_type(bits: int, symmetric: bool) -> Q:
    """The GGUF type that holds a checkpoint's groups exactly."""
    if bits == 4:
        return Q.Q4_0 if symmetric else Q.Q4_1
    if bits == 8 and symmetric:
        return Q.Q8_0
    raise InvalidParameterError(
        f"no GGUF block type holds {'symmetric' if symmetric else 'asymmetric'} {bits}-bit "
        "groups exactly; use --type f16"
    )


# ---- the tensor plan ----------------------------------------------------------------------


@dataclass
class TensorPlan:
    name: str  # llama.cpp tensor name
    shape: tuple[int, ...]  # logical, rows first ([out, in])
    qtype: Q
    produce: Callable[[], np.ndarray]  # the bytes/values, computed when written

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp's interleaved order (inverse of `unpermute_qk`)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


class GGUFExport:
    """Plans and writes the tensors of one loaded model (`edgellm.loaders.model.LoadedModel`)."""

    def __init__(self, loaded, out_type: str = "auto", dense_type: str = "auto"):

        if out_type not in EXPORT_TYPES:
            raise InvalidParameterError(
                f"unknown GGUF type {out_type!r} (choose from {', '.join(EXPORT_TYPES)})"
            )
        if dense_type not in DENSE_TYPES:
            raise InvalidParameterError(
                f"unknown dense type {dense_type!r} (choose from {', '.join(DENSE_TYPES)})"
            )
        args = loaded.args
        self.loaded, self.args, self.out_type = loaded, args, out_type
        self.dense_type = dense_type
        self.arch, self._permuted = gguf_architecture(args.model_type)
        self.qconfig = read_quant_config(loaded.config or {})
        self.src = loaded.weights
        self._names = set(self.src.names())
        self.linear_type = self._linear_type()

    def _linear_type(self) -> Q:
        t, qc = self.out_type, self.qconfig
        if t == "f16":
            return Q.F16
        if qc is None:
            if t in ("q4_0", "q4_1"):
                raise InvalidParameterError(
                    f"--type {t} needs an INT4 checkpoint: quantize first "
                    "(`edgellm quantize --method awq|gptq|rtn`), then export"
                )
            return Q.Q8_0 if t == "q8_0" else Q.F16
        if t == "auto":
            return exact_type(qc.bits, qc.symmetric)
        return {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}[t]

    # ---- names -----------------------------------------------------------------------------
    def plan(self) -> list[TensorPlan]:

        plans = []
        modules = sorted(
            n.removesuffix(".weight_packed") for n in self._names if n.endswith(".weight_packed")
        )
        for m in modules:
            plans.append(self._quantized(gguf_name(f"{m}.weight", self.args.model_type), m))
        for n in sorted(self._names):
            gname = gguf_name(n, self.args.model_type)
            if gname is None or (n == "lm_head.weight" and self.args.tie_word_embeddings):
                continue
            plans.append(self._dense(gname, n))
        rope = self._rope_freqs()
        return plans + ([rope] if rope else [])

    def _heads(self, hf: str) -> int | None:
        """Heads to permute by for llama q/k tensors, else None."""
        if not self._permuted:
            return None
        if ".q_proj." in hf:
            return self.args.num_attention_heads
        if ".k_proj." in hf:
            return self.args.num_key_value_heads
        return None

    # ---- quantized linears -----------------------------------------------------------------
    def _quantized(self, gname: str, m: str) -> TensorPlan:
        out, inp = (int(x) for x in self.src.get(f"{m}.weight_shape").tolist())
        qtype = self.linear_type

        def produce() -> np.ndarray:
            q, scale, zero = self._codes(m, out, inp)
            if qtype == Q.F16:
                groups = scale.shape[1]
                w = dequantize(q, scale, zero, QuantConfig(self.qconfig.bits, inp // groups))
                return w.to(torch.float16).numpy()
            return int_blocks(q, scale, zero, self.qconfig.bits, qtype)

        if qtype != Q.F16 and inp % BLOCK:
            raise InvalidParameterError(f"{m}: {inp} inputs are not a multiple of {BLOCK}")
        return TensorPlan(gname, (out, inp), qtype, produce)

    def _codes(self, m: str, out: int, inp: int):
        bits = self.qconfig.bits
        q = unpack_int32(self.src.get(f"{m}.weight_packed"), bits, inp)
        scale = self.src.get(f"{m}.weight_scale")
        zp = f"{m}.weight_zero_point"
        zero = unpack_int32(self.src.get(zp), bits, out, dim=0) if zp in self._names else None
        heads = self._heads(m + ".")
        if heads:
            q, scale = permute_qk(q, heads), permute_qk(scale, heads)
            zero = None if zero is None else permute_qk(zero, heads)
        return q, scale, zero

    # ---- dense tensors ---------------------------------------------------------------------
    def _dense(self, gname: str, hf: str) -> TensorPlan:
        info = self.src.info(hf)
        shape = tuple(info.shape)
        qtype = self._dense_type(hf, shape, info)

        def produce() -> np.ndarray:
            w = self.src.get(hf)
            heads = self._heads(hf)
            if heads:
                w = permute_qk(w, heads)
            if qtype == Q.Q8_0:
                return gguf.quants.quantize(w.float().numpy(), Q.Q8_0)
            if qtype == Q.BF16:
                return w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return w.to(torch.float16 if qtype == Q.F16 else torch.float32).numpy()

        return TensorPlan(gname, shape, qtype, produce)

    def _dense_type(self, hf: str, shape: tuple[int, ...], info) -> Q:
        if len(shape) == 1:  # norms and biases: F32, as llama.cpp's converter writes them
            return Q.F32
        if self.qconfig is None:  # a float model: linears and embeddings alike
            ok = self.linear_type != Q.Q8_0 or shape[-1] % BLOCK == 0
            return self.linear_type if ok else Q.F16
        # a quantized checkpoint's dense matrices (embeddings, lm_head) keep their dtype
        # (f16 when asked), so the export changes no weight, unless Q8_0 is asked for them
        if self.dense_type == "q8_0" and shape[-1] % BLOCK == 0:
            return Q.Q8_0
        if self.out_type == "f16" or self.dense_type == "f16":
            return Q.F16
        return _FLOAT_TYPES.get(_torch_dtype(info.dtype), Q.F16)

    def _rope_freqs(self) -> TensorPlan | None:
        """llama3-style RoPE scaling: per-dimension divisors in `rope_freqs.weight`."""

        kind = (self.args.rope_scaling or {}).get("rope_type", "default")
        if kind in ("default", "linear"):
            return None
        base = rope_inv_freq(replace(self.args, rope_scaling=None)).double()
        factors = (base / rope_inv_freq(self.args).double()).float()
        return TensorPlan("rope_freqs.weight", tuple(factors.shape), Q.F32, factors.numpy)


def _torch_dtype(name: str) -> torch.dtype | None:
    name = str(name).lower().removeprefix("torch.")
    aliases = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
    return getattr(torch, aliases.get(name, name), None)


# ---- metadata ----------------------------------------------------------------------------


def write_metadata(w: gguf.GGUFWriter, exp: GGUFExport, name: str) -> None:
    a = exp.args
    w.add_name(name)
    w.add_file_type(FILE_TYPES.get(exp.linear_type, gguf.LlamaFileType.ALL_F32))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(a.max_position_embeddings)
    w.add_embedding_length(a.hidden_size)
    w.add_block_count(a.num_hidden_layers)
    w.add_feed_forward_length(a.intermediate_size)
    w.add_head_count(a.num_attention_heads)
    w.add_head_count_kv(a.num_key_value_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_layer_norm_rms_eps(a.rms_norm_eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_vocab_size(a.vocab_size)
    scaling = a.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    write_tokenizer(w, exp.loaded, a.vocab_size)


def write_tokenizer(w: gguf.GGUFWriter, loaded, n_vocab: int) -> None:
    """A GGUF source's tokenizer keys are copied as they are; an HF tokenizer is converted."""
    if loaded.format == "gguf":
        reader = loaded.weights.reader
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        return

    tok = loaded.tokenizer
    v = gguf_vocab(tok, n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    w.add_token_merges(v.merges)
    sp = tok.special
    for value, add in [
        (sp.bos_id, w.add_bos_token_id),
        (sp.eos_id, w.add_eos_token_id),
        (sp.eot_id, w.add_eot_token_id),
        (sp.eom_id, w.add_eom_token_id),
        (sp.unk_id, w.add_unk_token_id),
        (sp.pad_id, w.add_pad_token_id),
    ]:
        if value is not None:
            add(value)
    w.add_add_bos_token(sp.add_bos)
    w.add_add_eos_token(sp.add_eos)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


# ---- entry point ---------------------------------------------------------------------------


def export_gguf(
    model: str | Path | None,
    out: str | Path,
    out_type: str = "auto",
    force: bool = False,
    progress: bool = False,
    dense_type: str = "auto",
) -> Path:
    """Write MODEL (an edgellm INT4 checkpoint, an HF directory or a GGUF) as one GGUF file.
    `dense_type` is the type of an INT checkpoint's dense matrices (embeddings, LM head):
    auto (as stored), f16, or q8_0 (lossy, 8.5 bits per weight: about half the bytes of
    bf16 to hold and to read per token)."""

    out = Path(out)
    check_output(out, force, source=resolve_model(model))
    loaded = load_model(model)
    exp = GGUFExport(loaded, out_type, dense_type)
    plans = exp.plan()
    with atomic_path(out, force=force) as tmp:
        w = gguf.GGUFWriter(str(tmp), exp.arch)
        write_metadata(w, exp, loaded.path.stem if loaded.path.is_file() else loaded.path.name)
        for p in plans:
            _add_info(w, p)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _write_tensors(w, plans, progress)
        w.close()
    return out


def _add_info(w: gguf.GGUFWriter, p: TensorPlan) -> None:
    if p.qtype in (Q.F32, Q.F16):
        dtype = np.float32 if p.qtype == Q.F32 else np.float16
        w.add_tensor_info(p.name, p.shape, np.dtype(dtype), p.nbytes)
    else:  # block types are described by their byte shape: rows x bytes per row
        rows = int(np.prod(p.shape[:-1]))
        w.add_tensor_info(p.name, (rows, p.nbytes // rows), np.dtype(np.uint8), p.nbytes, p.qtype)


def cached_gguf(loaded: LoadedModel, out_type: str = "auto") -> Path:
    """The GGUF export (`out_type`) of a model directory or file, made once and reused: the
    cache key is the source's path, its files' sizes and modification times, and the type."""
    root = cache_dir() / "gguf"
    src = Path(loaded.path)
    files = sorted(f for f in src.iterdir() if f.is_file()) if src.is_dir() else [src]
    key = [str(src.resolve()), EXPORT_VERSION, out_type]
    key += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    out = root / f"{src.stem}-{out_type}-{digest}.gguf"
    if not out.exists():
        export_gguf(src, out, out_type, progress=True)
    return out


def _write_tensors(w: gguf.GGUFWriter, plans: list[TensorPlan], progress: bool) -> None:

    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("exporting to GGUF", total=len(plans))
        for p in plans:
            data = np.ascontiguousarray(p.produce())
            if data.nbytes != p.nbytes:
                raise AssertionError(f"{p.name}: {data.nbytes} bytes, planned {p.nbytes}")
            w.write_tensor_data(data)
            bar.advance(task)
