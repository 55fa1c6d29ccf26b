"""The interactive chat loop behind `edgellm chat`."""

from __future__ import annotations

import sys

from edgellm.sampling_params import SamplingParams

HELP = "/help  /reset  /system TEXT  /exit    (Ctrl-C stops an answer, Ctrl-D quits)"


def run_chat(llm, params: SamplingParams, system: str | None = None) -> None:
    from rich.console import Console

    err = Console(stderr=True)
    history: list[dict] = []
    err.print(f"[dim]{HELP}[/dim]")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            if cmd == "/exit":
                break
            if cmd == "/reset":
                history.clear()
            elif cmd == "/system":
                system = arg or None
                history.clear()
            else:
                err.print(HELP)
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        answer = _answer(llm, messages, params)
        history.append({"role": "assistant", "content": answer})
        m = llm.last_output.metrics
        err.print(
            f"[dim]ttft {m.get('ttft_s', 0) * 1000:.0f} ms · {m.get('decode_tokens_per_s', 0):.1f} tok/s[/dim]"
        )


def _answer(llm, messages: list[dict], params: SamplingParams) -> str:
    parts = []
    stream = llm.stream_chat(messages, params)
    try:
        for delta in stream:
            parts.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()  # aborts the request and frees its KV blocks
    sys.stdout.write("\n")
    return "".join(parts)
