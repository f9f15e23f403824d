"""The checkpoint loader fuzzed on copies of tests/fixtures/tiny_qwen3_moe_exl3: mutated config.json, mutated
tensors of a few linears (dtype, shape, values, markers, names), truncated shards. Every case is a FormatError or a
read equal to what the shard holds; cases that break a rule of the format must be refused."""

import json
import math
import os
import re
import shutil
import struct
import tracemalloc

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exl3moe import FormatError, open_checkpoint
from exl3moe.format.safetensors_io import DTYPES, ITEM_BYTES
from exl3moe.format.weight import MARKERS
from test_fuzz_safetensors import HUGE, JSON_VALUES, encode, fuzz_settings, layout, tensor_bytes, time_limit

FIXTURE = "tiny_qwen3_moe_exl3"
SHARD = "model.safetensors"
LAYER = "model.layers.0.mlp"
EXPERTS = [f"{LAYER}.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
MODULES = [*EXPERTS, "model.layers.0.self_attn.q_proj", "lm_head"]
PLAIN = ["model.norm.weight", f"{LAYER}.gate.weight"]
SUBKEYS = ("trellis", "suh", "svh", "mul1")
NAN_F16, INF_F16 = b"\x00\x7e", b"\x00\x7c"


def split_shard(blob: bytes) -> dict:
    """{key: [dtype, shape, bytes]} of a shard in header order (the fixture's; no metadata kept)."""
    (n,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    header.pop("__metadata__", None)
    return {k: [v["dtype"], tuple(v["shape"]), data[slice(*v["data_offsets"])]] for k, v in header.items()}


@pytest.fixture(scope="module")
def copy(fixtures_dir, tmp_path_factory):
    """A private copy of the fixture checkpoint and its tensors as a table."""
    path = tmp_path_factory.mktemp("ckpt") / FIXTURE
    shutil.copytree(os.path.join(fixtures_dir, FIXTURE), path)
    shutil.copyfile(path / SHARD, path.parent / "original.safetensors")
    return path, split_shard((path / SHARD).read_bytes())


def write_table(path, table: dict) -> None:
    (path / SHARD).write_bytes(encode(*layout({k: tuple(v) for k, v in table.items()})))


def pristine(path) -> None:
    """Put the fixture's own shard back where a test changed it."""
    if (path / SHARD).read_bytes() != (path.parent / "original.safetensors").read_bytes():
        shutil.copyfile(path.parent / "original.safetensors", path / SHARD)


def sign_bits(packed: bytes) -> torch.Tensor:
    words = torch.frombuffer(bytearray(packed), dtype=torch.int16).to(torch.int64) & 0xFFFF
    return (1 - 2 * ((words[:, None] >> torch.arange(16)) & 1)).reshape(-1).half()


def stored(table: dict, key: str) -> torch.Tensor:
    dtype, shape, blob = table[key]
    flat = torch.frombuffer(bytearray(blob), dtype=DTYPES[dtype]) if blob else torch.empty(0, dtype=DTYPES[dtype])
    return flat.reshape(shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and tensor_bytes(a) == tensor_bytes(b)


def check_linear(w, table: dict, key: str) -> None:
    """A loaded EXL3Weight equals its stored subkeys (suh / svh, or the legacy su / sv signs; marker; bias)."""
    assert w.name == key and same(w.trellis, stored(table, f"{key}.trellis"))
    for side, legacy in (("suh", "su"), ("svh", "sv")):
        want = stored(table, f"{key}.{side}") if f"{key}.{side}" in table else sign_bits(table[f"{key}.{legacy}"][2])
        assert same(getattr(w, side), want), f"{key}.{side}"
    markers = [m for m in ("mcg", "mul1") if f"{key}.{m}" in table]
    assert w.codebook == (markers[0] if markers else "3inst")
    if f"{key}.bias" in table:
        assert same(w.bias, stored(table, f"{key}.bias").half())


def expert_modules(table: dict, prefix: str) -> dict:
    """{(index, projection): [module keys]} of the routed experts stored under prefix."""
    found: dict = {}
    pattern = re.compile(rf"^{re.escape(prefix)}\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.")
    for key in table:
        m = pattern.match(key)
        if m:
            found.setdefault((int(m[1]), m[2]), set()).add(key[:m.end() - 1])
    return found


def exercise(path, table: dict, modules: list) -> None:
    """Open, then read the tensors and linears of `modules` and the layer's experts; each read must equal the
    table."""
    with time_limit(20):
        reader = open_checkpoint(path)
        assert sorted(reader.keys()) == sorted(table)
        for key in [k for k in table if k.rsplit(".", 1)[0] in modules or k in PLAIN]:
            assert same(reader.tensor(key), stored(table, key)), key
        linears = {info.key for info in reader.linears()}
        for key in sorted(linears & set(modules)):
            check_linear(reader.linear(key), table, key)
        if LAYER in reader.moe_layers():
            check_experts(reader.experts(LAYER), table)


def check_experts(experts, table: dict) -> None:
    """An ExpertSet read from the layer holds one stored module per index and projection, in index order."""
    found = expert_modules(table, LAYER)
    assert all(len(keys) == 1 for keys in found.values()), "two modules claim one expert index"
    for p, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        names = [w.name for w in getattr(experts, p)]
        assert names == [next(iter(found[(e, proj)])) for e in range(len(names))]
    assert len(experts.up) == 1 + max(e for e, _ in found)


def _retype(draw, table, key):
    dtype, _, blob = table[key]
    new = draw(st.sampled_from([d for d in sorted(DTYPES) if d != dtype and len(blob) % ITEM_BYTES[d] == 0]))
    table[key] = [new, (len(blob) // ITEM_BYTES[new],), blob]


def _reshape(draw, table, key):
    dtype, shape, blob = table[key]
    count = math.prod(shape)
    dims = draw(st.lists(st.sampled_from([d for d in range(1, count + 1) if count % d == 0]), max_size=3))
    rest = count // math.prod(dims) if count % math.prod(dims) == 0 else None
    new = tuple(draw(st.permutations([*dims, rest] if rest else [count])))
    table[key] = [dtype, new, blob]


def _poison(draw, table, key):
    """Overwrite some bytes: NaN / inf in a scale, another marker value, random trellis words."""
    dtype, shape, blob = table[key]
    if dtype == "F16" and blob:
        at = 2 * draw(st.integers(0, len(blob) // 2 - 1))
        table[key][2] = blob[:at] + draw(st.sampled_from([NAN_F16, INF_F16])) + blob[at + 2:]
    else:
        patch = draw(st.binary(min_size=len(blob[:4]), max_size=len(blob[:4])))
        table[key][2] = patch + blob[len(patch):]


def _drop(draw, table, key):
    del table[key]


def _add(draw, table, key):
    """A stray subkey beside a linear: the other marker, a legacy sign field, a bias of any dtype and shape."""
    module = key.rsplit(".", 1)[0]
    trellis = table.get(f"{module}.trellis", [None, (8, 8)])[1]
    k, n = (16 * trellis[0], 16 * trellis[1]) if len(trellis) >= 2 else (128, 128)
    sub = draw(st.sampled_from(["mcg", "su", "sv", "bias", "signs", "extra"]))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.sampled_from([[], [1], [k // 16], [n], [n, 1], [k]])))
    blob = draw(st.binary(min_size=math.prod(shape) * ITEM_BYTES[dtype], max_size=math.prod(shape) * ITEM_BYTES[dtype]))
    table[f"{module}.{sub}"] = [dtype, shape, blob]


def _rename(draw, table, key):
    """A subkey or a whole module under another name: another subkey, expert index or projection."""
    module, sub = key.rsplit(".", 1)
    whole = draw(st.booleans())
    if module.startswith(f"{LAYER}.experts.") and draw(st.booleans()):
        e, proj = module.split(".")[-2:]
        index = draw(st.sampled_from(["16", "0" + e, "\u0662", "x"]))
        proj = draw(st.sampled_from([proj, "w1", "w3", "w2", "gate_proj"]))
        target = f"{LAYER}.experts.{index}.{proj}"
    else:
        target = module
    moves = [k for k in table if k.startswith(module + ".")] if whole else [key]
    new_sub = sub if whole else draw(st.sampled_from(["trellis", "suh", "svh", "su", "sv", "mcg", "bias", "weight"]))
    renamed = {k: target + k[len(module):] if whole else f"{target}.{new_sub}" for k in moves}
    if not any(new in table and new not in renamed for new in renamed.values()):
        table.update({renamed[k]: table.pop(k) for k in moves})


EDITS = [_retype, _reshape, _poison, _drop, _add, _rename]
TRELLIS_LAST_DIMS = {16 * K for K in range(1, 9)} | {24, 40, 56}


def _finite(table: dict, key: str) -> bool:
    return bool(torch.isfinite(stored(table, key).half()).all())


def breaks_a_rule(table: dict, module: str) -> bool:
    """Whether the stored linear `module` breaks a rule of the EXL3 format (restated here, independently)."""
    get = lambda sub: table.get(f"{module}.{sub}")  # noqa: E731
    dtype, shape, _ = get("trellis")
    if dtype != "I16" or len(shape) != 3 or 0 in shape[:2] or shape[2] not in TRELLIS_LAST_DIMS:
        return True
    k, n = 16 * shape[0], 16 * shape[1]
    markers = [m for m in MARKERS if get(m)]
    if k % 128 or n % 128 or len(markers) > 1 or (shape[2] % 16 and markers != ["mul1"]):
        return True
    for m in markers:
        dtype, shape, blob = get(m)
        if dtype != "I32" or math.prod(shape) != 1 or struct.unpack("<I", blob)[0] != MARKERS[m]:
            return True
    for side, legacy, width in (("suh", "su", k), ("svh", "sv", n)):
        if get(side):
            if tuple(get(side)[:2]) != ("F16", (width,)) or not _finite(table, f"{module}.{side}"):
                return True
        elif not get(legacy) or tuple(get(legacy)[:2]) != ("I16", (width // 16,)):
            return True
    bias = get("bias")
    return bool(bias) and (bias[0] not in ("F16", "F32") or bias[1] != (n,) or not _finite(table, f"{module}.bias"))


@fuzz_settings(40)
@given(data=st.data())
def test_mutated_tensors_are_refused_or_read_exactly(copy, data):
    """1-3 edits (dtype, shape, values, dropped / stray / renamed subkeys and modules) of the tensors of a few
    linears (expert 0-2 projections of layer 0, q_proj, lm_head) and plain tensors: a FormatError, or every read
    equal to the stored bytes; a linear that breaks a rule of the format must be refused."""
    path, base = copy
    table = {k: list(v) for k, v in base.items()}
    for _ in range(data.draw(st.integers(1, 3))):
        keys = [k for k in table if k.rsplit(".", 1)[0] in MODULES or k in PLAIN]
        data.draw(st.sampled_from(EDITS))(data.draw, table, data.draw(st.sampled_from(keys)))
    touched = {k for k in table if k not in base or table[k] != list(base[k])} | (set(base) - set(table))
    modules = sorted(set(MODULES) | {k.rsplit(".", 1)[0] for k in touched})
    linears = [m for m in modules if f"{m}.trellis" in table and f"{m}.signs" not in table]
    must_refuse = any(breaks_a_rule(table, m) for m in linears)
    write_table(path, table)
    try:
        exercise(path, table, modules)
    except FormatError as err:
        assert err.name and err.rule
        return
    assert not must_refuse, "a linear that breaks a rule of the format was read"


@fuzz_settings(40)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_truncated_shard_is_refused(copy, fraction):
    """Any strict prefix of the shard is a FormatError at open."""
    path, _ = copy
    blob = (path.parent / "original.safetensors").read_bytes()
    (path / SHARD).write_bytes(blob[:int(fraction * len(blob))])
    with pytest.raises(FormatError):
        open_checkpoint(path)


@fuzz_settings(25)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_shard_truncated_after_open_is_refused_or_read_exactly(copy, fraction):
    """A shard cut after its header was read: reads of tensors still in the file are exact, the rest FormatError."""
    path, base = copy
    pristine(path)
    reader = open_checkpoint(path)
    os.truncate(path / SHARD, int(fraction * (path / SHARD).stat().st_size))
    for read in [*(lambda key=key: check_linear(reader.linear(key), base, key) for key in MODULES[-3:]),
                 lambda: check_experts(reader.experts(LAYER), base)]:
        try:
            read()
        except FormatError as err:
            assert "file ended" in err.rule, str(err)


CONFIG_PATHS = st.sampled_from([
    ("quantization_config",), ("quantization_config", "quant_method"), ("quantization_config", "bits"),
    ("quantization_config", "head_bits"), ("quantization_config", "codebook"), ("num_experts",),
    ("num_experts_per_tok",), ("num_hidden_layers",), ("hidden_size",), ("moe_intermediate_size",),
    ("model_type",), ("architectures",), ("hidden_act",), ("mlp_only_layers",), ("decoder_sparse_step",),
    ("tie_word_embeddings",), ("norm_topk_prob",)])


def _edit_config(draw, config: dict) -> str:
    """The config with one field (possibly nested) replaced by hostile JSON or deleted, as text, maybe mangled."""
    path = draw(CONFIG_PATHS)
    node = config
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(node, dict) else node
    if isinstance(node, dict):
        if draw(st.booleans()):
            node.pop(path[-1], None)
        else:
            node[path[-1]] = draw(JSON_VALUES | HUGE | st.sampled_from(["exl3", "EXL3", "exl3 ", float("nan")]))
    text = json.dumps(config)
    mangle = draw(st.sampled_from(["none", "duplicate", "deep", "digits", "cut", "non-UTF-8", "list", "BOM"]))
    return {"none": text,
            "duplicate": text[:-1] + ', "quantization_config": {"quant_method": "gptq"}}',
            "deep": '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}",
            "digits": text[:-1] + ', "num_experts": ' + "7" * 5000 + "}",
            "cut": text[:draw(st.integers(0, len(text) - 1))],
            "non-UTF-8": text[:-1] + ', "\udcff": 1}',
            "list": f"[{text}]",
            "BOM": "\ufeff" + text}[mangle]


@fuzz_settings(80)
@given(data=st.data())
def test_mutated_config_is_refused_or_read_exactly(copy, data):
    """config.json with a field of another type, a missing field or section, duplicate keys, deep nesting, huge
    numbers, bad UTF-8, cut short: a FormatError, or a reader whose config is the file's and whose linears read
    exactly; quantization_config must be an object with quant_method "exl3"."""
    path, base = copy
    write_table(path, base)
    original = (path / "config.json").read_text()
    config = json.loads(original)
    text = _edit_config(data.draw, config)
    (path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    try:
        with time_limit(20):
            reader = open_checkpoint(path)
    except FormatError as err:
        assert err.name and err.rule
        return
    finally:
        (path / "config.json").write_text(original)
    parsed = json.loads(text)
    assert json.dumps(reader.config, sort_keys=True) == json.dumps(parsed, sort_keys=True)
    assert parsed["quantization_config"]["quant_method"] == "exl3"
    check_linear(reader.linear("lm_head"), base, "lm_head")


def open_with_copy(copy, source: str, target: str):
    """The fixture reopened, without the completeness check at open (a tool reading what is there), with module
    `source`'s tensors also stored under the name `target`."""
    path, base = copy
    write_table(path, {**base, **{target + k[len(source):]: v for k, v in base.items() if k.startswith(source + ".")}})
    return open_checkpoint(path, strict=False)


def test_two_modules_for_one_expert_index_are_refused(copy):
    reader = open_with_copy(copy, f"{LAYER}.experts.5", f"{LAYER}.experts.03")
    with pytest.raises(FormatError):
        reader.experts(LAYER)


def test_huge_expert_index_is_refused_without_allocating(copy):
    reader = open_with_copy(copy, f"{LAYER}.experts.5", f"{LAYER}.experts.300000")
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="missing"):
            reader.experts(LAYER)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["blk." + "9" * 5000, "blk.1\u00b2"], ids=["5000-digits", "superscript"])
def test_odd_digit_names_are_read_or_refused(copy, name):
    base = copy[1]
    try:
        reader = open_with_copy(copy, "lm_head", name)
        reader.keys()
        check_linear(reader.linear(name), base | {f"{name}.{s}": base[f"lm_head.{s}"] for s in SUBKEYS}, name)
    except FormatError:
        pass
