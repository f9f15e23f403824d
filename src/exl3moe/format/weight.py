"""EXL3Weight: one quantized linear layer (trellis, scales, codebook, bias), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FormatError
from .bitstream import k_from_last_dim, tiles_to_matrix, unpack_states
from .codebook import CODEBOOKS, MCG_MULTIPLIER, MUL1_MULTIPLIER, check_codebook, codebook_table
from .frozen import Frozen, tensor_key
from .hadamard import HAD, hadamard_blockwise

MARKERS = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}


def decode(trellis: torch.Tensor, K: float, codebook: str) -> torch.Tensor:
    """W_inner: int16 [k/16, n/16, 16K] -> fp16 [k, n], bit-exact with exllamav3's reconstruct."""
    check_codebook(codebook)
    if K != int(K) and codebook != "mul1":
        raise FormatError("trellis", f"half-integer K={K} is only defined for the mul1 codebook, not {codebook}")
    states = unpack_states(trellis, K).to(torch.int64)
    values = codebook_table(codebook, trellis.device)[states]
    return tiles_to_matrix(values)


def _check_scale(t: torch.Tensor, name: str, length: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise FormatError(name, "must be a tensor")
    if t.dtype != torch.float16:
        raise FormatError(name, f"must be float16, got {t.dtype}")
    if t.dim() != 1 or t.numel() != length:
        raise FormatError(name, f"must have shape [{length}], got {list(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise FormatError(name, "must be finite (found inf or nan)")


def unpack_signs(packed: torch.Tensor, name: str = "su") -> torch.Tensor:
    """Legacy packed sign field int16 [n/16] -> fp16 [n] of +-1 (bit i of word w is element 16w + i)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int16 or packed.dim() != 1:
        raise FormatError(name, f"legacy sign field must be a 1-D int16 tensor, got "
                          f"{getattr(packed, 'dtype', type(packed).__name__)} {list(getattr(packed, 'shape', []))}")
    words = packed.to(torch.int64) & 0xFFFF
    bits = (words[:, None] >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


def check_marker(value: torch.Tensor, codebook: str, name: str) -> None:
    """A codebook marker is an int32 scalar holding the codebook's multiplier."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int32 or value.numel() != 1:
        raise FormatError(name, "codebook marker must be an int32 scalar")
    if int(value.reshape(-1)[0].item()) & 0xFFFFFFFF != MARKERS[codebook]:
        raise FormatError(name, f"{codebook} marker must hold 0x{MARKERS[codebook]:08X}, "
                          f"got 0x{int(value.reshape(-1)[0].item()) & 0xFFFFFFFF:08X}")


@dataclass(eq=False)
class EXL3Weight(Frozen):
    """A quantized linear y = x @ W + bias with W = diag(suh) Hk W_inner Hn diag(svh), W as [in, out].

    Validated on construction and frozen: `w.replace(suh=...)` makes a validated modified copy (format/frozen.py).
    """

    trellis: torch.Tensor
    suh: torch.Tensor
    svh: torch.Tensor
    codebook: str = "3inst"
    bias: torch.Tensor | None = None
    name: str = "weight"

    def _own_key(self) -> tuple:
        return (tensor_key(self.trellis), tensor_key(self.suh), tensor_key(self.svh), self.codebook,
                tensor_key(self.bias))

    @property
    def K(self) -> float:
        return k_from_last_dim(self.trellis.shape[-1], f"{self.name}.trellis")

    @property
    def in_features(self) -> int:
        return self.trellis.shape[0] * 16

    @property
    def out_features(self) -> int:
        return self.trellis.shape[1] * 16

    @property
    def device(self) -> torch.device:
        return self.trellis.device

    @property
    def trellis_bytes(self) -> int:
        return self.trellis.numel() * 2

    def validate(self) -> None:
        if not isinstance(self.name, str):
            raise FormatError("weight.name", f"must be a str, got {type(self.name).__name__}")
        n = self.name
        t = self.trellis
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int16:
            raise FormatError(f"{n}.trellis", f"must be int16, got {getattr(t, 'dtype', type(t))}")
        if t.dim() != 3:
            raise FormatError(f"{n}.trellis", f"must be 3-D [k/16, n/16, 16K], got shape {list(t.shape)}")
        if t.shape[0] == 0 or t.shape[1] == 0:
            raise FormatError(f"{n}.trellis", f"must not be empty, got shape {list(t.shape)}")
        K = self.K
        check_codebook(self.codebook, f"{n}.codebook")
        if K != int(K) and self.codebook != "mul1":
            raise FormatError(f"{n}.trellis", f"half-integer K={K} needs the mul1 codebook, got {self.codebook}")
        for dim, what in ((self.in_features, "in_features (k)"), (self.out_features, "out_features (n)")):
            if dim % HAD:
                raise FormatError(f"{n}.trellis", f"{what} = {dim} must be a multiple of {HAD} for the Hadamard")
        _check_scale(self.suh, f"{n}.suh", self.in_features)
        _check_scale(self.svh, f"{n}.svh", self.out_features)
        if self.bias is not None:
            _check_scale(self.bias, f"{n}.bias", self.out_features)
        for part in (self.suh, self.svh) + ((self.bias,) if self.bias is not None else ()):
            if part.device != t.device:
                raise FormatError(n, f"all tensors must be on one device; trellis on {t.device}, found {part.device}")

    def inner(self) -> torch.Tensor:
        """W_inner, the decoded rotated-basis weight, fp16 [k, n]."""
        return decode(self.trellis, self.K, self.codebook)

    def dense(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The original-basis weight W [in, out] = diag(suh) Hk W_inner Hn diag(svh), in dtype."""
        w = self.inner().to(dtype)
        w = hadamard_blockwise(w.t()).t()
        w = hadamard_blockwise(w)
        return self.suh.to(dtype)[:, None] * w * self.svh.to(dtype)[None, :]

    def to(self, device: torch.device | str) -> "EXL3Weight":
        move = lambda x: None if x is None else x.to(device)  # noqa: E731
        return EXL3Weight(move(self.trellis), move(self.suh), move(self.svh), self.codebook, move(self.bias), self.name)

    @classmethod
    def from_tensors(cls, tensors: dict, name: str = "weight") -> "EXL3Weight":
        """Build from a checkpoint's stored subkeys: trellis, suh|su, svh|sv, optional mcg|mul1, bias."""
        if "trellis" not in tensors:
            raise FormatError(f"{name}.trellis", "missing")
        present = [cb for cb in MARKERS if cb in tensors]
        if len(present) > 1:
            raise FormatError(name, "both mcg and mul1 markers are present; a tensor has one codebook")
        codebook = present[0] if present else "3inst"
        if present:
            check_marker(tensors[codebook], codebook, f"{name}.{codebook}")
        scales = {}
        for side, legacy in (("suh", "su"), ("svh", "sv")):
            if side in tensors:
                scales[side] = tensors[side]
            elif legacy in tensors:
                scales[side] = unpack_signs(tensors[legacy], f"{name}.{legacy}")
            else:
                raise FormatError(f"{name}.{side}", f"missing (neither {side} nor legacy {legacy} is stored)")
        bias = tensors.get("bias")
        if isinstance(bias, torch.Tensor) and bias.dtype == torch.float32:
            bias = bias.to(torch.float16)
        return cls(tensors["trellis"], scales["suh"], scales["svh"], codebook, bias, name)

    def stored_tensors(self) -> dict:
        """The subkeys a checkpoint stores for this weight (the inverse of from_tensors)."""
        out = {"trellis": self.trellis, "suh": self.suh, "svh": self.svh}
        if self.codebook in MARKERS:
            v = MARKERS[self.codebook]
            out[self.codebook] = torch.tensor(v - (1 << 32) if v >= 1 << 31 else v, dtype=torch.int32)
        if self.bias is not None:
            out["bias"] = self.bias
        return out


__all__ = ["EXL3Weight", "decode", "unpack_signs", "CODEBOOKS"]
