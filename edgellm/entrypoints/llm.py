"""The embedded Python API: `LLM(model).generate(...)`, `.chat(...)`, `.stream(...)`."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from rich.progress import Progress

from edgellm.backends.base import Backend
from edgellm.backends.memory import MemoryPlan, parse_size, plan_memory
from edgellm.backends.registry import build_backend, resolve_backend
from edgellm.config import EngineConfig, SpeculativeConfig
from edgellm.engine.engine import Engine
from edgellm.engine.outputs import RequestOutput
from edgellm.errors import InvalidParameterError, RequestFailedError
from edgellm.eval.perplexity import perplexity
from edgellm.loaders.model import LoadedModel, load_model
from edgellm.loaders.texts import load_text
from edgellm.sampling.params import SamplingParams
from edgellm.spec.decoder import build_speculator


class LLM:
    """A model on a backend, driven by the shared engine.

    Args:
        model: a GGUF file, a Hugging Face directory, a short name (`smollm2-135m`), or
            None for the default model (SmolLM2-135M-Instruct).
        backend: "auto" (the best this machine has: see `edgellm info`), "llamacpp"
            (llama.cpp on the CPU; an HF or edgellm checkpoint is exported to GGUF once,
            into a cache) or "torch" (the CPU reference).
        speculative: "off", "ngram" (prompt lookup), "draft" (a small model with the same
            tokenizer, `draft_model`), or a SpeculativeConfig.
        num_draft_tokens: the most tokens a sequence drafts per step (adapted to acceptance;
            default: SpeculativeConfig's).
        config: an EngineConfig; keyword arguments override its fields (`kv_cache_mb`,
            `max_model_len`, `max_num_seqs`, `dtype`, `threads`, ...; see EngineConfig).
            `memory_budget` ("4GB", or bytes) plans the KV pool so the process stays
            inside it; the plan is `llm.memory_plan`.
    """

    def __init__(
        self,
        model: str | None = None,
        backend: str = "auto",
        speculative: str | SpeculativeConfig = "off",
        draft_model: str | None = None,
        num_draft_tokens: int | None = None,
        config: EngineConfig | None = None,
        **overrides,
    ):
        spec = speculative
        if not isinstance(spec, SpeculativeConfig):
            k = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
            spec = SpeculativeConfig(speculative, draft_model=draft_model, **k)
        if overrides.get("memory_budget") is not None:
            if overrides.get("kv_cache_mb") is not None:
                raise InvalidParameterError(
                    "give a memory budget or a KV cache size (--kv-cache-mb), not both"
                )
            overrides["memory_budget"] = parse_size(overrides["memory_budget"])
        self.config = (config or EngineConfig()).replace(**overrides, speculative=spec)
        self.backend_name = resolve_backend(backend, self.config.kv_window)
        self.loaded = load_model(model)
        self.tokenizer = self.loaded.tokenizer
        self.memory_plan: MemoryPlan | None = None
        if self.config.memory_budget is not None:
            if spec.method == "draft":
                raise InvalidParameterError(
                    "a memory budget is planned for one model: not with a draft model"
                )
            self.memory_plan = plan_memory(
                self.loaded, self.config, self.backend_name, self.config.memory_budget
            )
            self.config = self.config.replace(**self.memory_plan.engine_overrides())
        self.backend = build_backend(self.backend_name, self.loaded, self.config)
        draft = None
        if spec.method == "draft":
            draft = load_draft(spec, self.loaded, self.backend_name, self.config)
        self.engine = Engine(
            self.backend, self.tokenizer, self.config, build_speculator(spec, draft)
        )
        self.last_output: RequestOutput | None = None

    # ---- batch API -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (batched through the engine); outputs in prompt order.
        `params`: one SamplingParams for all prompts, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise InvalidParameterError(
                f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts"
            )
        ids = []
        try:
            for p, sp in zip(prompts, per_prompt, strict=True):
                ids.append(self.engine.add_request(p, sp))
            run_to_completion(self.engine, progress, total=len(ids))
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        outputs = [self.engine.pop_output(rid) for rid in ids]
        raise_errors(outputs)
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
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
            while not self.engine.is_finished(rid):
                for delta in self.engine.step():
                    if delta.request_id == rid and delta.index == 0 and delta.text:
                        yield delta.text
                    if delta.request_id == rid and delta.error:
                        raise RequestFailedError(delta.error)
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


# a probe that exercises words, digits, code and whitespace: equal tokenizers agree on it
TOKENIZER_PROBE = "Hello, world! def f(x):\n    return x ** 2  # 12345 café\n\tend"


def load_draft(
    spec: SpeculativeConfig, target: LoadedModel, backend: str, config: EngineConfig
) -> Backend:
    """The draft model's backend (same kind as the target's); its tokenizer must be the
    target's, or its proposals would mean other tokens."""
    draft = load_model(spec.draft_model)
    same_vocab = draft.args.vocab_size == target.args.vocab_size
    probe = [t.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False) for t in (draft, target)]
    if not same_vocab or probe[0] != probe[1]:
        raise InvalidParameterError(
            f"the draft model {spec.draft_model} does not share the target's tokenizer "
            f"(vocabulary {draft.args.vocab_size} vs {target.args.vocab_size}); speculation "
            "needs the same tokenizer"
        )
    return build_backend(backend, draft, config)


def raise_errors(outputs: list[RequestOutput]) -> None:
    """A completion that ended in an error (non-finite logits, an internal error) raises
    rather than passing for a short answer."""
    for out in outputs:
        for c in out.outputs:
            if c.finish_reason == "error":
                raise RequestFailedError(f"request {out.request_id}: {c.error}")


def run_to_completion(engine: Engine, progress: bool = False, total: int = 0) -> None:
    """Step the engine until no request is left, with an optional progress bar."""
    if not progress:
        while engine.has_unfinished():
            engine.step()
        return
    with Progress(transient=True) as bar:
        task = bar.add_task("generating", total=total)
        while engine.has_unfinished():
            engine.step()
            bar.update(task, completed=total - engine.num_unfinished_requests)


def measure_ppl(model: str | None, text: str, n_tokens: int, ctx: int = 512) -> float:
    """Perplexity of a model on a text's first `n_tokens`, on the torch backend (the float
    reference numerics), windows of `ctx`."""
    llm = LLM(model, backend="torch", max_num_batched_tokens=ctx, enable_prefix_caching=False)
    tokens = llm.tokenizer.encode(load_text(text), add_special_tokens=False)[:n_tokens]
    return perplexity(llm.score, tokens, ctx, progress=True).ppl
