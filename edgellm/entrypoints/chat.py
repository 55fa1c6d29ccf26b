"""The interactive chat loop behind `edgellm chat`: streaming answers, history, slash commands."""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from edgellm.engine.outputs import RequestMetrics
from edgellm.sampling.params import SamplingParams

HELP = (
    "/help  /reset  /system TEXT  /stats  /save FILE  /exit"
    "    (Ctrl-C stops an answer, Ctrl-D quits)"
)


@dataclass
class ChatSession:
    """A conversation: system prompt, history and per-session counters."""

    system: str | None = None
    history: list[dict] = field(default_factory=list)
    turns: int = 0
    generated_tokens: int = 0
    last_metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def reset(self) -> None:
        self.history.clear()

    def save(self, path: str) -> Path:
        out = Path(path).expanduser()
        out.write_text(json.dumps({"messages": self.messages()}, indent=2, ensure_ascii=False))
        return out


def status_line(m: RequestMetrics) -> str:
    """`ttft 120 ms · 31.5 tok/s` (plus `acceptance 72%` when speculation drafted tokens)."""
    parts = [f"ttft {(m.ttft_s or 0) * 1000:.0f} ms", f"{m.decode_tokens_per_s:.1f} tok/s"]
    if m.spec is not None:
        parts.append(f"acceptance {m.spec.acceptance_rate:.0%} of {m.spec.proposed} drafted")
    return " · ".join(parts)


class Interrupt:
    """Ctrl-C while an answer streams sets a flag the stream loop reads between tokens: a
    KeyboardInterrupt raised at an arbitrary point inside the engine or llama.cpp could
    leave block tables or cells half-updated. At the prompt it raises as usual."""

    def __init__(self):
        self.streaming = False
        self.requested = False

    def __call__(self, signum, frame) -> None:
        if self.streaming:
            self.requested = True
            return
        raise KeyboardInterrupt


INTERRUPT = Interrupt()


def run_chat(llm, params: SamplingParams, system: str | None = None) -> None:
    # our own handler, also when the shell started us with SIGINT ignored (a job started
    # with `&` by a non-interactive shell inherits SIG_IGN, and Python keeps it)
    signal.signal(signal.SIGINT, INTERRUPT)
    err = Console(stderr=True, highlight=False)
    session = ChatSession(system)
    err.print(f"[dim]backend {llm.backend_name} · {HELP}[/dim]")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        except KeyboardInterrupt:  # at the prompt: a fresh line, not an exit
            sys.stdout.write("\n")
            continue
        if not line:
            continue
        if line.startswith("/"):
            if _command(line, session, llm, err):
                break
            continue
        try:
            _turn(llm, session, line, params, err)
        except KeyboardInterrupt:  # between the prompt and the answer: no turn happened
            err.print("[dim]stopped[/dim]")


def _command(line: str, session: ChatSession, llm, err) -> bool:
    """Run one slash command; True means quit."""
    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    if cmd in ("/exit", "/quit"):
        return True
    if cmd == "/reset":
        session.reset()
        err.print("[dim]history cleared[/dim]")
    elif cmd == "/system":
        session.system = arg or None
        session.reset()
        err.print(f"[dim]system prompt {'set' if arg else 'cleared'}; history cleared[/dim]")
    elif cmd == "/stats":
        err.print(_stats(session, llm))
    elif cmd == "/save" and arg:
        err.print(f"[dim]saved {len(session.messages())} messages to {session.save(arg)}[/dim]")
    else:
        err.print(HELP)
    return False


def _stats(session: ChatSession, llm) -> str:
    m = llm.engine.metrics()
    return (
        f"turns {session.turns} · generated {session.generated_tokens} tokens · "
        f"last: {status_line(session.last_metrics)} · KV blocks {m['blocks_used']}/"
        f"{m['blocks_total']} · prefix-cache hit rate {m['prefix_cache_hit_rate']:.0%} · "
        f"backend {llm.backend_name}"
    )


def _turn(llm, session: ChatSession, line: str, params: SamplingParams, err) -> None:
    session.history.append({"role": "user", "content": line})
    llm.last_output = None
    answer, stopped = _answer(llm, session.messages(), params)
    out = llm.last_output
    if out is None:  # Ctrl-C before the request started: the turn did not happen
        session.history.pop()
        err.print("[dim]stopped[/dim]")
        return
    session.history.append({"role": "assistant", "content": answer})
    session.turns += 1
    session.generated_tokens += len(out.outputs[0].token_ids)
    session.last_metrics = out.metrics
    note = " · stopped" if stopped else ""
    err.print(f"[dim]{status_line(out.metrics)}{note}[/dim]")


def _answer(llm, messages: list[dict], params: SamplingParams) -> tuple[str, bool]:
    parts = []
    stream = None
    INTERRUPT.streaming, INTERRUPT.requested = True, False
    try:  # Ctrl-C (at any point, even before the first token) is seen between tokens
        stream = llm.stream_chat(messages, params)
        for delta in stream:
            if INTERRUPT.requested:
                break
            parts.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
    finally:
        INTERRUPT.streaming = False
        if stream is not None:
            stream.close()  # aborts the request (if unfinished) and frees its KV blocks
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts), INTERRUPT.requested
