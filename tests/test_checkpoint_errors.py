"""Checkpoints as untrusted input: every malformed file is a FormatError that names the shard or tensor."""

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exl3moe import EXL3Weight, FormatError, open_checkpoint
from exl3moe.format import write_checkpoint
from exl3moe.format.safetensors_io import DTYPES

EXL3_CONFIG = {"quantization_config": {"quant_method": "exl3"}}
PROJ = "model.layers.0.proj"
SHARD = "model.safetensors"


def random_weight(k, n, K, codebook="mul1", seed=0):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), generator=g, dtype=torch.int32)
    return EXL3Weight(trellis.to(torch.int16), (torch.rand(k, generator=g) + 0.5).half(),
                      (torch.rand(n, generator=g) + 0.5).half(), codebook)


def read_raw(path):
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def write_raw(path, header, data, length=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


@pytest.fixture
def ckpt(tmp_path):
    """A valid one-shard checkpoint: one mul1 linear and one plain tensor."""
    write_checkpoint(tmp_path, {PROJ: random_weight(128, 128, 2)}, {"model.norm.weight": torch.ones(128).half()},
                     EXL3_CONFIG)
    return tmp_path


def refused(path, match):
    with pytest.raises(FormatError) as info:
        open_checkpoint(path)
    assert match in str(info.value), str(info.value)
    return info.value


def test_valid_base_opens(ckpt):
    assert [i.key for i in open_checkpoint(ckpt).linears()] == [PROJ]


def test_shard_shorter_than_the_length_field(ckpt):
    (ckpt / SHARD).write_bytes(b"\x01\x02\x03")
    assert refused(ckpt, "truncated").name == SHARD


def test_header_cut_short(ckpt):
    blob = (ckpt / SHARD).read_bytes()
    (ckpt / SHARD).write_bytes(blob[:40])
    assert refused(ckpt, "runs past the end").name == SHARD


def test_header_length_beyond_file(ckpt):
    header, data = read_raw(ckpt / SHARD)
    write_raw(ckpt / SHARD, header, data, length=1 << 40)
    assert refused(ckpt, "runs past the end").name == SHARD


def test_header_not_json(ckpt):
    _, data = read_raw(ckpt / SHARD)
    text = b'{"a": [1, 2'
    (ckpt / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + data)
    assert refused(ckpt, "not valid JSON").name == SHARD


def test_duplicate_key_in_header(ckpt):
    text = b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, ' \
           b'"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    (ckpt / SHARD).write_bytes(struct.pack("<Q", len(text)) + text + b"\x00")
    refused(ckpt, "duplicate key 'x'")


def test_offsets_lying_about_the_size(ckpt):
    header, data = read_raw(ckpt / SHARD)
    header["model.norm.weight"]["data_offsets"][1] -= 2
    write_raw(ckpt / SHARD, header, data)
    assert refused(ckpt, "span 254 bytes but F16 [128] needs 256").name == "model.norm.weight"


def test_shape_lying_about_the_size(ckpt):
    header, data = read_raw(ckpt / SHARD)
    header[f"{PROJ}.trellis"]["shape"] = [8, 8, 16]
    write_raw(ckpt / SHARD, header, data)
    assert refused(ckpt, "needs").name == f"{PROJ}.trellis"


def test_offsets_beyond_the_data(ckpt):
    header, data = read_raw(ckpt / SHARD)
    write_raw(ckpt / SHARD, header, data[:-10])
    err = refused(ckpt, "outside the")
    assert err.name in header


def test_overlapping_offsets(ckpt):
    header, data = read_raw(ckpt / SHARD)
    header[f"{PROJ}.svh"]["data_offsets"] = list(header[f"{PROJ}.suh"]["data_offsets"])
    write_raw(ckpt / SHARD, header, data)
    err = refused(ckpt, "overlap")
    assert {err.name, str(err).split("those of ")[1].split("'")[1]} == {f"{PROJ}.suh", f"{PROJ}.svh"}


def test_unindexed_trailing_bytes(ckpt):
    header, data = read_raw(ckpt / SHARD)
    write_raw(ckpt / SHARD, header, data + b"\x00" * 8)
    assert refused(ckpt, "not indexed").name == SHARD


def test_unknown_dtype(ckpt):
    header, data = read_raw(ckpt / SHARD)
    header["model.norm.weight"]["dtype"] = "Q4_K"
    write_raw(ckpt / SHARD, header, data)
    assert refused(ckpt, "unknown or unsupported dtype 'Q4_K'").name == "model.norm.weight"


def test_tensor_named_in_index_but_missing_from_its_shard(tmp_path):
    tensors = {f"t{i}": torch.zeros(64) for i in range(4)}
    names = write_checkpoint(tmp_path, {}, tensors, EXL3_CONFIG, max_shard_bytes=256)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = names[0]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert refused(tmp_path, "missing from its shard").name == "model.ghost.weight"
    index["weight_map"].pop("model.ghost.weight")
    index["weight_map"]["t0"] = names[1]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert refused(tmp_path, "missing from its shard").name == "t0"
    index["weight_map"]["t0"] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert refused(tmp_path, "missing from the directory").name == "model-00009-of-00009.safetensors"


def test_same_tensor_in_two_shards(ckpt):
    (ckpt / "extra.safetensors").write_bytes((ckpt / SHARD).read_bytes())
    refused(ckpt, "stored twice")


@pytest.mark.parametrize("config", [{"quantization_config": {"quant_method": "gptq"}}, {"model_type": "x"},
                                    {"quantization_config": "exl3"}, ["exl3"]])
def test_config_that_is_not_exl3(ckpt, config):
    (ckpt / "config.json").write_text(json.dumps(config))
    assert refused(ckpt, "quant_method must be 'exl3'").name == "config.json"


def test_config_missing_or_broken(ckpt):
    (ckpt / "config.json").write_text("{")
    assert refused(ckpt, "JSON").name == "config.json"
    (ckpt / "config.json").unlink()
    assert refused(ckpt, "missing").name == "config.json"


def test_no_shards(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(EXL3_CONFIG))
    refused(tmp_path, "no *.safetensors")


def test_bad_marker_value(ckpt):
    header, data = read_raw(ckpt / SHARD)
    begin, end = header[f"{PROJ}.mul1"]["data_offsets"]
    write_raw(ckpt / SHARD, header, data[:begin] + struct.pack("<i", 12345) + data[end:])
    assert refused(ckpt, "must hold 0x83DCD12D, got 0x00003039").name == f"{PROJ}.mul1"


def write_linear_parts(path, **overrides):
    w = random_weight(128, 128, 2)
    parts = {f"p.{s}": t for s, t in w.stored_tensors().items()}
    parts.update({f"p.{s}": t for s, t in overrides.items() if t is not None})
    for s in [s for s, t in overrides.items() if t is None]:
        parts.pop(f"p.{s}")
    write_checkpoint(path, {}, parts, EXL3_CONFIG)


def test_both_markers(tmp_path):
    write_linear_parts(tmp_path, mcg=torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32))
    assert refused(tmp_path, "both mcg and mul1").name == "p"


def test_marker_of_the_wrong_dtype(tmp_path):
    write_linear_parts(tmp_path, mul1=torch.tensor(0x83DCD12D, dtype=torch.int64))
    assert refused(tmp_path, "int32 scalar").name == "p.mul1"


def test_missing_scale(tmp_path):
    write_linear_parts(tmp_path, suh=None)
    assert refused(tmp_path, "missing").name == "p.suh"


def test_scale_of_the_wrong_shape(tmp_path):
    write_linear_parts(tmp_path, svh=torch.ones(256).half())
    assert refused(tmp_path, "shape [128]").name == "p.svh"


def test_trellis_with_an_impossible_width(tmp_path):
    write_linear_parts(tmp_path, trellis=torch.zeros(8, 8, 33, dtype=torch.int16))
    assert refused(tmp_path, "last dim").name == "p.trellis"


def test_half_integer_K_needs_mul1(tmp_path):
    write_linear_parts(tmp_path, trellis=torch.zeros(8, 8, 40, dtype=torch.int16), mul1=None,
                       mcg=torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32))
    assert refused(tmp_path, "half-integer").name == "p.trellis"


def test_file_truncated_after_open(ckpt):
    reader = open_checkpoint(ckpt)
    blob = (ckpt / SHARD).read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    (ckpt / SHARD).write_bytes(blob[:8 + n + 100])
    with pytest.raises(FormatError) as info:
        reader.linear(PROJ)
    assert info.value.name == f"{PROJ}.trellis" and "file ended" in str(info.value)


def test_nan_scale_is_refused_at_load(tmp_path):
    write_linear_parts(tmp_path, suh=torch.full((128,), float("nan")).half())
    with pytest.raises(FormatError) as info:
        open_checkpoint(tmp_path).linear("p")
    assert info.value.name == "p.suh"


# Property tests: nothing but FormatError escapes, whatever the bytes.

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=6)
    | st.sampled_from(sorted(DTYPES)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture])


def moe_base(path):
    """A valid shard with two gated experts and a plain tensor, what the mutations start from (written once)."""
    if (path / "base.bin").exists():
        return (path / "base.bin").read_bytes()
    linears = {f"m.experts.{e}.{p}": random_weight(128, 128, 1, seed=e) for e in range(2)
               for p in ("gate_proj", "up_proj", "down_proj")}
    write_checkpoint(path, linears, {"m.gate.weight": torch.ones(2, 128).half()}, EXL3_CONFIG)
    assert exercise(path), "the unmutated base must open and load"
    (path / "base.bin").write_bytes((path / SHARD).read_bytes())
    return (path / "base.bin").read_bytes()


def exercise(path):
    """Open and read everything; only FormatError may come out."""
    try:
        reader = open_checkpoint(path)
        for key in reader.keys():
            reader.tensor(key)
        for info in reader.linears():
            reader.linear(info.key)
        for prefix in reader.moe_layers():
            reader.experts(prefix)
            reader.shared_expert(prefix)
        return True
    except FormatError:
        return False


@PROPERTY_SETTINGS
@given(blob=st.binary(max_size=600), framed=st.booleans())
def test_garbage_shard_raises_only_format_error(tmp_path, blob, framed):
    (tmp_path / "config.json").write_text(json.dumps(EXL3_CONFIG))
    (tmp_path / SHARD).write_bytes(struct.pack("<Q", len(blob) // 2) + blob if framed else blob)
    exercise(tmp_path)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_mutated_header_raises_only_format_error(tmp_path, data):
    base = moe_base(tmp_path)
    (n,) = struct.unpack("<Q", base[:8])
    header, body = json.loads(base[8:8 + n]), base[8 + n:]
    key = data.draw(st.sampled_from(sorted(header)))
    action = data.draw(st.sampled_from(["field", "record", "delete", "add", "shift", "cut"]))
    if action == "field":
        header[key][data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = data.draw(JSON_VALUES)
    elif action == "record":
        header[key] = data.draw(JSON_VALUES)
    elif action == "delete":
        del header[key]
    elif action == "add":
        header[data.draw(st.text(max_size=30))] = data.draw(JSON_VALUES)
    elif action == "shift":
        begin, end = header[key]["data_offsets"]
        shift = st.integers(-600, 600)
        header[key]["data_offsets"] = [begin + data.draw(shift), end + data.draw(shift)]
    else:
        body = body[:data.draw(st.integers(0, len(body)))]
    write_raw(tmp_path / SHARD, header, body)
    exercise(tmp_path)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_flipped_bytes_raise_only_format_error(tmp_path, data):
    base = moe_base(tmp_path)
    (n,) = struct.unpack("<Q", base[:8])
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, 8 + n - 1) | st.integers(0, len(blob) - 1))
        blob[position] = data.draw(st.integers(0, 255))
    (tmp_path / SHARD).write_bytes(bytes(blob))
    exercise(tmp_path)
