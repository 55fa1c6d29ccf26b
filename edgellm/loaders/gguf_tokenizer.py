"""A `tokenizers.Tokenizer` rebuilt from the tokenizer metadata of a GGUF file.

A GGUF file carries no `tokenizer.json`: it stores the vocabulary, merges, token
types and special ids under llama.cpp's `tokenizer.ggml.*` keys. Two kinds are
rebuilt here, both as a `tokenizers` BPE model so the rest of edgellm sees one type:

- `gpt2`: byte-level BPE (SmolLM, Llama 3, Qwen2, DeepSeek). How text is split
  before BPE is not stored, only named by `tokenizer.ggml.pre`; `PRE_TOKENIZERS`
  maps that name to the split regexes llama.cpp uses (llama-vocab.cpp), written in
  their original tokenizer.json form.
- `llama`: SentencePiece-style BPE (Llama 2, TinyLlama, Mistral): spaces become
  `▁`, unknown characters fall back to `<0xNN>` byte tokens, and when the file
  stores no merges their order follows the token scores.

Token types follow llama.cpp: CONTROL and UNKNOWN tokens become special added
tokens, USER_DEFINED ones plain added tokens, so both are matched whole in text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

from edgellm.errors import TokenizerError

SPIECE_SPACE = "\u2581"  # "▁": SentencePiece's visible space

# GGUF token types (gguf.TokenType) that become added tokens, with their `special` flag.
_ADDED_TOKEN_TYPES: dict[int, bool] = {
    gguf.TokenType.CONTROL: True,
    gguf.TokenType.UNKNOWN: True,
    gguf.TokenType.USER_DEFINED: False,
}


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` splits text before byte-level BPE."""

    splits: tuple[str, ...]  # regexes applied in turn; every match becomes its own piece
    ignore_merges: bool = False  # a piece that is already a token stays whole (Llama 3, Tekken)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token flag


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _LLAMA3_TAIL
_QWEN2 = _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _LLAMA3_TAIL  # single digits
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"


def _cased_words(suffix: str) -> str:
    """Words as an optional capital run then lower case (or the reverse), then `suffix`."""
    lead = r"[^\r\n\p{L}\p{N}]?"
    return rf"{lead}{_UPPER}*{_LOWER}+{suffix}|{lead}{_UPPER}+{_LOWER}*{suffix}"


_TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _cased_words(_CONTRACTION + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_V3_WORDS = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# One entry per family; every name llama.cpp gives that family maps to it.
_PRE_TOKENIZER_FAMILIES: tuple[tuple[tuple[str, ...], PreTokenizerSpec], ...] = (
    # "default" (also a missing key) is GPT-2's split; llama.cpp warns such files
    # tokenize badly and uses an ad-hoc regex list, we use the GPT-2 reference.
    (("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), PreTokenizerSpec((_GPT2,))),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
        PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe"), PreTokenizerSpec((_LLAMA3,))),
    # Digits one by one, then GPT-2 (SmolLM's tokenizer.json: Digits + ByteLevel).
    (
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        PreTokenizerSpec((r"\p{N}", _GPT2)),
    ),
    (
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"),
        PreTokenizerSpec((_QWEN2,)),
    ),
    (
        ("deepseek-coder",),
        PreTokenizerSpec(
            (
                "[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                r"\p{N}",
            )
        ),
    ),
    (("deepseek-v3",), PreTokenizerSpec((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK_V3_WORDS))),
    (("tekken",), PreTokenizerSpec((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4"), PreTokenizerSpec((_GPT4O,))),
)
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    name: spec for names, spec in _PRE_TOKENIZER_FAMILIES for name in names
}


def _meta(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of a metadata key, or `default` when the file lacks it."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


@dataclass(frozen=True, slots=True)
class _Vocab:
    """The `tokenizer.ggml.*` arrays, one entry per token id."""

    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[tuple[str, str]] | None  # None when the file stores none

    def ids(self) -> dict[str, int]:
        """token -> id; a token spelled twice keeps its first id, as llama.cpp does."""
        ids: dict[str, int] = {}
        for index, token in enumerate(self.tokens):
            ids.setdefault(token, index)
        return ids


def _read_vocab(reader: gguf.GGUFReader) -> _Vocab:
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("the GGUF file has no tokenizer.ggml.tokens: no tokenizer to build")
    merges = _meta(reader, "tokenizer.ggml.merges")
    return _Vocab(
        tokens=list(tokens),
        types=list(
            _meta(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
        ),
        scores=list(_meta(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))),
        merges=[tuple(m.split(" ", 1)) for m in merges] if merges is not None else None,
    )


def _pre_tokenizer_spec(reader: gguf.GGUFReader) -> PreTokenizerSpec:
    name = _meta(reader, "tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        raise TokenizerError(
            f"unknown tokenizer.ggml.pre {name!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]


def _byte_level_bpe(vocab: _Vocab, spec: PreTokenizerSpec) -> Tokenizer:
    """GPT-2 style BPE over bytes spelled as printable characters (`Ġ` is a space)."""
    # no merges key: a byte-level vocabulary without merges (GGUF cannot store an empty array)
    merges = vocab.merges or []
    tokenizer = Tokenizer(BPE(vocab.ids(), merges, ignore_merges=spec.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in spec.splits]
    # The regexes did the splitting; ByteLevel only maps bytes to their printable spelling.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    # Added tokens are stored as raw text; the decoder passes through any token with a
    # character outside the byte alphabet unchanged.
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merges_from_scores(vocab: _Vocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: best-scored result first.

    SentencePiece BPE joins the adjacent pair whose union is the highest-scored
    token; ranking every split `(left, right)` of a token by that token's score
    makes `tokenizers`' BPE do the same.
    """
    ranked: list[tuple[float, str, str]] = []
    for token, token_type, score in zip(vocab.tokens, vocab.types, vocab.scores, strict=True):
        if token_type in (gguf.TokenType.CONTROL, gguf.TokenType.BYTE, gguf.TokenType.UNKNOWN):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, left, right))
    ranked.sort(key=lambda item: (item[0], ids[item[1] + item[2]]))  # ties: lower id first
    return [(left, right) for _, left, right in ranked]


def _sentencepiece_bpe(vocab: _Vocab, unk_id: int | None, add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE: `▁` for spaces, byte fallback, one BPE word per text segment."""
    ids = vocab.ids()
    merges = vocab.merges if vocab.merges is not None else _merges_from_scores(vocab, ids)
    unk = vocab.tokens[unk_id] if unk_id is not None else None
    model = BPE(ids, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    # A normalizer (not Metaspace) so the space prefix goes before every segment
    # between special tokens, as llama.cpp's SPM tokenizer does.
    steps = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = None
    undo = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        undo.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(undo)
    return tokenizer


def _add_typed_tokens(tokenizer: Tokenizer, vocab: _Vocab) -> None:
    """Register CONTROL/UNKNOWN tokens as special and USER_DEFINED ones as added tokens."""
    added = [
        AddedToken(token, special=_ADDED_TOKEN_TYPES[token_type], normalized=False)
        for token, token_type in zip(vocab.tokens, vocab.types, strict=True)
        if token_type in _ADDED_TOKEN_TYPES
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])


def bos_eos_post_processor(
    tokenizer: Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """A post-processor that adds BOS and/or EOS around encoded text, as the model asks."""
    head = [bos] if add_bos and bos is not None else []
    tail = [eos] if add_eos and eos is not None else []

    def template(sequence: str, type_id: int) -> str:
        pieces = [*head, f"${sequence}", *tail]
        return " ".join(f"{piece}:{type_id}" for piece in pieces)

    return processors.TemplateProcessing(
        single=template("A", 0),
        pair=f"{template('A', 0)} {template('B', 1)}",
        special_tokens=[
            (token, tokenizer.token_to_id(token)) for token in dict.fromkeys(head + tail)
        ],
    )


_SPECIAL_ID_KEYS = {
    "bos_id": "tokenizer.ggml.bos_token_id",
    "eos_id": "tokenizer.ggml.eos_token_id",
    "eot_id": "tokenizer.ggml.eot_token_id",
    "eom_id": "tokenizer.ggml.eom_token_id",
    "unk_id": "tokenizer.ggml.unknown_token_id",
    "pad_id": "tokenizer.ggml.padding_token_id",
}


def special_tokens_from_gguf(reader: gguf.GGUFReader) -> dict[str, int | bool | None]:
    """Special token ids and BOS/EOS flags of a GGUF tokenizer.

    Keys: `bos_id`, `eos_id`, `eot_id`, `eom_id`, `unk_id`, `pad_id` (an id or None)
    and `add_bos`, `add_eos`. Without an `add_bos_token` flag the default is
    llama.cpp's: on for SentencePiece vocabularies and for Llama 3 / Tekken.
    """
    n_tokens = len(_meta(reader, "tokenizer.ggml.tokens", []))
    special: dict[str, int | bool | None] = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        token_id = _meta(reader, key)
        special[name] = token_id if token_id is not None and 0 <= token_id < n_tokens else None
    model = _meta(reader, "tokenizer.ggml.model")
    default_bos = model == "llama" or (model == "gpt2" and _pre_tokenizer_spec(reader).add_bos)
    special["add_bos"] = bool(_meta(reader, "tokenizer.ggml.add_bos_token", default_bos))
    special["add_eos"] = bool(_meta(reader, "tokenizer.ggml.add_eos_token", False))
    return special


def chat_template_from_gguf(reader: gguf.GGUFReader) -> str | None:
    """The default chat template (`tokenizer.chat_template`), or None when absent."""
    return _meta(reader, "tokenizer.chat_template") or None


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """Build the `tokenizers.Tokenizer` that a GGUF file's metadata describes.

    Encoding with `add_special_tokens=True` adds BOS/EOS as the file's flags say.
    Raises TokenizerError for a tokenizer model other than `gpt2` / `llama`, an
    unknown `tokenizer.ggml.pre`, or missing vocabulary arrays.
    """
    model = _meta(reader, "tokenizer.ggml.model")
    vocab = _read_vocab(reader)
    special = special_tokens_from_gguf(reader)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(vocab, _pre_tokenizer_spec(reader))
    elif model == "llama":
        add_space_prefix = bool(_meta(reader, "tokenizer.ggml.add_space_prefix", True))
        tokenizer = _sentencepiece_bpe(vocab, special["unk_id"], add_space_prefix)
    else:
        raise TokenizerError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2', 'llama')"
        )
    _add_typed_tokens(tokenizer, vocab)
    bos, eos = (
        vocab.tokens[i] if i is not None else None for i in (special["bos_id"], special["eos_id"])
    )
    tokenizer.post_processor = bos_eos_post_processor(
        tokenizer, bos, eos, bool(special["add_bos"]), bool(special["add_eos"])
    )
    return tokenizer


# ---- writing: a Tokenizer back to tokenizer.ggml.* metadata ---------------------------

# Text that tells the split rules apart: digits in runs, contractions, case runs,
# punctuation runs, newlines, multiple spaces, CJK and accented letters, code.
_PRE_PROBE = (
    "I'm sure it's 2024-12-31; they'll pay $1234567.89 for 3 items!!\n\n"
    "  Hello WORLD HelloWorld camelCase ÉCOLE été naïve 日本語のテキスト 中文 한국어\n"
    "def f(x):\r\n    return x**2 + 10_000  # done...\t\t'quoted' \"double\" <tag/> /path/to\n"
)


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """What llama.cpp needs to rebuild a byte-level BPE tokenizer."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str


def gguf_vocab(tokenizer: Any, n_vocab: int) -> GGUFVocab:
    """Tokens (padded to `n_vocab` rows), types, merges and the `tokenizer.ggml.pre` name of
    a byte-level BPE tokenizer (our `edgellm.tokenizer.Tokenizer`).

    The pre-tokenizer is not stored by name in tokenizer.json; like llama.cpp's converter
    we identify it by behaviour: the family whose split rules encode a probe text to the
    same ids. Raises TokenizerError for other tokenizer kinds or an unknown split.
    """

    backend = tokenizer.backend
    model = json.loads(backend.to_str())["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise TokenizerError("GGUF export supports byte-level BPE tokenizers only")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        raise TokenizerError("the tokenizer has no merges; llama.cpp cannot load such a GGUF")
    vocab = backend.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= n_vocab:
        raise TokenizerError(f"the tokenizer has ids past the model's {n_vocab} vocabulary rows")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for token, i in vocab.items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for i, added in backend.get_added_tokens_decoder().items():
        types[i] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    v = _Vocab(
        tokens, [int(t) for t in types], [0.0] * n_vocab, [tuple(m.split(" ", 1)) for m in merges]
    )
    return GGUFVocab(tokens, [int(t) for t in types], merges, _detect_pre(tokenizer, v))


def _detect_pre(tokenizer: Any, vocab: _Vocab) -> str:
    want = tokenizer.encode(_PRE_PROBE, add_special_tokens=False)
    # GPT-2's plain split last: llama.cpp treats "default" as a fallback with its own rules
    families = sorted(_PRE_TOKENIZER_FAMILIES, key=lambda f: f[0][0] == "default")
    for names, spec in families:
        if _byte_level_bpe(vocab, spec).encode(_PRE_PROBE, add_special_tokens=False).ids == want:
            return names[0]
    raise TokenizerError(
        "the tokenizer's pre-tokenizer matches none llama.cpp knows "
        f"({', '.join(n[0] for n, _ in _PRE_TOKENIZER_FAMILIES)}); cannot export it to GGUF"
    )
