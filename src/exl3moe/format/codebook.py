"""Computed codebooks of EXL3: 16-bit trellis state -> fp16 value, bit-exact with the format."""

from functools import lru_cache

import torch

from ..errors import FormatError

CODEBOOKS = ("3inst", "mcg", "mul1")
CODEBOOK_ID = {"3inst": 0, "mcg": 1, "mul1": 2}
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
INST3_MULTIPLIER = 89226354
INST3_ADDEND = 64248484
MUL1_INV = 0.00676727294921875
MUL1_BIAS = -10.3828125
_MASK32 = 0xFFFFFFFF


def check_codebook(codebook: str, name: str = "codebook") -> str:
    if not isinstance(codebook, str) or codebook not in CODEBOOKS:
        raise FormatError(name, f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    return codebook


def _int16_bits_to_half(bits: torch.Tensor) -> torch.Tensor:
    signed = bits - ((bits & 0x8000) << 1)
    return signed.to(torch.int16).view(torch.float16)


def _decode_lop3(x: torch.Tensor) -> torch.Tensor:
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _int16_bits_to_half(x & 0xFFFF).double()
    hi = _int16_bits_to_half(x >> 16).double()
    return (lo + hi).to(torch.float16)


def decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """Map integer states (any shape, values 0..65535) to fp16 codebook values by direct arithmetic."""
    check_codebook(codebook)
    s = states.to(torch.int64) & 0xFFFF
    if codebook == "3inst":
        return _decode_lop3((s * INST3_MULTIPLIER + INST3_ADDEND) & _MASK32)
    if codebook == "mcg":
        return _decode_lop3((s * MCG_MULTIPLIER) & _MASK32)
    x = (s * MUL1_MULTIPLIER) & _MASK32
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    return ((1024 + byte_sum).double() * MUL1_INV + MUL1_BIAS).to(torch.float16)


@lru_cache(maxsize=None)
def _table_cpu(codebook: str) -> torch.Tensor:
    return decode_states(torch.arange(65536, dtype=torch.int64), codebook)


@lru_cache(maxsize=None)
def _table_on(codebook: str, device: str) -> torch.Tensor:
    return _table_cpu(codebook).to(device)


def codebook_table(codebook: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """All 65536 values of a codebook as an fp16 tensor, indexed by state."""
    check_codebook(codebook)
    device = torch.device(device)
    if device.type == "cpu":
        return _table_cpu(codebook)
    return _table_on(codebook, str(device))
