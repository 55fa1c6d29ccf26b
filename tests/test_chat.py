"""`edgellm chat` through a pseudo-terminal: streaming, slash commands, Ctrl-C, /exit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

EDGELLM = str(Path(sys.executable).with_name("edgellm"))
STATUS = r"ttft \d+ ms · [\d.]+ tok/s"


@pytest.fixture
def repl():
    child = pexpect.spawn(
        EDGELLM,
        # room for a long answer: Ctrl-C must land while it streams (~50 tok/s on F16)
        ["chat", "--temperature", "0", "--max-tokens", "400", "--system", "You are a poet."],
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
    )
    # --backend auto (the default) picks llama.cpp on a CPU where it is installed
    from edgellm.backends.registry import resolve_backend

    child.expect(f"backend {resolve_backend('auto')}")
    child.expect("> ")
    yield child
    child.close(force=True)


@pytest.mark.slow
def test_chat_repl(repl, tmp_path):
    repl.sendline("What is the capital of France? Answer in one word.")
    repl.expect("Paris")
    repl.expect(STATUS)
    repl.expect("> ")

    repl.sendline("/stats")
    repl.expect(r"turns 1 · generated \d+ tokens")
    repl.expect("> ")

    saved = tmp_path / "chat.json"
    repl.sendline(f"/save {saved}")
    repl.expect("saved 3 messages")
    repl.expect("> ")
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[0]["content"] == "You are a poet."
    assert "Paris" in messages[2]["content"]

    repl.sendline("Write a very long poem about the sea, with many verses.")
    repl.expect(r"verses\.\r\n")  # the terminal's echo of the line
    repl.expect(r"\w+ \w+ \w+")  # the answer is streaming
    repl.sendintr()  # Ctrl-C: stop the answer, stay in the REPL
    repl.expect("stopped")
    repl.expect("> ")

    repl.sendline("Another poem, please.")
    repl.sendintr()  # Ctrl-C at once: wherever it lands (prompt, template, prefill), no exit
    repl.expect("> ")

    repl.sendline("/reset")
    repl.expect("history cleared")
    repl.expect("> ")
    repl.sendline("/system You answer in French.")
    repl.expect("system prompt set")
    repl.expect("> ")
    path2 = tmp_path / "after.json"
    repl.sendline(f"/save {path2}")
    repl.expect("saved 1 messages")
    repl.expect("> ")
    assert json.loads(path2.read_text())["messages"] == [
        {"role": "system", "content": "You answer in French."}
    ]

    repl.sendline("/exit")
    repl.expect(pexpect.EOF)
    repl.wait()
    assert repl.exitstatus == 0


@pytest.mark.slow
def test_chat_speculative_shows_the_acceptance_rate():
    child = pexpect.spawn(
        EDGELLM,
        ["chat", "--temperature", "0", "--max-tokens", "64", "--speculative", "ngram"],
        encoding="utf-8",
        timeout=180,
        dimensions=(40, 200),
    )
    try:
        child.expect("> ")
        text = "the cat sat on the mat and the dog sat on the log"
        child.sendline(f"Repeat this sentence three times: {text}")
        # the status line carries the acceptance of what the n-gram proposer drafted
        child.expect(STATUS + r" · acceptance \d+% of [1-9]\d* drafted")
        child.expect("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
