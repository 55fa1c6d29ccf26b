"""Shared fixtures: tiny random Llama/Qwen2 models built in memory, the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on the CPU through Triton's interpreter where there is no GPU; it must
# be chosen before triton is first imported (edgellm's backends import it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, os.cpu_count() or 1))

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def tiny_hf_model(model_type: str = "llama", tie: bool = False, seed: int = 0, **over):
    """A transformers model with random weights (the oracle) and its config dict."""
    import transformers

    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}[model_type]
    cfg = getattr(transformers, cls)(**{**TINY, **over}, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model_cls = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }
    hf = getattr(transformers, model_cls[model_type])(cfg).eval()
    with torch.no_grad():  # biases are zero-initialised; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf, cfg.to_dict()


def ours_from_hf(hf, config: dict, dtype=torch.float32):
    """Our model built from the same weights as a transformers model."""
    from edgellm.loaders.model import LoadedModel
    from edgellm.loaders.weights import DictSource
    from edgellm.models.llama import ModelArgs
    from edgellm.quantize.build import build_model

    args = ModelArgs.from_hf_config(config)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    loaded = LoadedModel(Path("memory"), "hf", args, DictSource(sd), tokenizer=None, config=config)
    return build_model(loaded, dtype)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from edgellm.registry import resolve_model

    return resolve_model("smollm2-135m")


def byte_tokenizer(eos_id: int | None = None):
    """A real byte-level BPE tokenizer with one token per byte (vocab 256, no merges)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from edgellm.loaders.tokenizer import SpecialTokens, Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in enumerate(sorted(alphabet, key=_byte_of))}
    vocab = {c: b for b, c in byte_to_char.items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, SpecialTokens(eos_id=eos_id))


def bpe_tokenizer(
    merges: tuple[str, ...] = ("Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a"),
    eos_id: int | None = None,
):
    """A byte-level BPE with a few merges (vocab 256 + len(merges)): llama.cpp needs merges."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from edgellm.loaders.tokenizer import SpecialTokens, Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {c: i for i, c in enumerate(alphabet)}
    pairs = [tuple(m.split(" ")) for m in merges]
    for a, b in pairs:
        vocab[a + b] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, SpecialTokens(eos_id=eos_id))


def _byte_of(ch: str) -> int:
    from tokenizers import pre_tokenizers

    # the GPT-2 byte<->unicode map: printable bytes map to themselves, others to 256+
    table = getattr(_byte_of, "table", None)
    if table is None:
        bs = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        table = _byte_of.table = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    del pre_tokenizers
    return table[ch]


def tiny_engine(
    model_type: str = "llama",
    kv_cache_mb: float = 2.0,
    eos_id: int | None = None,
    seed: int = 0,
    **cfg,
):
    """An Engine over a tiny random model (vocab 256) with a byte tokenizer."""
    from edgellm.backends.torch import TorchBackend
    from edgellm.config import EngineConfig
    from edgellm.engine.engine import Engine

    hf, config = tiny_hf_model(model_type, seed=seed)
    model = ours_from_hf(hf, config)
    config = EngineConfig(**{"kv_cache_mb": kv_cache_mb, **cfg})
    backend = TorchBackend(model, config)
    return Engine(backend, byte_tokenizer(eos_id), config)


def cuda_backend(model, config):
    """The CUDA backend on a GPU, else on the CPU through Triton's interpreter (float32)."""
    from edgellm.backends.cuda import CUDABackend

    # the backend copies what it needs to its device: `model` stays where it is (on the CPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return CUDABackend(model, config, device, next(model.parameters()).dtype)


def triton_runs() -> bool:
    """The Triton kernels can run here: a GPU, or the interpreter."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def run_all(engine, prompts, params, check=True) -> list:
    """Add every prompt, step to completion checking block invariants; outputs in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        if check:
            live = [
                s
                for r in engine.requests.values()
                for s in r.seqs
                if s.block_table or s.host_table
            ]
            engine.block_manager.check_invariants(live)
    return [engine.pop_output(i) for i in ids]


def next_logits(llm, ids: list[int]):
    """The logits after `ids` from an LLM's own backend (a probe sequence, freed after)."""
    from edgellm.engine.scheduler import ScheduledSeq
    from edgellm.engine.sequence import Sequence
    from edgellm.sampling.params import SamplingParams

    engine = llm.engine
    seq = Sequence("probe", list(ids), SamplingParams())
    engine.block_manager.allocate(seq, use_prefix_cache=False)
    try:
        # a copy: a backend's logits are valid only until its next forward
        return engine.backend.forward([ScheduledSeq(seq, len(ids))])[0].clone()
    finally:
        engine.block_manager.free(seq)
        engine.backend.release(seq)
