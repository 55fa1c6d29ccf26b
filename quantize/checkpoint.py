"""The edgellm INT4 checkpoint: compressed-tensors `pack-quantized`, read by transformers and vLLM.

A directory with `config.json` (HF config + `quantization_config`), safetensors
weights (sharded past a size limit), the tokenizer files and `generation_config.json`.
Per quantized Linear `<m>` (see `/work/shared/FORMATS.md`):

    <m>.weight_packed      int32 [out, ceil(in*bits/32)]   codes + 2^(bits-1), dense bit stream
    <m>.weight_scale       dtype [out, n_groups]
    <m>.weight_shape       int64 [2]                       [out, in]
    <m>.weight_zero_point  int32 [ceil(out*bits/32), n_groups]  asymmetric only, packed along dim 0

Everything else (embeddings, norms, lm_head, biases) is stored dense.

Dense tensors and scales default to bfloat16: lossless for the bf16 models we start
from, exactly representable in fp16 (GGUF/MLX scales) for normal magnitudes, and the
dtype of torch's only fast CPU int4 kernel (`kernels.int4_matmul`); transformers and
compressed-tensors load it as is (logits equal the dequantized reference).
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgellm.errors import InvalidParameterError
from edgellm.fsutil import atomic_path
from edgellm.models.llama import ModelArgs
from edgellm.quantize.format import FORMAT, QuantConfig, pack_int32
from edgellm.quantize.rtn import QuantizedWeight
from edgellm.quantize.vllm_kernels import VllmKernelWarning, describe_fit, vllm_warning

SHARD_BYTES = 256 * 2**20  # a shard waits in memory until written (and safetensors copies it once more then)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PROVENANCE_KEY = "edgellm"  # our record inside quantization_config; other readers ignore it


def _weights_scheme(qconfig: QuantConfig) -> dict:
    return {
        "num_bits": qconfig.bits,
        "type": "int",
        "symmetric": qconfig.symmetric,
        "strategy": "channel" if qconfig.group_size == -1 else "group",
        "group_size": None if qconfig.group_size == -1 else qconfig.group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }


def quantization_config(
    qconfig: QuantConfig,
    provenance: dict | None = None,
    modules: dict[str, QuantConfig] | None = None,
) -> dict:
    """The config.json `quantization_config` of a checkpoint quantized with `qconfig`.

    `modules` (full Linear name -> config) may hold layers whose inputs the group size
    does not divide, quantized with `qconfig.for_features(...)`: then there is one
    config group per group size, targeting those Linears by name suffix."""
    used = sorted(set((modules or {}).values()) | {qconfig}, key=lambda c: -c.group_size)
    if len(used) == 1:
        groups = {"group_0": {"targets": ["Linear"], "weights": _weights_scheme(qconfig)}}
    else:
        groups = {
            f"group_{i}": {"targets": _suffix_targets(modules, c), "weights": _weights_scheme(c)}
            for i, c in enumerate(c for c in used if c in set(modules.values()))
        }
    cfg = {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",  # without it transformers loads random weights
        "config_groups": groups,
        "ignore": ["lm_head"],  # without it transformers' first forward fails
        "kv_cache_scheme": None,
    }
    if provenance:
        cfg[PROVENANCE_KEY] = provenance
    return cfg


def _suffix_targets(modules: dict[str, QuantConfig], config: QuantConfig) -> list[str]:
    """Regex targets ("re:" is compressed-tensors' prefix) of the Linears using `config`."""
    suffixes = {re.sub(r"^.*?layers\.\d+\.", "", n) for n, c in modules.items() if c == config}
    return [f"re:.*\\.{re.escape(s)}$" for s in sorted(suffixes)]


def quantized_tensors(
    name: str, qw: QuantizedWeight, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized Linear `name` (without `.weight`)."""
    bits = qw.config.bits
    out = {
        f"{name}.weight_packed": pack_int32(qw.q, bits),
        f"{name}.weight_scale": qw.scale.to(dtype).contiguous(),
        f"{name}.weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int64),
    }
    if qw.zero is not None:
        out[f"{name}.weight_zero_point"] = pack_int32(qw.zero, bits, dim=0)
    return out


class CheckpointWriter:
    """Streams tensors into a new checkpoint directory that appears only when complete.

    Use as a context manager: on an exception nothing is left behind; on success
    `close()` writes the last shard, the index, config and tokenizer, then renames
    the temporary directory to `out_dir`. Raises OutputExistsError at once when
    `out_dir` exists and `force` is false.
    """

    def __init__(
        self,
        out_dir: str | Path,
        args: ModelArgs,
        tokenizer,  # edgellm.tokenizer.Tokenizer (anything with save_pretrained) or None
        qconfig: QuantConfig,
        provenance: dict | None = None,
        force: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        shard_bytes: int = SHARD_BYTES,
        generation_config: dict | None = None,
    ):
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidParameterError(f"checkpoint dtype must be a float dtype, got {dtype}")
        self.args, self.tokenizer, self.qconfig = args, tokenizer, qconfig
        self.dtype, self.shard_bytes = dtype, shard_bytes
        # where vLLM will serve it from: said before the work, recorded in the checkpoint
        self.provenance = {**(provenance or {}), "vllm_gpu_kernels": describe_fit(args, qconfig)}
        self.generation_config = generation_config
        self._atomic = atomic_path(out_dir, force, is_dir=True)
        self.dir = self._atomic.__enter__()  # the temporary directory
        if (why := vllm_warning(args, qconfig)) is not None:
            warnings.warn(why, VllmKernelWarning, stacklevel=2)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard
        self._names: set[str] = set()
        self._total_bytes = 0
        self._closed = False
        self._modules: dict[str, QuantConfig] = {}  # Linear name -> its config

    def add_quantized(self, name: str, qw: QuantizedWeight) -> None:
        """Add Linear `name` (e.g. `model.layers.0.mlp.up_proj`) in packed form."""
        if qw.config != self.qconfig.for_features(qw.q.shape[1]):
            raise InvalidParameterError(f"{name} is quantized with {qw.config}, not {self.qconfig}")
        self._modules[name] = qw.config
        for key, t in quantized_tensors(name, qw, self.dtype).items():
            self._add(key, t)

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        """Add a tensor as is (floats in the checkpoint dtype), e.g. `model.norm.weight`."""
        self._add(name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor)

    def _add(self, name: str, t: torch.Tensor) -> None:
        if name in self._names:
            raise InvalidParameterError(f"tensor {name} was added twice")
        self._names.add(name)
        size = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + size > self.shard_bytes:
            self._flush()
        self._pending[name] = t.detach().contiguous().cpu()
        self._pending_bytes += size

    def _flush(self) -> None:

        save_file(
            self._pending, self.dir / _shard_tmp(len(self._shards)), metadata={"format": "pt"}
        )
        self._shards.append(list(self._pending))
        self._total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Write what is pending plus the metadata files, and move the directory in place."""
        if self._closed:
            return
        try:
            if self._pending or not self._shards:
                self._flush()
            self._name_shards()
            self._write_metadata()
        except BaseException as e:
            self.abort(e)
            raise
        self._closed = True
        self._atomic.__exit__(None, None, None)

    def abort(self, exc: BaseException | None = None) -> None:
        """Drop the temporary directory; nothing appears at `out_dir`."""
        if self._closed:
            return
        self._closed = True
        exc = exc or RuntimeError("checkpoint aborted")
        with contextlib.suppress(BaseException):
            self._atomic.__exit__(type(exc), exc, exc.__traceback__)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def _name_shards(self) -> None:
        n = len(self._shards)
        names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        for i, final in enumerate(names):
            (self.dir / _shard_tmp(i)).rename(self.dir / final)
        if n > 1:
            weight_map = {t: f for f, shard in zip(names, self._shards, strict=True) for t in shard}
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            _write_json(self.dir / INDEX_FILE, index)

    def _write_metadata(self) -> None:
        dtype = str(self.dtype).removeprefix("torch.")
        config = self.args.to_hf_config()
        # v5 transformers reads `dtype`; v4 and vLLM read `torch_dtype`
        config |= {"torch_dtype": dtype, "dtype": dtype}
        config["quantization_config"] = quantization_config(
            self.qconfig, self.provenance, self._modules
        )
        _write_json(self.dir / "config.json", config)
        gen = self.generation_config or {
            "bos_token_id": self.args.bos_token_id,
            "eos_token_id": self.args.eos_token_id,
        }
        _write_json(self.dir / "generation_config.json", gen)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(self.dir)


def _shard_tmp(i: int) -> str:
    return f"shard-{i:05d}.partial.safetensors"


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---- reading ------------------------------------------------------------------------
