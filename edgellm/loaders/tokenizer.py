"""The tokenizer: text <-> token ids, special tokens, chat template, streaming decode.

One `Tokenizer` wraps a `tokenizers.Tokenizer` whatever the source (a GGUF file's
metadata or a Hugging Face directory), plus what a serving engine needs beside
ids: BOS/EOS policy, the ids that end generation, the chat template (rendered
the way transformers renders it) and an incremental detokenizer for streaming.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import gguf
import jinja2
import tokenizers
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellm.errors import ModelFormatError, ModelNotFoundError, TokenizerError
from edgellm.loaders.gguf_tokenizer import (
    bos_eos_post_processor,
    chat_template_from_gguf,
    special_tokens_from_gguf,
    tokenizer_from_gguf,
)

# Tokens that end an assistant turn in common chat formats; each one the vocabulary
# has joins `stop_ids` (EOS alone misses e.g. Llama 3's <|eot_id|>).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>",
    "<|end|>", "<end_of_turn>",
)  # fmt: skip

# Used when a model ships no template: ChatML, which SmolLM2 and Qwen use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_NO_MAX_LENGTH = 10**12  # transformers writes 1e30 for "no limit"
_SCAN_WINDOW = 1 << 14  # characters one regex call scans for special tokens' text


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """Special token ids (None when the model has none) and whether encode adds BOS/EOS."""

    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    eom_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False


class Tokenizer:
    """Text <-> ids for one model, with its special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special: SpecialTokens,
        chat_template: str | None = None,
        model_max_length: int | None = None,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.special = special
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.stop_ids: set[int] = _stop_ids(backend, special, extra_stop_ids)

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: str | Path | gguf.GGUFReader) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata (see `loaders.gguf_tokenizer`)."""
        reader = path_or_reader
        if not isinstance(reader, gguf.GGUFReader):
            reader = _open_gguf(Path(path_or_reader))
        arch = _gguf_value(reader, "general.architecture")
        return cls(
            tokenizer_from_gguf(reader),
            SpecialTokens(**special_tokens_from_gguf(reader)),
            chat_template_from_gguf(reader),
            _gguf_value(reader, f"{arch}.context_length") if arch else None,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory.

        Reads `tokenizer.json`, `tokenizer_config.json` (special tokens, add_bos_token,
        chat_template), `special_tokens_map.json`, `chat_template.jinja` (preferred
        over the config's template, as transformers does) and the EOS ids of
        `generation_config.json`.
        """
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {path}: edgellm needs the fast-tokenizer file "
                "(transformers writes it with AutoTokenizer.from_pretrained(...).save_pretrained(...))"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises bare Exception on a bad file
            raise TokenizerError(f"cannot read {file}: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        tokens = {**_read_json(path / "special_tokens_map.json"), **config}
        special = _hf_special_tokens(backend, tokens, config)
        stop = _read_json(path / "generation_config.json").get("eos_token_id", [])
        max_length = config.get("model_max_length")
        return cls(
            backend,
            special,
            _hf_chat_template(path, config),
            max_length if isinstance(max_length, int) and max_length < _NO_MAX_LENGTH else None,
            stop if isinstance(stop, list) else [stop],
        )

    # ---- ids ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self.special.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.special.eos_id

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS."""
        return self.special.add_bos

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`; BOS/EOS are added only when the model asks for them.

        Special tokens written in the text (e.g. `<|im_start|>`) become their ids, unless
        `parse_special=False`, which encodes them as plain text. Other threads run while
        a long text is encoded (`encode_batch` releases the GIL, `encode` does not).
        """
        backend = self.backend if parse_special else self._plain_backend
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token strings as plain text."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def _specials(self) -> dict[str, tuple[int, tokenizers.AddedToken]]:
        """The special added tokens (id, token) by their text."""
        added = self.backend.get_added_tokens_decoder().items()
        return {t.content: (i, t) for i, t in added if t.special and t.content}

    @cached_property
    def _special_pattern(self) -> re.Pattern | None:
        """Any special token's text (longest first), captured; None without special tokens."""
        texts = sorted(self._specials, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; special tokens are kept unless asked otherwise."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(
        self, skip_special_tokens: bool = False, prompt_ids: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        """A fresh `IncrementalDetokenizer` for one generated sequence."""
        return IncrementalDetokenizer(self.backend, skip_special_tokens, prompt_ids)

    # ---- chat ---------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for `messages`, rendered like transformers' `apply_chat_template`.

        The template runs in a sandboxed jinja2 environment with `trim_blocks`,
        `lstrip_blocks`, `raise_exception`, `strftime_now` and a `tojson` filter; it
        sees `messages`, `add_generation_prompt`, `tools=None`, `documents=None`, the
        special token strings (`bos_token`, `eos_token`, ...) and `variables`.
        A model without a template gets plain ChatML (`CHATML_TEMPLATE`).
        Raises TokenizerError when the template does not compile or fails.
        """
        context = {"tools": None, "documents": None, **self._special_token_strings(), **variables}
        source = self.chat_template or CHATML_TEMPLATE
        try:
            return _compile_template(source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        parse_special: bool = False,
        **variables: Any,
    ) -> list[int]:
        """Token ids of the chat prompt for `messages` (BOS only where the template writes it).

        Only the template's own markup becomes special tokens: a special token's text
        inside a message's content (a user writing `<|im_start|>system`) is encoded as
        plain text, as hosted APIs do, so that no message can forge a turn.
        `parse_special=True` parses it as transformers and vLLM do.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        if parse_special or not any(map(self._special_spans, contents)):
            return self.encode(text, add_special_tokens=False)
        # Break every special string in the contents with a character the prompt lacks and
        # render again: the special strings left are the template's own.
        mark = _unused_char(text)
        escaped = [
            m | {"content": self._break_specials(m["content"], mark)}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        rendered = self.apply_chat_template(escaped, add_generation_prompt, **variables)
        return self._encode_around_specials(rendered, mark)

    def _special_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of each special token's text in `text`, leftmost-longest. The regex
        runs a window at a time: one long call would hold the GIL (and the server's loop)."""
        if self._special_pattern is None:
            return []
        reach = max(map(len, self._specials)) - 1  # a match starting in a window ends by this
        spans: list[tuple[int, int]] = []
        pos = 0
        while pos < len(text):
            stop = pos + _SCAN_WINDOW
            for hit in self._special_pattern.finditer(text, pos, min(len(text), stop + reach)):
                if hit.start() >= stop:
                    break
                spans.append(hit.span())
            pos = max(stop, spans[-1][1] if spans else 0)
        return spans

    def _break_specials(self, text: str, mark: str) -> str:
        """`text` with `mark` between the characters of every special token's text."""
        out, prev = [], 0
        for start, end in self._special_spans(text):
            out += [text[prev:start], mark.join(text[start:end])]
            prev = end
        return "".join(out) + text[prev:]

    def _encode_around_specials(self, text: str, mark: str) -> list[int]:
        """The special tokens' text in `text` become their ids; the text between them (`mark`
        removed) plain tokens, less the whitespace a neighbouring special token strips, as
        when the tokenizer splits the text itself."""
        spans = self._special_spans(text)
        tokens = [self._specials[text[start:end]] for start, end in spans]
        ids: list[int] = []
        ends, starts = [0] + [e for _, e in spans], [s for s, _ in spans] + [len(text)]
        gaps = zip(ends, starts, strict=True)
        for k, (lo, hi) in enumerate(gaps):  # the text before special token k (and after all)
            piece = text[lo:hi]
            if k and tokens[k - 1][1].rstrip:
                piece = piece.lstrip()
            if k < len(spans) and tokens[k][1].lstrip:
                piece = piece.rstrip()
            if piece:
                ids += self.encode(piece.replace(mark, ""), False, parse_special=False)
            if k < len(spans):
                ids.append(tokens[k][0])
        return ids

    def _special_token_strings(self) -> dict[str, str]:
        names = {
            "bos_token": "bos_id",
            "eos_token": "eos_id",
            "unk_token": "unk_id",
            "pad_token": "pad_id",
        }
        ids = {name: getattr(self.special, field) for name, field in names.items()}
        return {name: self.backend.id_to_token(i) for name, i in ids.items() if i is not None}

    # ---- saving -------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json.

        `transformers.AutoTokenizer.from_pretrained(path)` loads the result and
        encodes to the same ids (the generic fast-tokenizer class is named so
        transformers uses tokenizer.json as written).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        tokens = self._special_token_strings()
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **tokens,
            "add_bos_token": self.special.add_bos,
            "add_eos_token": self.special.add_eos,
            "clean_up_tokenization_spaces": False,
            "model_max_length": self.model_max_length,
            "chat_template": self.chat_template,
        }
        config = {key: value for key, value in config.items() if value is not None}
        _write_json(path / "tokenizer_config.json", config)
        _write_json(path / "special_tokens_map.json", tokens)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in asdict(self.special).items() if v is not None)
        return f"Tokenizer(vocab_size={self.vocab_size}, {fields})"


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text deltas for streaming.

    The concatenated deltas (plus `flush()`) equal `decode(all fed ids)`, and no
    delta ends inside a multi-byte character: while the decoded tail ends with
    U+FFFD (bytes of an unfinished character) the text is held back. Each step
    decodes only a short window, as vLLM's detokenizer does: the ids since the last
    emitted delta plus the last emitted chunk as left context, so that decoders
    which depend on the previous token (SentencePiece's leading space, byte
    fallback) see the same text they see in a full decode. (Equality holds for
    output that is valid UTF-8; `tokenizers` renders a broken byte run as a whole,
    so garbage bytes can make a full decode differ around them.)
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        skip_special_tokens: bool = False,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._skip_special = skip_special_tokens
        # A few prompt ids give the first generated token its left context.
        self._ids: list[int] = list(prompt_ids[-8:])  # window: context + pending ids
        self._prefix = 0  # window[_prefix:_read] was already emitted: left context
        self._read = len(self._ids)  # window[_read:] not yet emitted
        self._context: str | None = None  # decode(window[_prefix:_read]), once known

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _left(self) -> str:
        """The left context's text: decoded once per emitted chunk, not once per step."""
        if self._context is None:
            self._context = self._decode(self._ids[self._prefix : self._read])
        return self._context

    def step(self, token_id: int) -> str:
        """Feed one id; returns the new text (maybe empty) that it completes."""
        self._ids.append(token_id)
        context = self._left()
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return ""  # nothing new yet, or an unfinished character
        emitted = self._ids[self._read :]
        chunk = self._decode(emitted)
        if chunk:
            # The emitted chunk is the next left context. A chunk that decodes to
            # nothing (a skipped special token) would be no context at all.
            self._ids, self._prefix = self._ids[self._read :], 0
        self._read = len(self._ids)
        self._context = chunk if chunk else None
        return text[len(context) :]

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation), even if incomplete."""
        context = self._left()
        text = self._decode(self._ids[self._prefix :])
        self._ids, self._prefix = self._ids[self._read :], 0
        self._read = len(self._ids)
        self._context = None
        return text[len(context) :]


# ---- helpers ----------------------------------------------------------------------


def _stop_ids(
    backend: tokenizers.Tokenizer, special: SpecialTokens, extra: Iterable[int]
) -> set[int]:
    named = (backend.token_to_id(token) for token in END_OF_TURN_TOKENS)
    candidates = [special.eos_id, special.eot_id, special.eom_id, *named, *extra]
    return {token_id for token_id in candidates if token_id is not None}


def _unused_char(text: str) -> str:
    """A private-use character that `text` does not contain."""
    used = set(text)
    for c in itertools.chain(range(0xE000, 0xF900), range(0xF0000, 0xFFFFE)):
        if chr(c) not in used:
            return chr(c)
    raise TokenizerError("the prompt uses every private-use character")


def _open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:  # IndexError: a truncated file
        raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from exc


def _gguf_value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: dict[str, Any], config: dict[str, Any]
) -> SpecialTokens:
    """Special ids from the config's token strings; BOS/EOS policy as transformers sets it."""
    ids = {}
    for field in ("bos", "eos", "unk", "pad"):
        text = _token_text(tokens.get(f"{field}_token"))
        ids[f"{field}_id"] = backend.token_to_id(text) if text else None
    if "add_bos_token" in config or "add_eos_token" in config:
        # Explicit flags rebuild the post-processor, as transformers does on load.
        backend.post_processor = bos_eos_post_processor(
            backend,
            _token_text(tokens.get("bos_token")),
            _token_text(tokens.get("eos_token")),
            bool(config.get("add_bos_token")),
            bool(config.get("add_eos_token")),
        )
    # Otherwise tokenizer.json's post-processor decides; find out what it adds.
    with_special = backend.encode("a").ids
    plain = backend.encode("a", add_special_tokens=False).ids
    add_bos = ids["bos_id"] is not None and with_special[:1] == [ids["bos_id"]] != plain[:1]
    add_eos = ids["eos_id"] is not None and with_special[-1:] == [ids["eos_id"]] != plain[-1:]
    return SpecialTokens(**ids, add_bos=add_bos, add_eos=add_eos)


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else the config's template (a string or a named list)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


# ---- chat template environment (mirrors transformers' chat_template_utils) ---------


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (training templates mark the
    assistant's text with it) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    # Unlike jinja's own tojson: no HTML escaping, non-ASCII kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source)
