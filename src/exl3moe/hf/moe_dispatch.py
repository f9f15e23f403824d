"""A routed-expert block with two plans over the same weights: one for decode steps, one for larger calls.

An EXL3MoE plan's tiles, splits and route blocks follow its max_tokens, so a plan made for a 2048-token
prefill is a poor one for an 8-token decode step (and a decode plan would re-plan and allocate on a prefill).
The decode plan serves every call of up to `decode_tokens` tokens, so a sequence's bytes do not depend on the
batch size within it; the experts, router and shared expert are one set of tensors shared by both.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.moe_module import EXL3MoE


class EXL3MoEByTokens(nn.Module):
    """forward(hidden [..., H]) through `decode` (calls of up to decode.max_tokens tokens) or `prefill`."""

    def __init__(self, decode: EXL3MoE, prefill: EXL3MoE | None = None):
        super().__init__()
        self.decode, self.prefill = decode, prefill

    @classmethod
    def from_checkpoint(cls, reader, prefix: str, device, decode_tokens: int, max_tokens: int) -> "EXL3MoEByTokens":
        decode = EXL3MoE.from_checkpoint(reader, prefix, device, max_tokens=min(decode_tokens, max_tokens))
        if max_tokens <= decode_tokens:
            return cls(decode)
        prefill = EXL3MoE(decode.experts, decode.router, decode.shared, decode.shared_gate, max_tokens)
        return cls(decode, prefill)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        tokens = hidden.numel() // max(1, hidden.shape[-1])
        small = self.prefill is None or tokens <= self.decode.max_tokens
        return (self.decode if small else self.prefill)(hidden, out)
