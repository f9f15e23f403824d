"""The safetensors header reader fuzzed: every shard is a FormatError or read back byte for byte, with no other
exception, no hang and no allocation sized by an unchecked header field.

Hypothesis profiles (EXL3MOE_FUZZ_PROFILE): "ci" (default: derandomized, ~100-200 examples per property, no
example database) and "deep" (randomized, 50x the examples) for a long local run.
"""

import json
import math
import os
import signal
import struct
import tracemalloc
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from exl3moe import FormatError
from exl3moe.format.safetensors_io import DTYPES, ITEM_BYTES, MAX_HEADER_BYTES, read_header, read_tensor, write_shard

_QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_QUIET)
settings.register_profile("deep", max_examples=7500, deadline=None, suppress_health_check=_QUIET)
PROFILE = os.environ.get("EXL3MOE_FUZZ_PROFILE", "ci")
SCALE = 50 if PROFILE == "deep" else 1


def fuzz_settings(examples: int) -> settings:
    """The active profile with `examples` examples (times 50 in the deep profile)."""
    return settings(settings.get_profile(PROFILE), max_examples=examples * SCALE)


@contextmanager
def time_limit(seconds: float):
    """TimeoutError if the block runs longer than `seconds` (a hang fails the test instead of stalling CI)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def read_all(path) -> dict:
    """{key: (dtype name, shape, bytes)} through read_header and read_tensor, or FormatError; never slower than 10 s,
    never holding more Python memory than 8x the file plus 1 MiB."""
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        with time_limit(10):
            entries = read_header(str(path))
            out = {}
            for key, e in entries.items():
                t = read_tensor(e)
                assert t.dtype == DTYPES[e.dtype] and tuple(t.shape) == e.shape, key
                out[key] = (e.dtype, e.shape, tensor_bytes(t))
        return out
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= 8 * size + (1 << 20), f"peak {peak} bytes reading a {size}-byte file"


def refused_or_exact(path, expected: dict | None = None) -> dict | None:
    """None if the reader refuses `path` with FormatError; else what it read, which must equal `expected` (when
    given) and what the safetensors library reads from the same file."""
    try:
        got = read_all(path)
    except FormatError as err:
        assert err.name and err.rule, "a refusal names the shard or tensor and the rule"
        return None
    if expected is not None:
        assert got == expected
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == sorted(got)
        for key in got:
            t = f.get_tensor(key)
            assert (tuple(t.shape), tensor_bytes(t)) == got[key][1:], key
    return got


def encode(header, data: bytes, length: int | None = None) -> bytes:
    """A shard from a header (dict, or raw text/bytes), its data and an optional lying length field."""
    if isinstance(header, dict):
        header = json.dumps(header)
    raw = header.encode("utf-8", "surrogatepass") if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def layout(tensors: dict) -> tuple:
    """(header dict, data) laying `tensors` ({key: (dtype name, shape, bytes)}) out back to back."""
    header, offset = {}, 0
    for key, (dtype, shape, blob) in tensors.items():
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    return header, b"".join(blob for _, _, blob in tensors.values())


KEYS = st.text(min_size=1, max_size=12) | st.text(st.characters(codec="utf-8"), max_size=4).map(lambda s: "k" * 300 + s)


@st.composite
def tensor_sets(draw, max_tensors: int = 4) -> dict:
    """{key: (dtype name, shape, bytes)}: 0 to max_tensors tensors of any dtype, small or empty shapes."""
    out = {}
    for key in draw(st.lists(KEYS, max_size=max_tensors, unique=True)):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        size = math.prod(shape) * ITEM_BYTES[dtype]
        blob = draw(st.binary(min_size=size, max_size=size))
        if dtype == "BOOL":
            blob = bytes(b & 1 for b in blob)
        out[key] = (dtype, shape, blob)
    return out


HUGE = st.sampled_from([1 << 31, 1 << 32, 1 << 60, 1 << 62, (1 << 63) - 1, 1 << 63, 1 << 64, 10 ** 30, -1, -(1 << 63)])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 600) | HUGE | st.floats() | st.text(max_size=6)
    | st.sampled_from(sorted(DTYPES)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


@fuzz_settings(100)
@given(tensors=tensor_sets())
def test_written_shards_read_back_exactly(tmp_path, tensors):
    """write_shard's output (and the same tensors laid out by hand, unpadded) read back byte for byte."""
    as_torch = {}
    for key, (dtype, shape, blob) in tensors.items():
        flat = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        as_torch[key] = flat.view(DTYPES[dtype]).reshape(shape)
    write_shard(str(tmp_path / "a.safetensors"), as_torch)
    assert refused_or_exact(tmp_path / "a.safetensors", tensors) == tensors
    (tmp_path / "b.safetensors").write_bytes(encode(*layout(tensors)))
    assert refused_or_exact(tmp_path / "b.safetensors", tensors) == tensors


def _records(header: dict) -> list:
    return sorted(k for k, v in header.items() if k != "__metadata__" and isinstance(v, dict))


def _mutate_record(draw, header: dict, data: bytes) -> tuple:
    keys = _records(header)
    if not keys:
        return header, data
    key = draw(st.sampled_from(keys))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
    if field is None:
        header[key] = draw(JSON_VALUES)
    elif field == "dtype":
        header[key]["dtype"] = draw(st.sampled_from(sorted(DTYPES)) | st.text(max_size=8) | JSON_VALUES)
    elif field == "shape":
        header[key]["shape"] = draw(st.lists(st.integers(0, 8) | HUGE, max_size=4) | JSON_VALUES)
    else:
        end = len(data)
        points = st.integers(0, end) | st.integers(-3, end + 3) | HUGE
        header[key]["data_offsets"] = draw(st.lists(points, min_size=2, max_size=2) | JSON_VALUES)
    return header, data


def _same_span_shape(draw, header: dict, data: bytes) -> tuple:
    """A new shape of the record's byte count: ones around its element count, or a zero among huge dims."""
    keys = [k for k in _records(header) if isinstance(header[k].get("shape"), list)
            and all(type(d) is int and d >= 0 for d in header[k]["shape"])]
    if keys:
        record = header[draw(st.sampled_from(keys))]
        count = math.prod(record["shape"])
        ones = [1] * draw(st.integers(0, 70))
        giant = draw(st.permutations([0, *draw(st.lists(HUGE.filter(lambda d: d > 0), min_size=1, max_size=2))]))
        record["shape"] = giant if count == 0 else draw(st.permutations([*ones, count]))
    return header, data


def _overlap(draw, header: dict, data: bytes) -> tuple:
    keys = _records(header)
    if len(keys) >= 2:
        a, b = draw(st.permutations(keys))[:2]
        header[a]["data_offsets"] = header[b].get("data_offsets")
    return header, data


def _drop_or_add(draw, header: dict, data: bytes) -> tuple:
    keys = sorted(header)
    if keys and draw(st.booleans()):
        del header[draw(st.sampled_from(keys))]
    else:
        header[draw(KEYS)] = draw(JSON_VALUES)
    return header, data


def _metadata(draw, header: dict, data: bytes) -> tuple:
    header["__metadata__"] = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6) | JSON_VALUES, max_size=3)
                                  | JSON_VALUES)
    return header, data


def _data_length(draw, header: dict, data: bytes) -> tuple:
    cut = draw(st.integers(0, len(data)))
    return header, data[:cut] + draw(st.binary(max_size=3))


HEADER_EDITS = [_mutate_record, _same_span_shape, _overlap, _drop_or_add, _metadata, _data_length]


def _raw_edit(draw, raw: bytes) -> bytes:
    """One textual edit of the JSON header: hostile syntax the dict-level edits cannot produce."""
    body = raw[1:-1]
    edits = {
        "duplicate key": lambda: raw[:-1] + (b"," + body if body else b"") + b"}",
        "NaN": lambda: b'{"__metadata__":{"a":NaN}' + (b"," + body if body else b"") + b"}",
        "Infinity": lambda: raw.replace(b'"shape":[', b'"shape":[Infinity,', 1),
        "deep nesting": lambda: b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "huge literal": lambda: raw.replace(b'"data_offsets":[0', b'"data_offsets":[' + b"9" * 5000, 1),
        "non-UTF-8": lambda: raw[:-1] + b',"\xff\xfe":1}' if body else b'{"\xc3\x28":1}',
        "lone surrogate": lambda: raw[:-1] + (b"," if body else b"") + b'"\\ud800":{"dtype":"U8","shape":[0],'
                                  b'"data_offsets":[0,0]}}',
        "BOM": lambda: b"\xef\xbb\xbf" + raw,
        "leading space": lambda: b" " + raw,
        "trailing bytes": lambda: raw + draw(st.sampled_from([b" ", b"\x00", b"  ", b"}", b"garbage"])),
        "cut": lambda: raw[:draw(st.integers(0, max(len(raw) - 1, 0)))],
    }
    return edits[draw(st.sampled_from(sorted(edits)))]()


@fuzz_settings(200)
@given(tensors=tensor_sets(), data=st.data())
def test_mutated_shard_is_refused_or_read_exactly(tmp_path, tensors, data):
    """A valid shard after 1-3 edits (records, offsets, overlaps, metadata, truncation, hostile JSON text, the length
    field): FormatError, or a read equal to the safetensors library's."""
    header, blob = layout(tensors)
    for _ in range(data.draw(st.integers(1, 3))):
        header, blob = data.draw(st.sampled_from(HEADER_EDITS))(data.draw, header, blob)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if data.draw(st.booleans()):
        raw = _raw_edit(data.draw, raw)
    length = data.draw(st.none() | st.integers(0, len(raw) + len(blob) + 8) | HUGE.filter(lambda v: 0 <= v < 1 << 64))
    (tmp_path / "m.safetensors").write_bytes(encode(raw, blob, length))
    refused_or_exact(tmp_path / "m.safetensors")


@fuzz_settings(150)
@given(blob=st.binary(max_size=300), prefix=st.none() | st.integers(0, 400))
def test_arbitrary_bytes_are_refused_or_read_exactly(tmp_path, blob, prefix):
    """Random bytes, with or without a plausible length field in front."""
    (tmp_path / "r.safetensors").write_bytes(blob if prefix is None else struct.pack("<Q", prefix) + blob)
    refused_or_exact(tmp_path / "r.safetensors")


def _record(dtype="U8", shape=(4,), offsets=(0, 4)) -> dict:
    return {"t": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


@pytest.mark.parametrize("shard, rule", [
    (encode(_record(), b"\0" * 4, length=1 << 63), "runs past the end"),
    (encode(_record(), b"\0" * 4, length=(1 << 64) - 1), "runs past the end"),
    (encode(_record(shape=(1 << 60,), offsets=(0, 1 << 60)), b"\0" * 4), "outside the 4-byte data area"),
    (encode(_record("F64", (1 << 30, 1 << 30), (0, 1 << 63)), b"\0" * 4), "two integers in"),
    (encode(_record(shape=(1 << 62, 1 << 62, 0), offsets=(0, 0)), b""), "strides beyond 64 bits"),
    (encode(_record(shape=(0, 1 << 62, 4)), b"\0" * 4), "strides beyond 64 bits"),
    (encode(_record(shape=(1,) * 65, offsets=(0, 1)), b"\0"), "at most 64"),
    (encode(_record(shape=(4,), offsets=(4, 0)), b"\0" * 4), "outside the 4-byte data area"),
    (encode(_record(shape=(4,), offsets=(0, 8)), b"\0" * 4), "outside the 4-byte data area"),
    (encode(_record("F32", (4,), (0, 4)), b"\0" * 4), "needs 16"),
    (encode(_record("F4"), b"\0" * 4), "unknown or unsupported dtype"),
    (encode('{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"t":{}}', b"\0" * 4), "duplicate key"),
    (encode('{"t":{"dtype":"U8","shape":[' + "4" * 100_000 + '],"data_offsets":[0,4]}}', b"\0" * 4), "64 bits"),
    (encode('{"t":{"dtype":"U8","shape":[NaN],"data_offsets":[0,4]}}', b"\0" * 4), "non-standard JSON constant"),
    (encode('{"t":{"dtype":"U8","shape":[-Infinity],"data_offsets":[0,4]}}', b"\0" * 4), "non-standard JSON"),
    (encode('{"a":' + "[" * 200_000 + "]" * 200_000 + "}", b""), "not valid JSON"),
    (encode(b'{"\xff":1}', b""), "not valid JSON"),
    (encode({**_record(), "__metadata__": {"format": 1}}, b"\0" * 4), "must map strings to strings"),
    (encode({**_record(), "__metadata__": ["pt"]}, b"\0" * 4), "must map strings to strings"),
    (encode({"\ud800": _record()["t"]}, b"\0" * 4), "not valid UTF-8"),
    (b"\x05\0\0\0", "too short"),
], ids=["length-2^63", "length-2^64-1", "tensor-2^60", "offset-2^63", "empty-2^124", "empty-then-2^64", "65-dims",
        "reversed", "past-end", "shape-x-dtype", "unknown-dtype", "duplicate", "100k-digit-int", "NaN", "-Infinity",
        "deep-nesting", "non-UTF-8", "metadata-int", "metadata-list", "surrogate-key", "short-file"])
def test_hostile_shard_is_refused_quickly_without_allocating(tmp_path, shard, rule):
    """Each hostile header is a FormatError naming the rule, within the time and memory bounds of read_all."""
    (tmp_path / "h.safetensors").write_bytes(shard)
    with pytest.raises(FormatError, match=rule.replace("(", r"\(")):
        read_all(tmp_path / "h.safetensors")


def test_header_beyond_the_limit_is_refused_unread(tmp_path):
    """A header length above MAX_HEADER_BYTES inside a (sparse) file long enough to hold it is refused before any of
    it is read: peak memory stays far below the claimed length."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{")
        f.truncate(MAX_HEADER_BYTES + 64)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="exceeds"):
            read_header(str(path))
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("header, data", [
    ({}, b""),
    ({"__metadata__": {"format": "pt", "": "\u00e9\U0001f600"}}, b""),
    ({"k" * 1_000_000: _record()["t"]}, b"\1\2\3\4"),
    ({"t": {"dtype": "BF16", "shape": [0, (1 << 62) - 1], "data_offsets": [0, 0]}, "u": _record()["t"]}, b"abcd"),
    ({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4], "extra": {"ignored": [1.5, None]}}}, b"wxyz"),
], ids=["empty", "metadata", "1MB-key", "huge-empty", "extra-field"])
def test_unusual_but_valid_shards_read_exactly(tmp_path, header, data):
    """Valid corner cases are read, not refused: no tensors, metadata, a 1 MB name, an empty tensor of a huge dim,
    an unknown field in a record."""
    (tmp_path / "v.safetensors").write_bytes(encode(header, data))
    got = refused_or_exact(tmp_path / "v.safetensors")
    assert got is not None and set(got) == set(header) - {"__metadata__"}
    for key, (dtype, shape, blob) in got.items():
        assert (dtype, list(shape)) == (header[key]["dtype"], header[key]["shape"])
        assert blob == data[slice(*header[key]["data_offsets"])]


def test_special_files_are_refused_without_blocking(tmp_path):
    """A FIFO (which would block an open for reading) and a directory named like a shard are FormatErrors."""
    os.mkfifo(tmp_path / "fifo.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    for name in ("fifo.safetensors", "dir.safetensors"):
        with time_limit(5), pytest.raises(FormatError, match="not a regular file"):
            read_header(str(tmp_path / name))
