"""Calibration data: splits, files, JSONL, reproducibility and clear errors."""

import json

import pytest

from edgellm.errors import InvalidParameterError
from edgellm.loaders.texts import text_documents
from edgellm.quantize.calibration import calibration_documents, calibration_tokens, token_stream
from tests.conftest import byte_tokenizer


def test_sotu_calibration_never_overlaps_the_evaluation_split():
    calib = set(calibration_documents("sotu"))
    held_out = set(text_documents("sotu"))
    assert calib and held_out and not calib & held_out


def test_shakespeare_calibration_is_the_other_half_of_the_works():
    calib = calibration_documents("shakespeare")
    held_out = text_documents("shakespeare")
    assert calib and held_out and not set(calib) & set(held_out)
    assert abs(len(calib) - len(held_out)) <= 1  # alternate works, not one era or genre
    assert len(calib) + len(held_out) == len(set(calib) | set(held_out))


def test_the_mix_draws_alternately_from_both_calibration_splits():
    tok = byte_tokenizer()
    windows = calibration_tokens(tok, "mix", n_samples=6, seq_len=48, seed=3)
    sotu, plays = bytes(token_stream(tok, "sotu")), bytes(token_stream(tok, "shakespeare"))
    for i, w in enumerate(windows):
        assert len(w) == 48
        home, other = (sotu, plays) if i % 2 == 0 else (plays, sotu)
        assert bytes(w) in home and bytes(w) not in other
    evaluation = {d.encode() for d in text_documents("sotu") + text_documents("shakespeare")}
    assert not any(bytes(w) in d for w in windows for d in evaluation)


def test_windows_are_seeded_and_sized():
    tok = byte_tokenizer()
    a = calibration_tokens(tok, "shakespeare", n_samples=4, seq_len=64, seed=1)
    b = calibration_tokens(tok, "shakespeare", n_samples=4, seq_len=64, seed=1)
    c = calibration_tokens(tok, "shakespeare", n_samples=4, seq_len=64, seed=2)
    assert a == b and a != c and all(len(s) == 64 for s in a)


def test_text_and_jsonl_files(tmp_path):
    tok = byte_tokenizer()
    txt = tmp_path / "c.txt"
    txt.write_text("hello world " * 20)
    assert len(calibration_tokens(tok, str(txt), 2, 16)[0]) == 16
    jl = tmp_path / "c.jsonl"
    jl.write_text(
        json.dumps({"text": "abc " * 30})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi there"}]})
        + "\n"
    )
    docs = calibration_documents(str(jl))
    assert docs == ["abc " * 30, "hi there"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(InvalidParameterError, match="bad.jsonl:1"):
        calibration_documents(str(bad))


def test_empty_or_too_short_text_is_refused(tmp_path):
    tok = byte_tokenizer()
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(InvalidParameterError, match="empty"):
        calibration_tokens(tok, str(empty))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(InvalidParameterError, match="fewer than one sample"):
        calibration_tokens(tok, str(short), seq_len=512)
    with pytest.raises(InvalidParameterError, match="neither a built-in"):
        calibration_tokens(tok, "no-such-text")
