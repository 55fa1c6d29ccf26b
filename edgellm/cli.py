"""The `edgellm` command. Thin: each command parses options and calls the library."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

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
BackendOpt = Annotated[str, typer.Option("--backend", "-b", help="torch | llamacpp | auto")]
ThreadsOpt = Annotated[
    int | None, typer.Option("--threads", "-t", help="CPU threads (default: all cores)")
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="tokens to generate at most")]
SpecOpt = Annotated[str, typer.Option("--speculative", help="ngram | draft | off")]
DraftOpt = Annotated[str | None, typer.Option("--draft-model", help="draft model (same tokenizer)")]
DraftTokensOpt = Annotated[
    int, typer.Option("--num-draft-tokens", help="most tokens drafted a step")
]


def _params(**kw):
    from edgellm.sampling_params import SamplingParams

    return SamplingParams(**kw)


def _llm(model, backend, threads=None, **kw):
    from rich.console import Console

    from edgellm.llm import LLM

    with Console(stderr=True).status("loading model"):
        return LLM(model, backend=backend, threads=threads, **kw)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="prompt text ('-' reads stdin)")],
    model: ModelOpt = None,
    backend: BackendOpt = "torch",
    threads: ThreadsOpt = None,
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
    ctx: Annotated[int | None, typer.Option(help="context length limit")] = None,
    speculative: SpecOpt = "off",
    draft_model: DraftOpt = None,
    num_draft_tokens: DraftTokensOpt = 4,
):
    """Complete PROMPT (streamed to stdout)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    params = _params(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        max_tokens=max_tokens,
        stop=stop or [],
    )
    llm = _llm(
        model,
        backend,
        threads,
        max_model_len=ctx,
        **_spec_kw(speculative, draft_model, num_draft_tokens),
    )
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


def _print_stats(out) -> None:
    from rich.console import Console

    m = out.metrics
    n = len(out.outputs[0].token_ids)
    Console(stderr=True).print(
        f"[dim]{len(out.prompt_token_ids)} prompt tokens, {n} generated, "
        f"ttft {m.get('ttft_s', 0) * 1000:.0f} ms, {m.get('decode_tokens_per_s', 0):.1f} tok/s, "
        f"finish: {out.outputs[0].finish_reason}[/dim]"
    )
    if "spec_proposed" in m:
        Console(stderr=True).print(
            f"[dim]speculative: {m['spec_accepted']}/{m['spec_proposed']} drafted tokens "
            f"accepted ({m['spec_acceptance_rate']:.0%}), "
            f"{m['spec_tokens_per_forward']:.2f} tokens per target forward[/dim]"
        )


def _spec_kw(speculative: str, draft_model: str | None, num_draft_tokens: int) -> dict:
    return dict(speculative=speculative, draft_model=draft_model, num_draft_tokens=num_draft_tokens)


@app.command()
def chat(
    model: ModelOpt = None,
    backend: Annotated[
        str, typer.Option("--backend", "-b", help="auto (MLX, Triton, llama.cpp, torch) or one")
    ] = "auto",
    threads: ThreadsOpt = None,
    system: Annotated[str | None, typer.Option(help="system prompt")] = None,
    max_tokens: MaxTokens = 512,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int | None = None,
    speculative: SpecOpt = "off",
    draft_model: DraftOpt = None,
    num_draft_tokens: DraftTokensOpt = 4,
):
    """Interactive chat with history, formatted by the model's chat template."""
    from edgellm.chat import run_chat

    llm = _llm(model, backend, threads, **_spec_kw(speculative, draft_model, num_draft_tokens))
    params = _params(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
    run_chat(llm, params, system)


@app.command()
def serve(
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    host: Annotated[str, typer.Option(help="address to bind (loopback by default)")] = "127.0.0.1",
    port: int = 8000,
    api_key: Annotated[
        str | None, typer.Option(envvar="EDGELLM_API_KEY", help="require this bearer key")
    ] = None,
    served_model_name: Annotated[str | None, typer.Option(help="model id clients use")] = None,
    kv_cache_mb: float = 512,
    max_num_seqs: int = 64,
    max_waiting: Annotated[int, typer.Option(help="queued requests beyond this get 429")] = 256,
    ctx: Annotated[int | None, typer.Option(help="context length limit")] = None,
    speculative: SpecOpt = "off",
    draft_model: DraftOpt = None,
    num_draft_tokens: DraftTokensOpt = 4,
):
    """OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /metrics)."""
    from edgellm.serve import ServerConfig, run_server

    llm = _llm(
        model,
        backend,
        threads,
        kv_cache_mb=kv_cache_mb,
        max_num_seqs=max_num_seqs,
        max_model_len=ctx,
        **_spec_kw(speculative, draft_model, num_draft_tokens),
    )
    name = served_model_name or model or "smollm2-135m"
    typer.echo(f"serving {name} on http://{host}:{port}/v1 (backend {llm.backend_name})", err=True)
    run_server(llm, ServerConfig(host, port, name, api_key, max_waiting))


@app.command()
def bench(
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
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
    from pathlib import Path

    from edgellm import loadgen

    levels = concurrency or [1, 4, 16]
    if url:
        from edgellm.loaders.model import load_model

        target = loadgen.HTTPTarget(url, served_model_name or model or "smollm2-135m", api_key)
        tok, where = load_model(model).tokenizer, url
    else:
        from edgellm.async_engine import AsyncEngine

        llm = _llm(model, backend, threads, max_num_seqs=max(levels))
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
    model: Annotated[
        str | None, typer.Argument(help="GGUF file, HF directory or short name")
    ] = None,
):
    """Architecture, parameters, tensor types and bits/weight, context, tokenizer, template."""
    from rich.console import Console

    from edgellm.info import model_info, render_info

    Console().print(render_info(model_info(model)))


@eval_app.command("ppl")
def eval_ppl(
    model: Annotated[
        str | None, typer.Argument(help="GGUF file, HF directory or short name")
    ] = None,
    backend: BackendOpt = "torch",
    threads: ThreadsOpt = None,
    text: Annotated[
        str, typer.Option(help="sotu | sotu-calib | shakespeare | a text file")
    ] = "sotu",
    ctx: Annotated[int, typer.Option(help="window length in tokens")] = 512,
    stride: Annotated[int | None, typer.Option(help="window stride (default: ctx)")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="score only the first N tokens")] = None,
):
    """Perplexity on a built-in text or a file (sliding window)."""
    from rich.console import Console

    from edgellm.evaluate import perplexity
    from edgellm.texts import load_text

    llm = _llm(model, backend, threads, max_model_len=None, max_num_batched_tokens=ctx)
    tokens = llm.tokenizer.encode(load_text(text), add_special_tokens=False)[:max_tokens]
    r = perplexity(llm.score, tokens, ctx, stride, progress=True)
    Console().print(
        f"perplexity {r.ppl:.4f} on {text} ({r.tokens_scored} tokens scored, "
        f"{r.windows} windows of {r.ctx}, stride {r.stride})"
    )


@app.command()
def convert(
    model: Annotated[str, typer.Argument(help="GGUF file (or any loadable model)")],
    out_dir: Annotated[str, typer.Argument(help="output Hugging Face directory")],
    dtype: Annotated[str, typer.Option(help="float32 | float16 | bfloat16")] = "bfloat16",
    force: Annotated[bool, typer.Option("--force", help="replace OUT_DIR if it exists")] = False,
):
    """Write a Hugging Face directory (safetensors, config, tokenizer) transformers loads."""
    from edgellm.convert import convert_to_hf

    out = convert_to_hf(model, out_dir, dtype, force)
    typer.echo(f"wrote {out}")


@app.command()
def quantize(
    model: Annotated[
        str | None, typer.Argument(help="GGUF file, HF directory or short name")
    ] = None,
    out: Annotated[str, typer.Option("--out", "-o", help="output checkpoint directory")] = "",
    method: Annotated[str, typer.Option(help="rtn | awq | gptq")] = "awq",
    bits: Annotated[int, typer.Option(help="2-8")] = 4,
    group_size: Annotated[int, typer.Option(help="32 | 64 | 128 | -1 (per-channel)")] = 128,
    sym: Annotated[
        bool, typer.Option("--sym/--asym", help="symmetric or asymmetric groups")
    ] = True,
    calib: Annotated[str, typer.Option(help="sotu | shakespeare | a .txt or .jsonl file")] = "sotu",
    samples: Annotated[int, typer.Option(help="calibration samples")] = 32,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration sample")] = 512,
    seed: int = 0,
    chat_template: Annotated[bool, typer.Option(help="format calibration text as chat")] = False,
    act_order: Annotated[bool, typer.Option(help="GPTQ activation order (static groups)")] = True,
    eval_: Annotated[
        bool, typer.Option("--eval", help="perplexity before/after on held-out sotu")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
):
    """Quantize to INT4 (or 2-8 bits) into a compressed-tensors checkpoint, layer by layer."""
    from edgellm.errors import InvalidParameterError
    from edgellm.quantize.pipeline import QuantizeOptions, print_report, quantize

    if not out:
        raise InvalidParameterError("--out/-o is required")
    opts = QuantizeOptions(
        method, bits, group_size, sym, calib, samples, seq_len, seed, chat_template, act_order
    )
    report = quantize(model, out, opts, force=force, eval_text="sotu" if eval_ else None)
    print_report(report)


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
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
):
    """Write one GGUF file llama.cpp runs; INT4 groups become Q4_0/Q4_1 blocks unchanged."""
    from edgellm.errors import InvalidParameterError
    from edgellm.quantize.export_gguf import export_gguf

    if not out:
        raise InvalidParameterError("--out/-o is required")
    path = export_gguf(model, out, type_, force=force, progress=True)
    typer.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def main() -> None:
    """Entry point: user errors are one line on stderr, never a traceback."""
    from edgellm.errors import EdgeLLMError

    try:
        app()
    except EdgeLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
