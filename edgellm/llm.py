"""The embedded Python API: `LLM(model).generate(...)`, `.chat(...)`, `.stream(...)`."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from edgellm.engine import Engine, EngineConfig
from edgellm.errors import InvalidParameterError
from edgellm.outputs import RequestOutput
from edgellm.sampling_params import SamplingParams
from edgellm.speculative import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# preference order of `backend="auto"`: the first one this machine can run
AUTO_ORDER = ("llamacpp", "torch")
BACKENDS = ("auto", *AUTO_ORDER)


def backend_available(name: str) -> bool:
    """Whether this machine can run the backend (its library imports, its device exists)."""
    import importlib.util

    if name == "llamacpp":
        return importlib.util.find_spec("llama_cpp") is not None
    return name == "torch"


def resolve_backend(name: str) -> str:
    """The concrete backend for `name`; "auto" picks the first available of AUTO_ORDER."""
    if name not in BACKENDS:
        raise InvalidParameterError(f"unknown backend {name!r} (available: {', '.join(BACKENDS)})")
    if name == "auto":
        return next(b for b in AUTO_ORDER if backend_available(b))
    if not backend_available(name):
        raise InvalidParameterError(f"the {name} backend cannot run on this machine")
    return name


class LLM:
    """A model on a backend, driven by the shared engine.

    Args:
        model: a GGUF file, a Hugging Face directory, a short name (`smollm2-135m`), or
            None for the default model (SmolLM2-135M-Instruct).
        backend: "torch" (CPU reference), "llamacpp" (llama.cpp on the CPU; an HF or
            edgellm checkpoint is exported to GGUF once, into a cache) or "auto".
        dtype: float dtype of weights and KV cache on the torch backend.
        kv_cache_mb: memory for the paged KV cache.
        max_model_len: context limit (defaults to the model's).
        speculative: "off", "ngram" (prompt lookup), "draft" (a small model with the same
            tokenizer, `draft_model`), or a SpeculativeConfig.
        num_draft_tokens: the most tokens a sequence drafts per step (adapted to acceptance).
    """

    def __init__(
        self,
        model: str | None = None,
        backend: str = "torch",
        dtype: str = "float32",
        kv_cache_mb: float = 512,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        enable_prefix_caching: bool = True,
        threads: int | None = None,
        speculative: str | SpeculativeConfig = "off",
        draft_model: str | None = None,
        num_draft_tokens: int = 4,
    ):
        from edgellm.loaders.model import load_model

        self.backend_name = resolve_backend(backend)
        spec = (
            speculative
            if isinstance(speculative, SpeculativeConfig)
            else SpeculativeConfig(speculative, num_draft_tokens, draft_model)
        )
        if dtype not in DTYPES:
            raise InvalidParameterError(
                f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})"
            )
        if threads:
            torch.set_num_threads(threads)
        self.loaded = load_model(model)
        self.tokenizer = self.loaded.tokenizer
        config = EngineConfig(
            block_size,
            kv_cache_mb,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_prefix_caching,
        )
        # the torch module on the torch backend (None on llama.cpp)
        backend, self.model = make_backend(self.backend_name, self.loaded, config, dtype, threads)
        draft = None
        if spec.method == "draft":
            draft = load_draft(spec, self.loaded, self.backend_name, config, dtype, threads)
        self.engine = make_engine(backend, self.tokenizer, config, spec, draft)

    # ---- batch API -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (batched through the engine); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.add_request(p, params) for p in prompts]
        try:
            run_to_completion(self.engine, progress, total=len(ids))
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [self.engine.pop_output(rid) for rid in ids]

    def chat(
        self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Answer one conversation or several, formatted by the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.format_chat(c) for c in convs], params)

    def format_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- streaming -----------------------------------------------------------------------------
    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield text deltas of one completion as tokens arrive (UTF-8 safe)."""
        rid = self.engine.add_request(prompt, params)
        try:
            while not self.engine.requests[rid].finished:
                for delta in self.engine.step():
                    if delta.request_id == rid and delta.index == 0 and delta.text:
                        yield delta.text
        finally:  # also when the consumer stops early: the request is aborted, blocks freed
            self.last_output = self.engine.abort(rid)

    def stream_chat(
        self, messages: list[dict], params: SamplingParams | None = None
    ) -> Iterator[str]:
        return self.stream(self.format_chat(messages), params)

    # ---- evaluation ----------------------------------------------------------------------------
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Log-probability of each token after the first: [len - 1]."""
        return self.engine.score(token_ids)


def make_backend(name: str, loaded, config: EngineConfig, dtype: str, threads: int | None):
    """(backend, torch module or None) running `loaded` on the backend called `name`."""
    if name == "llamacpp":
        return llamacpp_backend(loaded, config, threads), None
    from edgellm.loaders.model import build_model

    model = build_model(loaded, DTYPES[dtype])
    return torch_backend(model, config), model


def torch_backend(model, config: EngineConfig):
    from edgellm.backends.torch import TorchBackend

    return TorchBackend(model, config.kv_cache_mb, config.block_size, config.max_model_len)


def llamacpp_backend(loaded, config: EngineConfig, threads: int | None = None):
    """llama.cpp on the model's GGUF: the file itself, or its export (cached by content)."""
    from edgellm.backends.llamacpp import LlamaCppBackend
    from edgellm.quantize.export_gguf import cached_gguf

    path = loaded.path if loaded.format == "gguf" else cached_gguf(loaded)
    return LlamaCppBackend(
        path,
        loaded.args,
        config.kv_cache_mb,
        config.block_size,
        config.max_model_len,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        threads,
    )


def make_engine(
    backend, tokenizer, config: EngineConfig, spec: SpeculativeConfig | None = None, draft=None
) -> Engine:
    """The engine over `backend`; with speculation on, a SpeculativeEngine with its proposer
    (`draft`: the draft model's backend, for method "draft")."""
    if spec is None or spec.method == "off":
        return Engine(backend, tokenizer, config)
    from edgellm.spec_engine import SpeculativeEngine
    from edgellm.speculative import DraftProposer, NgramProposer

    if spec.method == "draft":
        proposer = DraftProposer(draft)
    else:
        proposer = NgramProposer(spec.ngram_max, spec.ngram_min)
    return SpeculativeEngine(backend, tokenizer, config, spec, proposer)


# a probe that exercises words, digits, code and whitespace: equal tokenizers agree on it
TOKENIZER_PROBE = "Hello, world! def f(x):\n    return x ** 2  # 12345 café\n\tend"


def load_draft(spec: SpeculativeConfig, target, backend: str, config, dtype, threads):
    """The draft model's backend (same kind as the target's); its tokenizer must be the
    target's, or its proposals would mean other tokens."""
    from edgellm.loaders.model import load_model

    draft = load_model(spec.draft_model)
    same_vocab = draft.args.vocab_size == target.args.vocab_size
    probe = [t.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False) for t in (draft, target)]
    if not same_vocab or probe[0] != probe[1]:
        raise InvalidParameterError(
            f"the draft model {spec.draft_model} does not share the target's tokenizer "
            f"(vocabulary {draft.args.vocab_size} vs {target.args.vocab_size}); speculation "
            "needs the same tokenizer"
        )
    return make_backend(backend, draft, config, dtype, threads)[0]


def run_to_completion(engine: Engine, progress: bool = False, total: int = 0) -> None:
    """Step the engine until no request is left, with an optional progress bar."""
    if not progress:
        while engine.has_unfinished():
            engine.step()
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("generating", total=total)
        while engine.has_unfinished():
            engine.step()
            done = sum(r.finished for r in engine.requests.values())
            bar.update(task, completed=done)
