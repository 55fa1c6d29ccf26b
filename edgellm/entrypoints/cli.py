"""The `edgellm` command (also `python -m edgellm`). Thin: each command parses options and
calls the library. Options shared by commands are defined once, below; engine options
default to None, meaning EngineConfig's own default."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from edgellm.backends.memory import parse_size, plan_memory
from edgellm.backends.registry import CHOICES, resolve_backend
from edgellm.config import EngineConfig
from edgellm.distill.pipeline import DistillOptions
from edgellm.distill.pipeline import distill as run_distill
from edgellm.distill.pipeline import print_report as print_distill_report
from edgellm.distill.prune import PruneOptions
from edgellm.distill.prune import prune as run_prune
from edgellm.engine.outputs import RequestOutput
from edgellm.entrypoints.async_engine import AsyncEngine
from edgellm.entrypoints.chat import run_chat
from edgellm.entrypoints.llm import LLM, measure_ppl
from edgellm.entrypoints.serve import ServerConfig, run_server
from edgellm.errors import EdgeLLMError, InvalidParameterError
from edgellm.eval import loadgen
from edgellm.eval.info import backends_table, memory_plan_table, model_info, render_info
from edgellm.eval.perplexity import perplexity
from edgellm.loaders.model import load_model
from edgellm.loaders.texts import load_text
from edgellm.quantize.export_gguf import export_gguf as write_gguf
from edgellm.quantize.export_hf import convert_to_hf
from edgellm.quantize.export_mlx import describe_export
from edgellm.quantize.export_mlx import export_mlx as write_mlx
from edgellm.quantize.pipeline import QuantizeOptions, print_report
from edgellm.quantize.pipeline import quantize as run_quantize
from edgellm.sampling.params import SamplingParams

app = typer.Typer(
    help="edgellm: quantize once, run everywhere. With no MODEL, SmolLM2-135M-Instruct is used.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
eval_app = typer.Typer(help="Evaluate a model.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")
export_app = typer.Typer(help="Export a model to another runtime's format.", no_args_is_help=True)
app.add_typer(export_app, name="export")

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="GGUF file, HF directory or short name (smollm2-135m)"),
]
BackendOpt = Annotated[
    str,
    typer.Option("--backend", "-b", help=f"{' | '.join(CHOICES)} (auto: see `edgellm info`)"),
]
ThreadsOpt = Annotated[
    int | None, typer.Option("--threads", "-t", help="CPU threads (default: all cores)")
]
DtypeOpt = Annotated[
    str | None, typer.Option(help="auto | float32 | bfloat16 | float16 (torch and mlx backends; default auto, see `edgellm info`)")
]
KVCacheOpt = Annotated[
    float | None, typer.Option("--kv-cache-mb", help="memory for the KV cache (default 512)")
]
KVDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--kv-cache-dtype",
        help="auto | int8 (8-bit K/V: ~2x the tokens per MB; torch, llamacpp) | int4 (llamacpp)",
    ),
]
KVWindowOpt = Annotated[
    int | None,
    typer.Option(
        "--kv-window",
        help="attend to the last N tokens only (plus --kv-sinks first ones); blocks outside "
        "are freed, so chats run past the context in a fixed KV budget (torch)",
    ),
]
KVSinksOpt = Annotated[
    int | None, typer.Option("--kv-sinks", help="first tokens kept under --kv-window (default 4)")
]
BudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--memory-budget",
        help="e.g. 4GB: plan weights + KV + working memory to stay inside it (sets the KV size)",
    ),
]
MaxSeqsOpt = Annotated[
    int | None, typer.Option("--max-num-seqs", help="sequences running at once (default 64)")
]
CtxOpt = Annotated[int | None, typer.Option("--ctx", help="context length limit")]
LlamaCppTypeOpt = Annotated[
    str | None,
    typer.Option(
        "--llamacpp-type",
        help="weights llama.cpp runs: auto | file | f16 | q8_0 | q4_0 | q4_1 (auto: the file, "
        "or the type its registry entry names)",
    ),
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", help="let backends' libraries log (llama.cpp)")
]
SwapOpt = Annotated[
    float | None,
    typer.Option(
        "--swap-space-mb",
        help="host memory for preempted sequences' K/V (offloading; default: cuda 2048, CPU 0)",
    ),
]
PreemptOpt = Annotated[
    str | None,
    typer.Option(help="auto | recompute | swap: what preempted K/V become (auto: cheaper, measured)"),
]
HeadOpt = Annotated[
    bool | None,
    typer.Option("--quantize-lm-head/--no-quantize-lm-head", help="cuda: INT4 LM head"),
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="tokens to generate at most")]
SpecOpt = Annotated[str, typer.Option("--speculative", help="ngram | draft | off")]
DraftOpt = Annotated[str | None, typer.Option("--draft-model", help="draft model (same tokenizer)")]
DraftTokensOpt = Annotated[
    int | None, typer.Option("--num-draft-tokens", help="most tokens drafted a step (default 4)")
]
ModelArg = Annotated[str | None, typer.Argument(help="GGUF file, HF directory or short name")]
ForceOpt = Annotated[bool, typer.Option("--force", help="replace the output if it exists")]


# command parameters that are LLM / EngineConfig options (a command has those it shows)
LLM_OPTIONS = ("speculative", "draft_model", "num_draft_tokens")
ENGINE_OPTIONS = (
    "threads",
    "dtype",
    "kv_cache_mb",
    "kv_cache_dtype",
    "kv_window",
    "kv_sinks",
    "memory_budget",
    "max_num_seqs",
    "verbose",
    "llamacpp_type",
    "swap_space_mb",
    "preemption",
    "quantize_lm_head",
)


def _llm(options: dict, **fixed) -> LLM:
    """Load the model a command's options (its `locals()`) name, with the engine options it
    was given; None means EngineConfig's default. `--ctx` is `max_model_len`; `fixed`
    overrides what the command decides itself."""
    engine = {k: options[k] for k in ENGINE_OPTIONS if options.get(k) is not None}
    if options.get("ctx") is not None:
        engine["max_model_len"] = options["ctx"]
    engine = {k: v for k, v in (engine | fixed).items() if v is not None}
    spec = {k: options[k] for k in LLM_OPTIONS if k in options}
    with Console(stderr=True).status("loading model"):
        return LLM(options.get("model"), backend=options["backend"], **spec, **engine)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="prompt text ('-' reads stdin)")],
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_mb: KVCacheOpt = None,
    kv_cache_dtype: KVDtypeOpt = None,
    kv_window: KVWindowOpt = None,
    kv_sinks: KVSinksOpt = None,
    memory_budget: BudgetOpt = None,
    ctx: CtxOpt = None,
    verbose: VerboseOpt = False,
    llamacpp_type: LlamaCppTypeOpt = None,
    chat: Annotated[bool, typer.Option("--chat", help="format PROMPT as a user message")] = False,
    system: Annotated[str | None, typer.Option(help="system prompt (with --chat)")] = None,
    max_tokens: MaxTokens = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    speculative: SpecOpt = "off",
    draft_model: DraftOpt = None,
    num_draft_tokens: DraftTokensOpt = None,
):
    """Complete PROMPT (streamed to stdout)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        max_tokens=max_tokens,
        stop=stop or [],
    )
    llm = _llm(locals())
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        stream = llm.stream_chat(messages, params)
    else:
        stream = llm.stream(prompt, params)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_stats(llm.last_output)


def _print_stats(out: RequestOutput) -> None:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    err = Console(stderr=True)
    err.print(
        f"[dim]{len(out.prompt_token_ids)} prompt tokens, {n} generated, "
        f"ttft {(m.ttft_s or 0) * 1000:.0f} ms, {m.decode_tokens_per_s:.1f} tok/s, "
        f"finish: {out.outputs[0].finish_reason}[/dim]"
    )
    if m.spec is not None:
        err.print(
            f"[dim]speculative: {m.spec.accepted}/{m.spec.proposed} drafted tokens "
            f"accepted ({m.spec.acceptance_rate:.0%}), "
            f"{m.spec.tokens_per_forward:.2f} tokens per target forward[/dim]"
        )


@app.command()
def chat(
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_mb: KVCacheOpt = None,
    kv_cache_dtype: KVDtypeOpt = None,
    kv_window: KVWindowOpt = None,
    kv_sinks: KVSinksOpt = None,
    memory_budget: BudgetOpt = None,
    ctx: CtxOpt = None,
    verbose: VerboseOpt = False,
    llamacpp_type: LlamaCppTypeOpt = None,
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    max_tokens: MaxTokens = 512,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int | None = None,
    speculative: SpecOpt = "off",
    draft_model: DraftOpt = None,
    num_draft_tokens: DraftTokensOpt = None,
):
    """Interactive chat with history, formatted by the model's chat template."""
    llm = _llm(locals())
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
    run_chat(llm, params, system)


@app.command()
def serve(
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_mb: KVCacheOpt = None,
    kv_cache_dtype: KVDtypeOpt = None,
    kv_window: KVWindowOpt = None,
    kv_sinks: KVSinksOpt = None,
    memory_budget: BudgetOpt = None,
    max_num_seqs: MaxSeqsOpt = None,
    ctx: CtxOpt = None,
    verbose: VerboseOpt = False,
    llamacpp_type: LlamaCppTypeOpt = None,
    swap_space_mb: SwapOpt = None,
    preemption: PreemptOpt = None,
    quantize_lm_head: HeadOpt = None,
    host: Annotated[str, typer.Option(help="address to bind (loopback by default)")] = "127.0.0.1",
    port: int = 8000,
    api_key: Annotated[
        str | None, typer.Option(envvar="EDGELLM_API_KEY", help="require this bearer key")
    ] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model id clients use")] = None,
    max_waiting: Annotated[
        int, typer.Option(help="sequences queued beyond --max-num-seqs; more get 429")
    ] = 256,
    max_body_mb: Annotated[
        float, typer.Option(help="request bodies larger than this get 413")
    ] = 8.0,
    parse_special_tokens: Annotated[
        bool,
        typer.Option(
            help="parse special-token text in chat messages as control tokens (lets a user "
            "forge turns; off: only the chat template's markup is)"
        ),
    ] = False,
    speculative: SpecOpt = "off",
    draft_model: DraftOpt = None,
    num_draft_tokens: DraftTokensOpt = None,
):
    """OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /metrics)."""
    llm = _llm(locals())
    name = served_model_name or model or "smollm2-135m"
    typer.echo(f"serving {name} on http://{host}:{port}/v1 (backend {llm.backend_name})", err=True)
    config = ServerConfig(host, port, name, api_key, max_waiting, max_body_mb, parse_special_tokens)
    run_server(llm, config)


@app.command()
def bench(
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    dtype: DtypeOpt = None,
    kv_cache_mb: KVCacheOpt = None,
    kv_cache_dtype: KVDtypeOpt = None,
    kv_window: KVWindowOpt = None,
    kv_sinks: KVSinksOpt = None,
    verbose: VerboseOpt = False,
    llamacpp_type: LlamaCppTypeOpt = None,
    quantize_lm_head: HeadOpt = None,
    url: Annotated[
        str | None, typer.Option(help="OpenAI-compatible server (default: in-process engine)")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EDGELLM_API_KEY")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model id at --url")] = None,
    concurrency: Annotated[
        list[int] | None, typer.Option("--concurrency", "-c", help="level (repeat to sweep)")
    ] = None,
    rate: Annotated[float | None, typer.Option(help="Poisson arrivals per second")] = None,
    num_requests: int = 32,
    prompt_len: int = 128,
    output_len: int = 64,
    dist: Annotated[str, typer.Option(help="fixed | uniform | exponential")] = "fixed",
    prompt_file: Annotated[str | None, typer.Option(help="one prompt per line")] = None,
    out: Annotated[
        str, typer.Option(help="JSON report (PNG beside it)")
    ] = "bench/results/serve.json",
    seed: int = 0,
):
    """Load test: TTFT, TPOT, end-to-end P50/P90/P99 and throughput; writes JSON + PNG."""
    levels = concurrency or [1, 4, 16]
    if url:
        target = loadgen.HTTPTarget(url, served_model_name or model or "smollm2-135m", api_key)
        tok, where = load_model(model).tokenizer, url
    else:
        llm = _llm(locals(), max_num_seqs=max(levels))
        target = loadgen.EngineTarget(AsyncEngine(llm.engine))
        tok, where = llm.tokenizer, f"in-process {llm.backend_name} engine"
    work = loadgen.make_workload(tok, num_requests, prompt_len, output_len, dist, seed, prompt_file)
    results = loadgen.sweep(target, work, levels, rate)
    meta = {
        "target": where,
        "model": model or "smollm2-135m",
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "dist": dist,
        "title": f"{model or 'smollm2-135m'} on {where}: {num_requests} requests, "
        f"prompt {prompt_len} / output {output_len} tokens",
    }
    png = loadgen.write_report(results, meta, Path(out))
    typer.echo(loadgen.format_table(results))
    typer.echo(f"wrote {out} and {png}")


@app.command()
def info(
    model: ModelArg = None,
    memory_budget: BudgetOpt = None,
    backend: BackendOpt = "auto",
    dtype: DtypeOpt = None,
    kv_cache_dtype: KVDtypeOpt = None,
    kv_window: KVWindowOpt = None,
    kv_sinks: KVSinksOpt = None,
    ctx: CtxOpt = None,
):
    """What a model is (architecture, sizes, tensor types, tokenizer) and which backends
    this machine has, with the one --backend auto picks; with --memory-budget, the plan:
    weights, working memory, and how many sequences of what length fit in the KV pool."""
    console = Console()
    console.print(render_info(model_info(model)))
    if memory_budget is None:
        console.print(backends_table())
        return
    fields = {
        "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "max_model_len": ctx,
        "kv_window": kv_window, "kv_sinks": kv_sinks,
    }  # fmt: skip
    config = EngineConfig().replace(**{k: v for k, v in fields.items() if v is not None})
    plan = plan_memory(load_model(model), config, resolve_backend(backend), parse_size(memory_budget))
    console.print(memory_plan_table(plan))


@eval_app.command("ppl")
def eval_ppl(
    model: ModelArg = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    dtype: DtypeOpt = None,
    verbose: VerboseOpt = False,
    llamacpp_type: LlamaCppTypeOpt = None,
    kv_window: KVWindowOpt = None,
    kv_sinks: KVSinksOpt = None,
    text: Annotated[
        str, typer.Option(help="sotu | sotu-calib | shakespeare | a text file")
    ] = "sotu",
    ctx: Annotated[int, typer.Option(help="window length in tokens")] = 512,
    stride: Annotated[int | None, typer.Option(help="window stride (default: ctx)")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="score only the first N tokens")] = None,
):
    """Perplexity on a built-in text or a file (sliding window)."""
    llm = _llm(locals(), max_num_batched_tokens=ctx, max_model_len=None)
    tokens = llm.tokenizer.encode(load_text(text), add_special_tokens=False)[:max_tokens]
    r = perplexity(llm.score, tokens, ctx, stride, progress=True)
    Console().print(
        f"perplexity {r.ppl:.4f} on {text} ({r.tokens_scored} tokens scored, "
        f"{r.windows} windows of {r.ctx}, stride {r.stride}, backend {llm.backend_name})"
    )


@app.command()
def convert(
    model: Annotated[str, typer.Argument(help="GGUF file (or any loadable model)")],
    out_dir: Annotated[str, typer.Argument(help="output Hugging Face directory")],
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "bfloat16",
    force: ForceOpt = False,
):
    """Write a Hugging Face directory (safetensors, config, tokenizer) transformers loads."""
    out = convert_to_hf(model, out_dir, dtype, force)
    typer.echo(f"wrote {out}")


@app.command()
def quantize(
    model: ModelArg = None,
    out: Annotated[str, typer.Option("--out", "-o", help="output checkpoint directory")] = "",
    method: Annotated[str, typer.Option(help="rtn | awq | gptq")] = "awq",
    bits: Annotated[int, typer.Option(help="2-8")] = 4,
    group_size: Annotated[int, typer.Option(help="32 | 64 | 128 | -1 (per-channel)")] = 128,
    sym: Annotated[
        bool, typer.Option("--sym/--asym", help="symmetric or asymmetric groups")
    ] = True,
    calib: Annotated[
        str, typer.Option(help="mix (sotu + shakespeare) | sotu | shakespeare | a .txt or .jsonl file")
    ] = "mix",
    samples: Annotated[int, typer.Option(help="calibration samples")] = 32,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration sample")] = 512,
    seed: int = 0,
    chat_template: Annotated[bool, typer.Option(help="format calibration text as chat")] = False,
    act_order: Annotated[bool, typer.Option(help="GPTQ activation order (static groups)")] = True,
    compute: Annotated[
        str,
        typer.Option(
            help="auto | float32 | bfloat16: the calibration forwards' matrix products "
            "(auto: bfloat16 where the CPU multiplies it natively)"
        ),
    ] = "auto",
    eval_: Annotated[
        bool, typer.Option("--eval", help="perplexity before/after on held-out sotu")
    ] = False,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            "--memory-budget",
            help="e.g. 4GB: refuse before starting when the estimate exceeds it "
            "(default: the memory available)",
        ),
    ] = None,
    force: ForceOpt = False,
):
    """Quantize to INT4 (or 2-8 bits) into a compressed-tensors checkpoint, layer by layer."""
    if not out:
        raise InvalidParameterError("--out/-o is required")
    opts = QuantizeOptions(
        method, bits, group_size, sym, calib, samples, seq_len, seed, chat_template, act_order,
        compute=compute,
    )  # fmt: skip
    report = run_quantize(
        model, out, opts, force=force, eval_text="sotu" if eval_ else None,
        measure_ppl=measure_ppl, memory_budget=parse_size(memory_budget) if memory_budget else None,
    )  # fmt: skip
    print_report(report)


@app.command()
def prune(
    model: ModelArg = None,
    out: Annotated[str, typer.Option("--out", "-o", help="output HF directory")] = "",
    drop_layers: Annotated[
        int, typer.Option(help="decoder layers to remove (lowest Block Influence first)")
    ] = 0,
    mlp_width: Annotated[
        int | None, typer.Option(help="MLP channels kept per layer (a multiple of 32)")
    ] = None,
    heads: Annotated[
        int | None, typer.Option(help="query heads kept per layer (whole KV groups)")
    ] = None,
    calib: Annotated[str, typer.Option(help="sotu | shakespeare | a .txt or .jsonl file")] = "sotu",
    samples: Annotated[int, typer.Option(help="calibration samples")] = 32,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration sample")] = 256,
    seed: int = 0,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "bfloat16",
    force: ForceOpt = False,
):
    """Structured pruning of a float model into a smaller one of the same architecture
    (layers by Block Influence, MLP channels and KV groups by activation); `edgellm distill`
    with the same options prunes and then recovers the quality by distillation."""
    if not out:
        raise InvalidParameterError("--out/-o is required")
    opts = PruneOptions(drop_layers, mlp_width, heads, 32, calib, samples, seq_len, seed, dtype)
    path, plan, imp = run_prune(model, out, opts, force=force, progress=True)
    a = load_model(str(path)).args
    influence = ", ".join(f"{i}:{b:.3f}" for i, b in enumerate(imp.block_influence))
    print(f"block influence (layer:BI): {influence}")
    print(
        f"kept layers {plan.layers}; {a.num_hidden_layers} layers, MLP {a.intermediate_size}, "
        f"{a.num_attention_heads}/{a.num_key_value_heads} heads -> {path}"
    )


@app.command()
def distill(
    model: ModelArg = None,
    out: Annotated[str, typer.Option("--out", "-o", help="output directory")] = "",
    bits: Annotated[
        int | None, typer.Option(help="distil into INT (4): learn scales/zero points from --init")
    ] = None,
    group_size: Annotated[int, typer.Option(help="INT group size (-1: per channel)")] = 128,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="symmetric or asymmetric groups")] = True,
    init: Annotated[str, typer.Option(help="INT start: awq | gptq | rtn")] = "awq",
    drop_layers: Annotated[int, typer.Option(help="prune: decoder layers to remove")] = 0,
    mlp_width: Annotated[int | None, typer.Option(help="prune: MLP channels kept")] = None,
    heads: Annotated[int | None, typer.Option(help="prune: query heads kept")] = None,
    student: Annotated[
        str | None, typer.Option(help="an existing student (pruned model or INT checkpoint)")
    ] = None,
    loss: Annotated[str, typer.Option(help="kl (to the teacher) | ce (plain fine-tuning)")] = "kl",
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 120,
    batch: Annotated[int, typer.Option(help="windows per step")] = 2,
    seq_len: Annotated[int, typer.Option(help="tokens per window")] = 256,
    lr: Annotated[
        float | None, typer.Option(help="peak learning rate (default 1e-3 INT, 1e-4 float)")
    ] = None,
    train_embeddings: Annotated[
        bool, typer.Option("--train-embeddings/--freeze-embeddings", help="train the embeddings")
    ] = False,
    calib: Annotated[str, typer.Option(help="sotu | shakespeare | a .txt or .jsonl file")] = "sotu",
    chat_template: Annotated[bool, typer.Option(help="JSONL messages through the chat template")] = False,
    eval_text: Annotated[
        str | None, typer.Option(help="also track perplexity on a built-in text (sotu, shakespeare)")
    ] = None,
    seed: int = 0,
    resume: Annotated[bool, typer.Option(help="continue an interrupted run (same options)")] = False,
    force: ForceOpt = False,
):
    """Distil the float MODEL (the teacher) into an INT4 checkpoint (--bits 4) or a pruned
    model (--drop-layers/--mlp-width/--heads): the student learns the teacher's logits."""
    if not out:
        raise InvalidParameterError("--out/-o is required")
    opts = DistillOptions(
        bits=bits, group_size=group_size, symmetric=sym, init=init, drop_layers=drop_layers,
        mlp_width=mlp_width, heads=heads, student=student, loss=loss, steps=steps, batch=batch,
        seq_len=seq_len, lr=lr, freeze_embeddings=not train_embeddings, calib=calib,
        chat_template=chat_template, seed=seed,
    )  # fmt: skip
    try:
        report = run_distill(model, out, opts, force=force, resume=resume, eval_text=eval_text)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    print_distill_report(report)


@export_app.command("gguf")
def export_gguf(
    model: Annotated[
        str | None, typer.Argument(help="edgellm checkpoint, HF directory or GGUF")
    ] = None,
    out: Annotated[str, typer.Option("--out", "-o", help="output .gguf file")] = "",
    type_: Annotated[
        str,
        typer.Option(
            "--type",
            help="auto (INT4 -> Q4_0/Q4_1 exactly, float -> F16) | q4_0 | q4_1 | q8_0 | f16",
        ),
    ] = "auto",
    dense_type: Annotated[
        str,
        typer.Option(
            help="an INT checkpoint's embeddings and LM head: auto (as stored) | f16 | "
            "q8_0 (lossy: half the bytes of bf16)"
        ),
    ] = "auto",
    force: ForceOpt = False,
):
    """Write one GGUF file llama.cpp runs; INT4 groups become Q4_0/Q4_1 blocks unchanged."""
    if not out:
        raise InvalidParameterError("--out/-o is required")
    path = write_gguf(model, out, type_, force=force, progress=True, dense_type=dense_type)
    typer.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


@export_app.command("mlx")
def export_mlx(
    model: Annotated[
        str | None, typer.Argument(help="edgellm checkpoint, HF directory or GGUF")
    ] = None,
    out: Annotated[str, typer.Option("--out", "-o", help="output directory")] = "",
    dtype: Annotated[
        str,
        typer.Option(help="float tensors: auto (as stored) | float32 | float16 | bfloat16"),
    ] = "auto",
    scale_dtype: Annotated[
        str,
        typer.Option(
            help="auto (float16 where every scale and bias is exact there, else float32) | "
            "float16 | float32"
        ),
    ] = "auto",
    force: ForceOpt = False,
):
    """Write a directory mlx_lm.load opens as it is; INT4 groups become MLX affine groups
    unchanged (scales as stored, bias = -scale * (zero + 8))."""
    if not out:
        raise InvalidParameterError("--out/-o is required")
    path, weights = write_mlx(model, out, dtype, scale_dtype, force=force)
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    typer.echo(f"wrote {path} ({size:.1f} MiB): {describe_export(weights)}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=file or sys.stderr)


def main() -> None:
    """Entry point: user errors are one line on stderr, never a traceback; warnings too."""
    warnings.showwarning = _show_warning
    try:
        app()
    except EdgeLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
