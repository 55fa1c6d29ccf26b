"""The one home of defaults: `EngineConfig` (+ `SpeculativeConfig`), validated on creation.

Every layer reads its settings from here: the engine (block size, batch limits,
prefix caching), the backends (KV-pool size, dtype, threads), `LLM(**kwargs)` and
the CLI, whose options only override fields of these objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from edgellm.errors import InvalidParameterError

SPECULATIVE_METHODS = ("off", "ngram", "draft")
# "auto": bfloat16 where the CPU has native bf16 dot products, float32 elsewhere (torch backend)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# what the llama.cpp backend runs: the model's own GGUF ("file"; a checkpoint's exact export),
# an export of the model's weights to one type, or "auto" (the file, unless the model's entry
# in the registry names a type that keeps its answers)
LLAMACPP_TYPES = ("auto", "file", "f16", "q8_0", "q4_0", "q4_1")
# what the MLX backend does to a float model's Linears at load: nothing, or `mx.quantize`
# (affine, group 64, or the largest of 32/64/128 dividing a layer's inputs)
MLX_QUANTIZE = ("off", "q4", "q8")
# how K/V are stored: the backend's float dtype ("auto"), 8-bit ("int8": per token and KV
# head, symmetric, an fp32 scale per row; llama.cpp's q8_0 blocks of 32 on that backend) or
# 4-bit ("int4": llama.cpp's q4_0 blocks of 32; that backend only for now)
KV_CACHE_DTYPES = ("auto", "int8", "int4")
# what a preempted sequence's K/V become: recomputed later, parked in host memory (needs a
# backend with swap space), or "auto": the cheaper of the two, measured
PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass(slots=True)
class SpeculativeConfig:
    """How to speculate. `num_draft_tokens` is the most a sequence drafts per step (k)."""

    method: str = "off"  # "off" | "ngram" | "draft"
    num_draft_tokens: int = 4
    draft_model: str | None = None  # with method="draft"
    ngram_max: int = 3  # longest suffix looked up (n)
    ngram_min: int = 2  # shortest suffix that counts as a match
    adaptive: bool = True  # k from acceptance; off-switch when it does not pay
    probe_every: int = 32  # decode steps a switched-off sequence waits before trying again

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidParameterError(
                f"unknown speculative method {self.method!r} "
                f"(choose from {', '.join(SPECULATIVE_METHODS)})"
            )
        if not 1 <= self.num_draft_tokens <= 32:
            raise InvalidParameterError("num_draft_tokens must be in [1, 32]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidParameterError("need 1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise InvalidParameterError("speculative method 'draft' needs a draft model")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine and a backend need besides the model.

    Args:
        block_size: tokens per KV block (the unit of allocation and prefix caching).
        kv_cache_mb: memory for the paged KV pool; the backend turns it into blocks.
        memory_budget: bytes the whole process may hold (None: no plan). `LLM` plans weights,
            working memory and the KV pool inside it (`backends/memory.py`) and sets
            `kv_cache_mb` (and `kv_cache_dtype`, when "auto") from the plan.
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: tokens one step computes at most (prefill chunks,
            decodes and drafted tokens together).
        max_model_len: context limit (None: the model's, bounded by the pool).
        enable_prefix_caching: reuse computed blocks of identical prompt prefixes.
        dtype: float dtype of weights and KV cache where the backend has a choice.
        kv_cache_dtype: "auto" (K/V in the backend's float dtype) or "int8": 8-bit K/V, so
            the same `kv_cache_mb` holds about twice the tokens of a 16-bit cache (four
            times fp32's). Torch, MLX and CUDA: symmetric per (token, KV head) with an fp32
            scale, dequantized inside paged attention; llama.cpp: its q8_0 K and V types
            (needs `flash_attn`). "int4": llama.cpp's q4_0 K and V (3.6x a 16-bit cache).
        threads: CPU threads (None: all cores).
        verbose: let backends' own libraries log (llama.cpp prints to stderr).
        llamacpp_type: the weights llama.cpp runs (see LLAMACPP_TYPES).
        flash_attn: llama.cpp's flash-attention kernels (on: faster, and its CPU kernel skips
            masked cells, which the plain path computes; `Llama` has it off by default).
        llamacpp_keep_tokens: K/V cells llama.cpp keeps for the prefix cache once their
            sequences end; beyond them the least recently used blocks leave the cache. Its
            unified cache puts every kept cell inside every sequence's attention window
            (masked), so an unbounded cache slows every request as it fills. None: 1024
            with flash attention (masked cells are skipped), 256 without
            (bench/bench_cache_growth.py measured both flat over 700 requests).
        mlx_quantize: the MLX backend quantizes a float model's Linears at load with
            `mx.quantize` ("q4" | "q8", group 64; e.g. a GGUF, dequantized on load); an INT
            checkpoint always runs as stored.
        cuda_graphs: the CUDA backend replays decode steps as CUDA graphs.
        quantize_lm_head: the CUDA backend quantizes the LM head to INT4 at load (on small
            models with tied embeddings it is a large share of the bytes read per token).
        swap_space_mb: host memory for the K/V of preempted sequences (offloading); None:
            the backend's default (CUDA: 2048, the CPU backends: none, their pool is host
            memory already).
        preemption: "auto" (swap when a measured copy is cheaper than recomputing),
            "recompute" or "swap" (whenever the host pool has room).
        kv_window: attend to the last `kv_window` tokens only (plus the first `kv_sinks`), in
            every layer, on top of the model's own sliding windows (0: off). Blocks outside the
            window are freed as a sequence grows, so a chat can run past the model's context
            (positions up to `max_model_len`, 65536 by default then) in a fixed KV budget.
            Torch backend.
        kv_sinks: first tokens every query still sees under `kv_window` (attention sinks).
        speculative: speculative decoding (off by default).
    """

    block_size: int = 16
    kv_cache_mb: float = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    memory_budget: int | None = None
    threads: int | None = None
    verbose: bool = False
    llamacpp_type: str = "auto"
    flash_attn: bool = True
    llamacpp_keep_tokens: int | None = None
    mlx_quantize: str = "off"
    cuda_graphs: bool = True
    quantize_lm_head: bool = False
    swap_space_mb: float | None = None
    preemption: str = "auto"
    kv_window: int = 0
    kv_sinks: int = 4
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise InvalidParameterError(
                "block_size, max_num_seqs and max_num_batched_tokens must be >= 1"
            )
        if not self.kv_cache_mb > 0:
            raise InvalidParameterError(f"kv_cache_mb must be positive, got {self.kv_cache_mb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidParameterError("max_model_len must be at least 2")
        if self.dtype not in DTYPES:
            raise InvalidParameterError(
                f"unknown dtype {self.dtype!r} (choose from {', '.join(DTYPES)})"
            )
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise InvalidParameterError(f"memory_budget must be positive, got {self.memory_budget}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r} "
                f"(choose from {', '.join(KV_CACHE_DTYPES)})"
            )
        if self.llamacpp_type not in LLAMACPP_TYPES:
            raise InvalidParameterError(
                f"unknown llama.cpp type {self.llamacpp_type!r} "
                f"(choose from {', '.join(LLAMACPP_TYPES)})"
            )
        if self.mlx_quantize not in MLX_QUANTIZE:
            raise InvalidParameterError(
                f"unknown mlx_quantize {self.mlx_quantize!r} (choose from {', '.join(MLX_QUANTIZE)})"
            )
        if self.preemption not in PREEMPTION_MODES:
            raise InvalidParameterError(
                f"unknown preemption {self.preemption!r} (choose from {', '.join(PREEMPTION_MODES)})"
            )
        if self.swap_space_mb is not None and self.swap_space_mb < 0:
            raise InvalidParameterError("swap_space_mb must be >= 0")
        if self.llamacpp_keep_tokens is not None and self.llamacpp_keep_tokens < 0:
            raise InvalidParameterError("llamacpp_keep_tokens must be >= 0")
        if self.threads is not None and self.threads < 1:
            raise InvalidParameterError("threads must be >= 1")
        if self.kv_window < 0 or self.kv_sinks < 0:
            raise InvalidParameterError("kv_window and kv_sinks must be >= 0")
        if self.kv_window and self.kv_sinks >= self.kv_window:
            raise InvalidParameterError(
                f"kv_sinks ({self.kv_sinks}) must be fewer than the kv_window ({self.kv_window}) "
                "tokens"
            )

    @property
    def keep_tokens(self) -> int:
        """`llamacpp_keep_tokens`, resolved."""
        if self.llamacpp_keep_tokens is not None:
            return self.llamacpp_keep_tokens
        return 1024 if self.flash_attn else 256

    def replace(self, **overrides) -> EngineConfig:
        """A copy with some fields changed; unknown names are an error, not ignored."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidParameterError(
                f"unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        return dataclasses.replace(self, **overrides)


def kv_pool_blocks(kv_cache_mb: float, block_size: int, bytes_per_token: int) -> int:
    """Blocks of `block_size` tokens that `kv_cache_mb` holds at `bytes_per_token` (K and V of
    every layer); at least two, or the pool cannot hold a prompt and its next token."""
    num_blocks = int(kv_cache_mb * 2**20 // (block_size * bytes_per_token))
    if num_blocks < 2:
        raise InvalidParameterError(
            f"--kv-cache-mb {kv_cache_mb} holds only {num_blocks} blocks of {block_size} tokens"
        )
    return num_blocks
