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
AUTO_ORDER = ("torch",)
BACKENDS = ("auto", *AUTO_ORDER)


def backend_available(name: str) -> bool:
    """Whether this machine can run the backend (its library imports, its device exists)."""
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
        backend: "torch" (CPU reference).
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
        from edgellm.loaders.model import build_model, load_model

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
        self.model = build_model(self.loaded, DTYPES[dtype])
        self.engine = make_engine(
            self.model,
            self.tokenizer,
            EngineConfig(
                block_size,
                kv_cache_mb,
                max_num_seqs,
                max_num_batched_tokens,
                max_model_len,
                enable_prefix_caching,
            ),
            spec,
            load_draft(spec, dtype, self.model.args.vocab_size),
        )

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


def make_engine(
    model,
    tokenizer,
    config: EngineConfig,
    spec: SpeculativeConfig | None = None,
    draft_model=None,
) -> Engine:
    """The engine over `model`; with speculation on, a SpeculativeEngine with its proposer."""
    backend = make_backend(model, config)
    if spec is None or spec.method == "off":
        return Engine(backend, tokenizer, config)
    from edgellm.spec_engine import SpeculativeEngine
    from edgellm.speculative import DraftProposer, NgramProposer

    if spec.method == "draft":
        proposer = DraftProposer(make_backend(draft_model, config))
    else:
        proposer = NgramProposer(spec.ngram_max, spec.ngram_min)
    return SpeculativeEngine(backend, tokenizer, config, spec, proposer)


def make_backend(model, config: EngineConfig):
    from edgellm.backends.torch import TorchBackend

    return TorchBackend(model, config.kv_cache_mb, config.block_size, config.max_model_len)


def load_draft(spec: SpeculativeConfig, dtype: str, vocab_size: int):
    """The draft model of `spec` (None unless method is "draft"); its vocabulary must be the
    target's."""
    if spec.method != "draft":
        return None
    from edgellm.loaders.model import build_model, load_model

    draft = build_model(load_model(spec.draft_model), DTYPES[dtype])
    if draft.args.vocab_size != vocab_size:
        raise InvalidParameterError(
            f"the draft model's vocabulary ({draft.args.vocab_size}) is not the target's "
            f"({vocab_size}); it needs the same tokenizer"
        )
    return draft


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
