"""Oracle of route packing: per-expert histogram, exclusive offsets and the stable expert-sorted order."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import ContractError


class RoutePack(NamedTuple):
    """counts int64 [E+1] (last = sentinel bucket of ids outside [0, E)), offsets int64 [E+1] (exclusive
    prefix sum of counts: bucket e occupies order[offsets[e] : offsets[e] + counts[e]]), order int64 [T*top_k]
    (flat indices token*top_k + slot, sorted by expert id, ties in flat-index order)."""

    counts: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor


def check_topk_ids(topk_ids: torch.Tensor, name: str = "topk_ids") -> None:
    """topk_ids must be an integer tensor [T, top_k]."""
    if not isinstance(topk_ids, torch.Tensor):
        raise ContractError(name, f"must be a tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise ContractError(name, f"must be an integer tensor, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ContractError(name, f"must be 2-D [tokens, top_k], got shape {list(topk_ids.shape)}")


def bucket_ids(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Flat int64 expert ids with every id outside [0, num_experts) mapped to the sentinel num_experts."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    return torch.where(valid, flat, torch.full_like(flat, num_experts))


def route_pack_reference(topk_ids: torch.Tensor, num_experts: int) -> RoutePack:
    """Histogram, exclusive offsets and stable order of the flat (token*top_k + slot) routing slots."""
    check_topk_ids(topk_ids)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ContractError("num_experts", f"must be a positive int, got {num_experts!r}")
    ids = bucket_ids(topk_ids, num_experts)
    counts = torch.bincount(ids, minlength=num_experts + 1)
    offsets = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)
    return RoutePack(counts, offsets, order)
