"""The EXL3 format: codebooks, tile ring, permutation, decode vs exllamav3, Hadamard, validation."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from exl3moe import EXL3Weight, ExpertSet, FormatError
from exl3moe.format import (codebook_table, decode, decode_states, hadamard_blockwise, hadamard_matrix,
                            pack_states, tile_permutation, unpack_states)
from exl3moe.format.bitstream import state_ends
from exl3moe.format.codebook import INST3_ADDEND, INST3_MULTIPLIER, MCG_MULTIPLIER, MUL1_MULTIPLIER
from helpers import random_scales, random_trellis, random_weight

ALL_K = (1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5)

# Format doc 3.6: (codebook, state, 32-bit product, after lop3 or byte sum, fp16 bits, value).
CODEBOOK_VECTORS = [
    ("3inst", 0x0000, 0x03D45AA4, 0x38B431C4, 0x3A25, 0.76806640625),
    ("3inst", 0x0001, 0x0925D716, 0x3245BC76, 0xBB5B, -0.91943359375),
    ("3inst", 0x1234, 0xD321A5CC, 0xB841BEAC, 0xC066, -2.19921875),
    ("3inst", 0xFFFF, 0x7AF4DE32, 0x3194B552, 0xB110, -0.158203125),
    ("mcg", 0x0000, 0x00000000, 0x3B603B60, 0x3F60, 1.84375),
    ("mcg", 0x0001, 0xCBAC1FED, 0xB0CC348D, 0x304E, 0.134521484375),
    ("mcg", 0x1234, 0x79352624, 0x32553D44, 0x3E0F, 1.5146484375),
    ("mcg", 0xFFFF, 0x5440E013, 0x3F20BB73, 0x3ACD, 0.85009765625),
    ("mul1", 0x0000, 0x00000000, 0, 0xC2E8, -3.453125),
    ("mul1", 0x0001, 0x83DCD12D, 605, 0x3921, 0.64111328125),
    ("mul1", 0x1234, 0x4F8FA724, 425, 0xB89E, -0.5771484375),
    ("mul1", 0xFFFF, 0x4D502ED3, 414, 0xB936, -0.6513671875),
]


def _product(codebook: str, state: int) -> int:
    if codebook == "3inst":
        return (state * INST3_MULTIPLIER + INST3_ADDEND) & 0xFFFFFFFF
    return (state * (MCG_MULTIPLIER if codebook == "mcg" else MUL1_MULTIPLIER)) & 0xFFFFFFFF


@pytest.mark.parametrize("codebook,state,product,mixed,bits,value", CODEBOOK_VECTORS)
def test_codebook_vectors(codebook, state, product, mixed, bits, value):
    assert _product(codebook, state) == product
    if codebook == "mul1":
        assert sum((product >> (8 * i)) & 0xFF for i in range(4)) == mixed
    else:
        assert (product & 0x8FFF8FFF) ^ 0x3B603B60 == mixed
    decoded = decode_states(torch.tensor([state]), codebook)
    assert decoded.dtype == torch.float16
    assert int(decoded.view(torch.int16)[0]) & 0xFFFF == bits
    assert float(decoded[0]) == value
    assert float(codebook_table(codebook)[state]) == value


def _words(trellis: torch.Tensor) -> list:
    t = trellis.to(torch.int64) & 0xFFFF
    return [int(t[2 * w]) | (int(t[2 * w + 1]) << 16) for w in range(t.numel() // 2)]


def _hex16(values: list) -> torch.Tensor:
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values], dtype=torch.int16)


def test_bitstream_vector_k3():
    symbols = torch.arange(256) % 8
    trellis = pack_states(symbols, 3)
    assert trellis.dtype == torch.int16 and trellis.shape == (48,)
    assert _words(trellis)[:4] == [0x05397705, 0x39770539, 0x77053977, 0x05397705]
    assert torch.equal(trellis[:8], _hex16([0x7705, 0x0539, 0x0539, 0x3977, 0x3977, 0x7705, 0x7705, 0x0539]))
    states = unpack_states(trellis, 3)
    assert [int(states[p]) for p in (0, 1, 2, 3, 255)] == [0xCBB8, 0x5DC1, 0xEE0A, 0x7053, 0x3977]


def test_bitstream_vector_k2p5():
    widths = torch.tensor([2 + (p & 1) for p in range(256)])
    symbols = torch.arange(256) % (1 << widths)
    trellis = pack_states(symbols, 2.5)
    assert trellis.shape == (40,)
    assert _words(trellis)[:4] == [0x0CCB70CC, 0xB70CCB70, 0xCCB70CCB, 0x70CCB70C]
    assert torch.equal(trellis[:8], _hex16([0x70CC, 0x0CCB, 0xCB70, 0xB70C, 0x0CCB, 0xCCB7, 0xB70C, 0x70CC]))
    states = unpack_states(trellis, 2.5)
    assert [int(states[p]) for p in (0, 1, 2, 3, 255)] == [0x32DC, 0x96E1, 0x5B86, 0xDC33, 0xCCB7]
    assert [state_ends(5)[p] for p in (0, 1, 2, 3, 255)] == [2, 5, 7, 10, 640]


# Format doc 2.5: rows of the (row, col) -> p table.
PERMUTATION_ROWS = {
    0: [0, 32, 64, 96, 128, 160, 192, 224, 4, 36, 68, 100, 132, 164, 196, 228],
    1: [1, 33, 65, 97, 129, 161, 193, 225, 5, 37, 69, 101, 133, 165, 197, 229],
    2: [8, 40, 72, 104, 136, 168, 200, 232, 12, 44, 76, 108, 140, 172, 204, 236],
    7: [25, 57, 89, 121, 153, 185, 217, 249, 29, 61, 93, 125, 157, 189, 221, 253],
    8: [2, 34, 66, 98, 130, 162, 194, 226, 6, 38, 70, 102, 134, 166, 198, 230],
    12: [18, 50, 82, 114, 146, 178, 210, 242, 22, 54, 86, 118, 150, 182, 214, 246],
    15: [27, 59, 91, 123, 155, 187, 219, 251, 31, 63, 95, 127, 159, 191, 223, 255],
}


def test_tile_permutation_table():
    perm = tile_permutation().reshape(16, 16)
    for row, expected in PERMUTATION_ROWS.items():
        assert perm[row].tolist() == expected
    assert sorted(perm.reshape(-1).tolist()) == list(range(256))
    assert perm[:, 3].tolist() == [96, 97, 104, 105, 112, 113, 120, 121, 98, 99, 106, 107, 114, 115, 122, 123]


@pytest.fixture(scope="module")
def decode_fixture(fixtures_dir):
    return load_file(os.path.join(fixtures_dir, "exllamav3_decode_linear.safetensors"))


DECODE_TAGS = [f"{cb}_K{k}" for cb in ("3inst", "mcg", "mul1") for k in range(1, 9)] + \
    ["mul1_K1p5", "mul1_K2p5", "mul1_K3p5"]


def tag_tensors(tensors: dict, tag: str) -> dict:
    """The subkeys of one fixture tag: trellis, suh, svh, marker, x, y, ..."""
    return {key.split(".", 1)[1]: value for key, value in tensors.items() if key.startswith(tag + ".")}


@pytest.mark.parametrize("tag", DECODE_TAGS)
def test_decode_bit_exact(decode_fixture, tag):
    sub = tag_tensors(decode_fixture, tag)
    codebook, k_text = tag.split("_K")
    K = float(k_text.replace("p", "."))
    assert ("mcg" in sub, "mul1" in sub) == (codebook == "mcg", codebook == "mul1")
    w_inner = decode(sub["trellis"], K, codebook)
    assert w_inner.dtype == torch.float16 and w_inner.shape == (256, 384)
    assert torch.equal(w_inner.view(torch.int16), sub["w_rot"].view(torch.int16))
    weight = EXL3Weight.from_tensors(sub, tag)
    assert weight.codebook == codebook and weight.K == K
    assert torch.equal(weight.inner().view(torch.int16), sub["w_rot"].view(torch.int16))


def test_decode_fixture_has_all_tags(decode_fixture):
    assert {key.split(".")[0] for key in decode_fixture} == set(DECODE_TAGS)


def test_hadamard_orthogonal_symmetric():
    h = hadamard_matrix(torch.float64)
    assert torch.equal(h, h.t())
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-13)
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(128)))
    assert h[0].gt(0).all() and h[:, 0].gt(0).all()
    assert h[5, 3] < 0 and h[5, 2] > 0  # popcount(5 & 3) = 1, popcount(5 & 2) = 0


def test_hadamard_blockwise_is_blockdiag():
    x = torch.randn(3, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    h = hadamard_matrix(torch.float64)
    blockdiag = torch.block_diag(h, h)
    assert torch.allclose(hadamard_blockwise(x), x @ blockdiag, atol=1e-12)
    with pytest.raises(FormatError):
        hadamard_blockwise(torch.zeros(2, 100))


def _good_parts():
    g = torch.Generator().manual_seed(3)
    return dict(trellis=random_trellis(128, 256, 2, g), suh=random_scales(128, g), svh=random_scales(256, g))


def _make(**changes):
    parts = {**_good_parts(), "codebook": "3inst", **changes}
    return EXL3Weight(parts["trellis"], parts["suh"], parts["svh"], parts["codebook"], parts.get("bias"), "w")


BAD_WEIGHTS = {
    "trellis_int32": (dict(trellis=torch.zeros(8, 16, 32, dtype=torch.int32)), "w.trellis"),
    "trellis_2d": (dict(trellis=torch.zeros(8, 512, dtype=torch.int16)), "w.trellis"),
    "trellis_last_dim_17": (dict(trellis=torch.zeros(8, 16, 17, dtype=torch.int16)), "w.trellis"),
    "trellis_last_dim_144": (dict(trellis=torch.zeros(8, 16, 144, dtype=torch.int16)), "w.trellis"),
    "half_k_3inst": (dict(trellis=torch.zeros(8, 16, 40, dtype=torch.int16)), "w.trellis"),
    "half_k_mcg": (dict(trellis=torch.zeros(8, 16, 24, dtype=torch.int16), codebook="mcg"), "w.trellis"),
    "suh_fp32": (dict(suh=torch.ones(128)), "w.suh"),
    "suh_short": (dict(suh=torch.ones(127, dtype=torch.float16)), "w.suh"),
    "suh_nan": (dict(suh=torch.full((128,), float("nan"), dtype=torch.float16)), "w.suh"),
    "svh_bf16": (dict(svh=torch.ones(256, dtype=torch.bfloat16)), "w.svh"),
    "svh_long": (dict(svh=torch.ones(384, dtype=torch.float16)), "w.svh"),
    "svh_inf": (dict(svh=torch.full((256,), float("inf"), dtype=torch.float16)), "w.svh"),
    "k_not_128": (dict(trellis=torch.zeros(4, 16, 32, dtype=torch.int16), suh=torch.ones(64, dtype=torch.float16)),
                  "w.trellis"),
    "n_not_128": (dict(trellis=torch.zeros(8, 4, 32, dtype=torch.int16), svh=torch.ones(64, dtype=torch.float16)),
                  "w.trellis"),
    "unknown_codebook": (dict(codebook="mcg2"), "w.codebook"),
    "bias_wrong_length": (dict(bias=torch.zeros(128, dtype=torch.float16)), "w.bias"),
}


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_weight_rejects(case):
    changes, name = BAD_WEIGHTS[case]
    with pytest.raises(FormatError) as info:
        _make(**changes)
    assert info.value.name == name
    assert str(info.value).startswith(name + ":")


def test_good_weight_derives_shapes():
    w = _make(trellis=random_trellis(128, 256, 2.5), codebook="mul1")
    assert (w.in_features, w.out_features, w.K) == (128, 256, 2.5)


def _stored(**extra):
    return {**_good_parts(), **extra}


def test_from_tensors_both_markers():
    markers = EXL3Weight.from_tensors(_stored(), "w")
    mcg = torch.tensor(MCG_MULTIPLIER - (1 << 32), dtype=torch.int32)
    mul1 = torch.tensor(MUL1_MULTIPLIER - (1 << 32), dtype=torch.int32)
    assert markers.codebook == "3inst"
    assert EXL3Weight.from_tensors(_stored(mcg=mcg), "w").codebook == "mcg"
    assert EXL3Weight.from_tensors(_stored(mul1=mul1), "w").codebook == "mul1"
    with pytest.raises(FormatError) as info:
        EXL3Weight.from_tensors(_stored(mcg=mcg, mul1=mul1), "w")
    assert info.value.name == "w"


def test_from_tensors_bad_marker_value():
    with pytest.raises(FormatError) as info:
        EXL3Weight.from_tensors(_stored(mul1=torch.tensor(12345, dtype=torch.int32)), "w")
    assert info.value.name == "w.mul1"
    with pytest.raises(FormatError) as info:
        EXL3Weight.from_tensors(_stored(mcg=torch.tensor(MCG_MULTIPLIER, dtype=torch.int64)), "w")
    assert info.value.name == "w.mcg"


def test_from_tensors_missing_scales():
    parts = _stored()
    del parts["svh"]
    with pytest.raises(FormatError) as info:
        EXL3Weight.from_tensors(parts, "w")
    assert info.value.name == "w.svh"


def test_legacy_sign_fields():
    parts = _stored()
    su_words = [0x0001, 0x8000, 0x0000, 0xFFFF, 0x00F0, 0x1234, 0x0000, 0x0000]
    sv_words = [(w * 7919) & 0xFFFF for w in range(16)]
    parts["su"], parts["sv"] = _hex16(su_words), _hex16(sv_words)
    del parts["suh"], parts["svh"]
    w = EXL3Weight.from_tensors(parts, "w")
    for words, scales in ((su_words, w.suh), (sv_words, w.svh)):
        assert scales.dtype == torch.float16 and scales.numel() == 16 * len(words)
        expected = [-1.0 if (words[i // 16] >> (i % 16)) & 1 else 1.0 for i in range(16 * len(words))]
        assert scales.tolist() == expected
    assert w.suh[0] == -1 and w.suh[1] == 1 and w.suh[31] == -1 and w.suh[16] == 1


def _expert_set(**changes):
    g = torch.Generator().manual_seed(4)
    make = lambda k, n: [random_weight(k, n, 2, generator=g) for _ in range(2)]  # noqa: E731
    parts = dict(gate=make(128, 256), up=make(128, 256), down=make(256, 128), activation="silu")
    parts.update(changes)
    return ExpertSet(parts["gate"], parts["up"], parts["down"], parts["activation"], name="ex")


def test_expert_set_rejects():
    _expert_set()
    odd_up = [random_weight(128, 256, 2), random_weight(128, 384, 2)]
    with pytest.raises(FormatError) as info:
        _expert_set(up=odd_up)
    assert info.value.name == "ex.up[1]"
    odd_down = [random_weight(256, 128, 2), random_weight(128, 128, 2)]
    with pytest.raises(FormatError) as info:
        _expert_set(down=odd_down)
    assert info.value.name == "ex.down[1]"
    with pytest.raises(FormatError) as info:
        _expert_set(gate=None)
    assert info.value.name == "ex.gate"
    with pytest.raises(FormatError) as info:
        _expert_set(activation="relu2")
    assert info.value.name == "ex.gate"
    with pytest.raises(FormatError) as info:
        _expert_set(activation="swish")
    assert info.value.name == "ex.activation"


def _tile_words(K: float) -> int:
    return int(16 * K)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ALL_K), st.integers(1, 3), st.data())
def test_unpack_pack_round_trip(K, tiles, data):
    raw = data.draw(st.binary(min_size=2 * tiles * _tile_words(K), max_size=2 * tiles * _tile_words(K)))
    trellis = torch.frombuffer(bytearray(raw), dtype=torch.int16).reshape(tiles, _tile_words(K))
    states = unpack_states(trellis, K)
    assert states.shape == (tiles, 256) and int(states.min()) >= 0 and int(states.max()) < 65536
    assert torch.equal(pack_states(states, K), trellis)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ALL_K), st.lists(st.integers(0, 255), min_size=256, max_size=256))
def test_pack_unpack_symbols(K, raw_symbols):
    ends = (0,) + state_ends(int(2 * K))
    widths = torch.tensor([ends[p + 1] - ends[p] for p in range(256)])
    symbols = torch.tensor(raw_symbols) & ((1 << widths) - 1)
    states = unpack_states(pack_states(symbols, K), K).to(torch.int64)
    assert torch.equal(states & ((1 << widths) - 1), symbols)
    previous = torch.roll(states, 1)
    assert torch.equal(((previous << widths) | symbols) & 0xFFFF, states)


_GARBAGE_DTYPES = (torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16, torch.uint8)
_GARBAGE_SIZES = (0, 1, 2, 8, 16, 24, 40, 128, 256)


@st.composite
def _garbage_value(draw):
    kind = draw(st.sampled_from(("tensor", "tensor", "tensor", "none", "int", "str")))
    if kind != "tensor":
        return {"none": None, "int": 7, "str": "trellis"}[kind]
    shape = draw(st.lists(st.sampled_from(_GARBAGE_SIZES), max_size=3))
    if math.prod(shape) > 16384:
        shape = shape[:1]
    dtype = draw(st.sampled_from(_GARBAGE_DTYPES))
    fill = draw(st.sampled_from((0.0, 1.0, -1.0, float("nan"), float("inf"))))
    if not dtype.is_floating_point and not math.isfinite(fill):
        fill = 3.0
    return torch.full(shape, fill).to(dtype)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")),
                       _garbage_value(), max_size=8), st.booleans())
def test_from_tensors_garbage_only_format_error(garbage, with_good_base):
    tensors = {**(_good_parts() if with_good_base else {}), **garbage}
    try:
        w = EXL3Weight.from_tensors(tensors, "g")
    except FormatError as error:
        assert error.name.startswith("g")
        return
    assert w.suh.numel() == w.in_features and w.svh.numel() == w.out_features
