"""Calibration data: token windows from built-in texts, a text file or a JSONL file.

Built-in texts calibrate on their calibration splits, so that perplexity on the built-in
text is measured on text the quantizer never saw: `sotu` on the addresses before 2000
(`sotu-calib`), `shakespeare` on the other half of the works (`shakespeare-calib`).
`mix` (the default) draws its windows alternately from both calibration splits: speeches
and plays, prose and verse, so that one domain's statistics do not decide the scales and
the error compensation (with `sotu` alone, GPTQ won back half of RTN's loss on held-out
speeches but a sixth on Shakespeare at Qwen 1.5B).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from edgellm.errors import InvalidParameterError
from edgellm.loaders.texts import BUILTIN, text_documents

CALIBRATION_SPLITS = {"sotu": "sotu-calib", "shakespeare": "shakespeare-calib"}
MIXES = {"mix": ("sotu", "shakespeare")}  # windows drawn alternately from these sources
DEFAULT_CALIBRATION = "mix"


def calibration_documents(source: str, tokenizer=None, chat_template: bool = False) -> list[str]:
    """Documents of a calibration source; JSONL lines are {"text": ...} or {"messages": [...]}."""
    if source in MIXES:
        parts = MIXES[source]
        return [d for p in parts for d in calibration_documents(p, tokenizer, chat_template)]
    name = CALIBRATION_SPLITS.get(source, source)
    if name in BUILTIN or not str(source).endswith(".jsonl"):
        docs = text_documents(name)
        if chat_template:
            docs = [_chat(tokenizer, [{"role": "user", "content": d}]) for d in docs]
        return docs
    return _jsonl_documents(Path(source), tokenizer, chat_template)


def _jsonl_documents(path: Path, tokenizer, chat_template: bool) -> list[str]:
    if not path.is_file():
        raise InvalidParameterError(f"calibration file {path} does not exist")
    docs = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidParameterError(f"{path}:{i} is not valid JSON ({e.msg})") from e
        if isinstance(rec, dict) and "messages" in rec:
            docs.append(
                _chat(tokenizer, rec["messages"])
                if chat_template
                else "\n".join(m.get("content", "") for m in rec["messages"])
            )
        elif isinstance(rec, dict) and isinstance(rec.get("text"), str):
            docs.append(
                _chat(tokenizer, [{"role": "user", "content": rec["text"]}])
                if chat_template
                else rec["text"]
            )
        else:
            raise InvalidParameterError(f'{path}:{i} needs a "text" string or a "messages" list')
    return docs


def _chat(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=False)


def token_stream(
    tokenizer, source: str = DEFAULT_CALIBRATION, chat_template: bool = False
) -> list[int]:
    """The documents of a calibration source as one token stream, each ended by EOS (a mix:
    its sources' streams one after the other)."""
    if source in MIXES:
        return [t for part in MIXES[source] for t in token_stream(tokenizer, part, chat_template)]
    stream: list[int] = []
    for doc in calibration_documents(source, tokenizer, chat_template):
        stream += tokenizer.encode(doc, add_special_tokens=False)
        if tokenizer.eos_id is not None:
            stream.append(tokenizer.eos_id)
    return stream


def calibration_tokens(
    tokenizer,
    source: str = DEFAULT_CALIBRATION,
    n_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    chat_template: bool = False,
) -> list[list[int]]:
    """`n_samples` windows of `seq_len` tokens, drawn at seeded random offsets; from a mix,
    window i comes from its source i mod k (each source its own stream and offsets)."""
    if n_samples < 1 or seq_len < 2:
        raise InvalidParameterError("calibration needs at least 1 sample of at least 2 tokens")
    parts = MIXES.get(source, (source,))
    streams = [token_stream(tokenizer, p, chat_template) for p in parts]
    for part, stream in zip(parts, streams, strict=True):
        if len(stream) < seq_len:
            raise InvalidParameterError(
                f"calibration text {part!r} has {len(stream)} tokens, fewer than one sample of "
                f"{seq_len}"
            )
    rng = random.Random(seed)
    out = []
    for i in range(n_samples):
        stream = streams[i % len(streams)]
        s = rng.randrange(0, len(stream) - seq_len + 1)
        out.append(stream[s : s + seq_len])
    return out
