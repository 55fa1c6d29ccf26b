"""A bounded scan of a GGUF header, run before gguf-py's reader sees the file.

gguf-py trusts the header: a string length or array count of 2^40 makes it allocate
until memory runs out, and a tensor offset may point anywhere. This scan walks the
same layout with every length checked against the bytes left in the file, and applies
llama.cpp's own rules (ggml/src/gguf.cpp): known value and tensor types, no arrays of
arrays, unique keys and tensor names, names under 64 bytes, 1..4 dims, rows whole
blocks, and tensors packed in header order at aligned offsets, all inside the file.

Layout (little-endian, versions 2 and 3; a string is a u64 length and its UTF-8 bytes):

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv      x (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | n_dims x u64 dim | u32 ggml type | u64 offset)
    padding to general.alignment (default 32) | tensor data
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf

from edgellm.errors import ModelFormatError

VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME, terminating zero included
# the longest array edgellm reads: vocabularies have up to ~262k tokens (Gemma 3);
# gguf-py builds one numpy object per element, so this also bounds its memory
MAX_ARRAY = 1 << 22
ARRAY, STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
# value type -> struct format of a scalar
SCALARS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<B",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
_MIN_KV = 8 + 4 + 1  # empty key, type, the smallest value
_MIN_TENSOR = 8 + 1 + 4 + 8 + 4 + 8  # one-byte name, one dim, type, offset


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    qtype: gguf.GGMLQuantizationType
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    version: int
    alignment: int
    data_start: int  # file offset of the data section
    tensors: list[TensorEntry]


class _Cursor:
    """Reads the header front to back; every read is checked against the bytes left."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path} is a corrupt GGUF file: {what}")

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise ModelFormatError(
                f"{self.path} is truncated or corrupt: {what} needs {n} bytes at offset "
                f"{self.pos}, the file has {self.left} left"
            )
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("<Q", f"the length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None


def scan_gguf(path: Path) -> GGUFHeader:
    """Check a GGUF file's header and tensor layout without trusting any length in it."""
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFormatError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, path)
            cur.pos = 4
            version = _version(cur)
            n_tensors = cur.scalar("<Q", "the tensor count")
            n_kv = cur.scalar("<Q", "the metadata count")
            _bound_count(cur, n_kv, _MIN_KV, "metadata count")
            alignment = _metadata(cur, n_kv)
            _bound_count(cur, n_tensors, _MIN_TENSOR, "tensor count")
            tensors = [_tensor_info(cur) for _ in range(n_tensors)]
            _unique(cur, [t.name for t in tensors], "tensor name")
            data_start = -(-cur.pos // alignment) * alignment
            _check_layout(cur, tensors, alignment, data_start)
    return GGUFHeader(version, alignment, data_start, tensors)


def _version(cur: _Cursor) -> int:
    version = cur.scalar("<I", "the version")
    if version & 0xFFFF == 0 and version:
        raise cur.fail("it is big-endian; only little-endian GGUF files are supported")
    if version not in VERSIONS:
        raise cur.fail(f"version {version} is not supported (expected one of {VERSIONS})")
    return version


def _bound_count(cur: _Cursor, count: int, min_bytes: int, what: str) -> None:
    if count > cur.left // min_bytes:
        raise cur.fail(
            f"the {what} {count} cannot fit in the {cur.left} bytes left "
            f"(each entry takes at least {min_bytes})"
        )


def _metadata(cur: _Cursor, n_kv: int) -> int:
    """Walk every key/value; returns general.alignment (32 when absent)."""
    keys, alignment = [], 32
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        keys.append(key)
        vtype = _value_type(cur, cur.scalar("<I", f"the type of {key}"), key)
        if key == "general.alignment":
            if vtype != gguf.GGUFValueType.UINT32:
                raise cur.fail(f"general.alignment has type {vtype.name}, expected UINT32")
            alignment = cur.scalar("<I", key)
            if alignment == 0 or alignment & (alignment - 1):
                raise cur.fail(f"general.alignment is {alignment}, expected a power of two")
        elif vtype == ARRAY:
            _skip_array(cur, key)
        else:
            _skip_value(cur, vtype, key)
    _unique(cur, keys, "metadata key")
    return alignment


def _value_type(cur: _Cursor, raw: int, key: str) -> gguf.GGUFValueType:
    try:
        return gguf.GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"{key} has unknown value type {raw}") from None


def _skip_value(cur: _Cursor, vtype: gguf.GGUFValueType, key: str) -> None:
    if vtype == STRING:
        cur.string(key)
    else:
        cur.take(struct.calcsize(SCALARS[vtype]), key)


def _skip_array(cur: _Cursor, key: str) -> None:
    etype = _value_type(cur, cur.scalar("<I", f"the element type of {key}"), key)
    count = cur.scalar("<Q", f"the length of {key}")
    if etype == ARRAY:
        raise cur.fail(f"{key} is an array of arrays, which GGUF readers do not support")
    if count > MAX_ARRAY:
        raise cur.fail(f"{key} has {count} elements, more than the {MAX_ARRAY} edgellm reads")
    if etype == STRING:
        _bound_count(cur, count, 8, f"element count of {key}")
        for i in range(count):
            cur.string(f"{key}[{i}]")
    else:
        cur.take(count * struct.calcsize(SCALARS[etype]), f"the {count} elements of {key}")


def _tensor_info(cur: _Cursor) -> TensorEntry:
    name = cur.string("a tensor name")
    if not 0 < len(name.encode()) < MAX_NAME:
        raise cur.fail(f"tensor name {name[:80]!r} is empty or {MAX_NAME} bytes or longer")
    n_dims = cur.scalar("<I", f"the dim count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name} has {n_dims} dims, expected 1..{MAX_DIMS}")
    dims = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, f"the dims of {name}"))
    raw_type = cur.scalar("<I", f"the type of {name}")
    offset = cur.scalar("<Q", f"the offset of {name}")
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name} has unknown type {raw_type}") from None
    if min(dims) < 1:
        raise cur.fail(f"tensor {name} has shape {list(dims)}: every dim must be at least 1")
    if dims[0] % block:
        raise cur.fail(
            f"tensor {name} has rows of {dims[0]}, not a multiple of {qtype.name}'s block {block}"
        )
    n_elements = 1
    for d in dims:
        n_elements *= d
    return TensorEntry(name, dims, qtype, offset, n_elements // block * type_size)


def _unique(cur: _Cursor, names: list[str], what: str) -> None:
    if len(set(names)) != len(names):
        seen: set[str] = set()
        dup = next(n for n in names if n in seen or seen.add(n))
        raise cur.fail(f"{what} {dup!r} appears twice")


def _check_layout(
    cur: _Cursor, tensors: list[TensorEntry], alignment: int, data_start: int
) -> None:
    """llama.cpp's rule: tensor i starts where tensor i-1's padded data ends."""
    expected = 0
    for t in tensors:
        if t.offset % alignment:
            raise cur.fail(f"tensor {t.name} has offset {t.offset}, not aligned to {alignment}")
        if t.offset != expected:
            raise cur.fail(
                f"tensor {t.name} has offset {t.offset}, expected {expected} "
                "(tensors are packed in header order)"
            )
        if data_start + t.offset + t.n_bytes > len(cur.buf):
            raise ModelFormatError(
                f"{cur.path} is truncated: tensor {t.name} ends past the end of the file"
            )
        expected += -(-t.n_bytes // alignment) * alignment
