"""Safetensors shards as untrusted input: header parsed and validated by hand, tensors read lazily, shards written."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass

import torch

from ..errors import ContractError, FormatError

DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
ITEM_BYTES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces
MAX_INT_DIGITS = 20  # 2^64 has 20 digits; longer integer literals are refused before Python converts them
MAX_DIMS = 64  # far above any checkpoint tensor; bounds what a shape list makes torch allocate
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: shard file, dtype name, shape, absolute byte offset and length."""

    key: str
    path: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int

    @property
    def shard(self) -> str:
        return os.path.basename(self.path)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _no_duplicate_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:80]!r}")
        out[key] = value
    return out


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(digits)} characters exceeds 64 bits")
    return int(digits)


def _parse_json(raw: bytes, shard: str) -> dict:
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("header must start with '{'")
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant,
                            parse_int=_bounded_int)
    except (ValueError, RecursionError) as err:
        raise FormatError(shard, f"header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise FormatError(shard, "header must be a JSON object")
    return header


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _is_count(x) -> bool:
    return type(x) is int and 0 <= x < 1 << 63


def _entry(key: str, info, path: str, data_start: int, data_size: int) -> TensorEntry:
    """One header record, checked: dtype known, shape and offsets non-negative ints, size = dtype * shape."""
    shard = os.path.basename(path)
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(repr(key), f"in {shard}: tensor name is not valid UTF-8") from None
    if not isinstance(info, dict):
        raise FormatError(key, f"in {shard}: header record must be an object, got {type(info).__name__}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(key, f"in {shard}: unknown or unsupported dtype {_clip(repr(dtype))}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise FormatError(key, f"in {shard}: shape must be a list of at most {MAX_DIMS} integers in [0, 2^63), "
                          f"got {_clip(repr(shape))}")
    if math.prod(max(d, 1) for d in shape) >= 1 << 63:
        raise FormatError(key, f"in {shard}: shape {shape} has strides beyond 64 bits, even if empty")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise FormatError(key, f"in {shard}: data_offsets must be two integers in [0, 2^63), got "
                          f"{_clip(repr(offsets))}")
    begin, end = offsets
    if begin > end or end > data_size:
        raise FormatError(key, f"in {shard}: data_offsets [{begin}, {end}] lie outside the {data_size}-byte data area")
    want = math.prod(shape) * ITEM_BYTES[dtype]
    if end - begin != want:
        raise FormatError(key, f"in {shard}: data_offsets span {end - begin} bytes but {dtype} {shape} needs {want}")
    return TensorEntry(key, path, dtype, tuple(shape), data_start + begin, end - begin)


def _check_tiling(entries: list, data_start: int, data_size: int, shard: str) -> None:
    """The data area must be covered exactly once, without holes (the safetensors rule)."""
    position, previous = data_start, None
    for e in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if e.offset < position:
            raise FormatError(e.key, f"in {shard}: data_offsets overlap those of {previous.key!r}")
        if e.offset > position:
            raise FormatError(e.key, f"in {shard}: {e.offset - position} unindexed bytes before this tensor")
        position, previous = e.offset + e.nbytes, e
    if position != data_start + data_size:
        raise FormatError(shard, f"{data_start + data_size - position} bytes after the last tensor are not indexed")


def _open_regular(path: str):
    """(binary file, size) of a regular file; a FIFO, device or directory is refused without blocking on it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(os.path.basename(path), "is not a regular file")
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str) -> dict:
    """Parse and validate one shard's header; returns {key: TensorEntry}. Reads no tensor data."""
    shard = os.path.basename(path)
    try:
        f, size = _open_regular(path)
        with f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(shard, f"truncated: {size} bytes, too short for the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise FormatError(shard, f"header length {header_len} runs past the end of the {size}-byte file")
            if header_len > MAX_HEADER_BYTES:
                raise FormatError(shard, f"header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
            raw = f.read(header_len)
    except OSError as err:
        raise FormatError(shard, f"cannot read shard: {err}") from None
    if len(raw) != header_len:
        raise FormatError(shard, f"truncated: header needs {header_len} bytes, file holds {len(raw)}")
    header = _parse_json(raw, shard)
    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{shard}:{METADATA_KEY}", "must map strings to strings")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries = [_entry(key, info, path, data_start, data_size) for key, info in header.items()]
    _check_tiling(entries, data_start, data_size, shard)
    return {e.key: e for e in entries}


def read_bytes(entry: TensorEntry, handle=None) -> bytes:
    """The raw bytes of one tensor; a file that shrank since its header was read is a FormatError."""
    try:
        if handle is None:
            with _open_regular(entry.path)[0] as f:
                return read_bytes(entry, f)
        handle.seek(entry.offset)
        data = handle.read(entry.nbytes)
    except OSError as err:
        raise FormatError(entry.key, f"in {entry.shard}: cannot read: {err}") from None
    if len(data) != entry.nbytes:
        raise FormatError(entry.key, f"in {entry.shard}: file ended after {len(data)} of {entry.nbytes} bytes")
    return data


def read_tensor(entry: TensorEntry, device=None) -> torch.Tensor:
    """Load one tensor (little-endian, as safetensors stores it) onto device (default CPU)."""
    dtype = DTYPES[entry.dtype]
    if entry.nbytes == 0:
        t = torch.empty(entry.shape, dtype=dtype)
    else:
        t = torch.frombuffer(bytearray(read_bytes(entry)), dtype=dtype).reshape(entry.shape)
    return t if device is None else t.to(device)


def read_range(handle, entry: TensorEntry, offset: int, into: memoryview) -> None:
    """Fill `into` with the tensor's bytes from `offset` (relative to the tensor's start) on."""
    try:
        handle.seek(entry.offset + offset)
        got = handle.readinto(into)
    except OSError as err:
        raise FormatError(entry.key, f"in {entry.shard}: cannot read: {err}") from None
    if got != len(into):
        raise FormatError(entry.key, f"in {entry.shard}: file ended after {offset + got} of {entry.nbytes} bytes")


def read_tensor_slice(entry: TensorEntry, dim: int, start: int, stop: int, device=None) -> torch.Tensor:
    """tensor[(:,) * dim, start:stop] read alone: one byte range per index of the dimensions before `dim`."""
    shape = entry.shape
    if not 0 <= dim < len(shape) or not 0 <= start < stop <= shape[dim]:
        raise ContractError(entry.key, f"slice {start}:{stop} of dim {dim} is outside shape {list(shape)}")
    inner = math.prod(shape[dim + 1:]) * ITEM_BYTES[entry.dtype]
    run, stride = (stop - start) * inner, shape[dim] * inner
    outer = math.prod(shape[:dim])
    data = bytearray(outer * run)
    view = memoryview(data)
    with _open_regular(entry.path)[0] as handle:
        for i in range(outer):
            read_range(handle, entry, i * stride + start * inner, view[i * run:(i + 1) * run])
    t = torch.frombuffer(data, dtype=DTYPES[entry.dtype]).reshape(*shape[:dim], stop - start, *shape[dim + 1:])
    return t if device is None else t.to(device)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_shard(path: str, tensors: dict) -> None:
    """Write {key: tensor} as one safetensors file (no __metadata__, header padded to 8 bytes)."""
    header, offset, blobs = {}, 0, []
    for key, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPE_NAMES:
            raise ContractError(key, f"cannot store {getattr(t, 'dtype', type(t).__name__)} in safetensors")
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise ContractError(repr(key), "tensor name must be valid UTF-8") from None
        t = t.detach().to("cpu").contiguous()
        nbytes = tensor_nbytes(t)
        header[key] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        blobs.append(t)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in blobs:
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
