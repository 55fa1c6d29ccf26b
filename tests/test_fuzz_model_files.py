"""Property tests: a small real GGUF, corrupted the ways hypothesis finds (flipped header
bytes, truncations, huge lengths and counts, lying tensor entries and hyper-parameters),
either loads, passes `edgellm info`'s code path and generates on the torch backend, or is
refused with an EdgeLLMError. Nothing else may escape: no other exception, no hang, no
unbounded allocation. Derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.entrypoints.llm import LLM
from edgellm.errors import EdgeLLMError
from edgellm.eval.info import model_info, render_info
from edgellm.loaders.gguf_header import scan_gguf
from edgellm.sampling.params import SamplingParams
from tests.test_model_files import rewrite_gguf, write_gguf, write_hf_dir

V = gguf.GGUFValueType
FUZZ = settings(
    max_examples=40,
    deadline=None,  # a load takes ~0.1 s; the first one warms torch up
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


class Base:
    """The valid file, its bytes, and where things sit in its header."""

    def __init__(self, root: Path):
        self.path = write_gguf(root / "base.gguf", write_hf_dir(root / "hf"))
        self.data = self.path.read_bytes()
        self.header_end = scan_gguf(self.path).data_start
        reader = gguf.GGUFReader(self.path)
        self.u64_at = sorted(_u64_offsets(reader))  # string lengths, counts, dims, offsets
        self.tensors = [t.name for t in reader.tensors]
        self.work = root / "case.gguf"


def _u64_offsets(reader: gguf.GGUFReader) -> set[int]:
    base = reader.data.__array_interface__["data"][0]
    fields = [*reader.fields.values(), *(t.field for t in reader.tensors)]
    return {
        part.__array_interface__["data"][0] - base
        for f in fields
        for part in f.parts
        if part.dtype == np.uint64
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    return Base(tmp_path_factory.mktemp("fuzz"))


def exercise(path: Path) -> None:
    """What a user does with a file: `edgellm info`, then a short generation (torch)."""
    try:
        render_info(model_info(str(path)))
        llm = LLM(str(path), backend="torch", kv_cache_mb=1)
        llm.generate(["hello world"], PARAMS)
    except EdgeLLMError as e:
        assert "\n" not in str(e), str(e)  # the CLI prints it as one line


def write(base: Base, data: bytes) -> Path:
    base.work.write_bytes(data)
    return base.work


def test_the_base_file_runs(base):
    llm = LLM(str(base.path), backend="torch", kv_cache_mb=1)
    assert len(llm.generate(["hello world"], PARAMS)[0].outputs[0].token_ids) == 2


@FUZZ
@given(st.data())
def test_flipped_header_bytes(base, data):
    flips = data.draw(
        st.lists(
            st.tuples(st.integers(0, base.header_end - 1), st.integers(1, 255)),
            min_size=1,
            max_size=4,
        )
    )
    raw = bytearray(base.data)
    for at, mask in flips:
        raw[at] ^= mask
    exercise(write(base, bytes(raw)))


@FUZZ
@given(st.data())
def test_truncations(base, data):
    cut = data.draw(st.integers(0, len(base.data) - 1))
    exercise(write(base, base.data[:cut]))


HUGE = [0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1]


@FUZZ
@given(st.data())
def test_huge_lengths_counts_and_offsets(base, data):
    at = data.draw(st.sampled_from(base.u64_at))
    value = data.draw(st.sampled_from(HUGE) | st.integers(0, len(base.data) * 2))
    raw = bytearray(base.data)
    raw[at : at + 8] = struct.pack("<Q", value)
    exercise(write(base, bytes(raw)))


@FUZZ
@given(st.data())
def test_lying_tensor_entries(base, data):
    name = data.draw(st.sampled_from(base.tensors))
    t = next(t for t in gguf.GGUFReader(base.path).tensors if t.name == name)
    n_dims_at = t.field.offset + 8 + len(name.encode())
    part = data.draw(st.sampled_from(["n_dims", "dim", "type", "offset"]))
    if part == "n_dims":
        at, raw = n_dims_at, struct.pack("<I", data.draw(st.integers(0, 9)))
    elif part == "dim":
        at = n_dims_at + 4 + 8 * data.draw(st.integers(0, len(t.shape) - 1))
        raw = struct.pack("<Q", data.draw(st.sampled_from(HUGE) | st.integers(0, 300)))
    elif part == "type":
        at = n_dims_at + 4 + 8 * len(t.shape)
        raw = struct.pack("<I", data.draw(st.integers(0, 45) | st.just(2**32 - 1)))
    else:
        at = n_dims_at + 8 + 8 * len(t.shape)
        shift = data.draw(st.sampled_from([-64, -32, -1, 1, 32, 64, 2**40]))
        raw = struct.pack("<Q", (struct.unpack_from("<Q", base.data, at)[0] + shift) % 2**64)
    buf = bytearray(base.data)
    buf[at : at + len(raw)] = raw
    exercise(write(base, bytes(buf)))


# metadata the loaders read: hyper-parameters and the tokenizer's scalars
KEYS = [
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.rope.dimension_count",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.context_length",
    "llama.vocab_size",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "general.alignment",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
]
VALUES = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 8, 15, 16, 32, 64, 128, 263, 264, 1000, 2**31]).map(
        lambda v: (v, V.UINT32)
    ),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: (v, V.INT64)),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-6, 1.0, 1e30]).map(
        lambda v: (v, V.FLOAT32)
    ),
    st.sampled_from(["", "llama", "gpt2", "linear", "yarn", "\x00"]).map(lambda v: (v, V.STRING)),
    st.booleans().map(lambda v: (v, V.BOOL)),
    st.lists(st.integers(0, 8), min_size=1, max_size=3).map(lambda v: (v, V.ARRAY, V.UINT32)),
)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), VALUES | st.none(), min_size=1, max_size=3))
def test_lying_hyper_parameters(base, kv):
    exercise(rewrite_gguf(base.path, base.work, kv))
