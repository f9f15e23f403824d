"""Routed experts over several ranks: expert parallelism (each rank holds whole experts) and tensor parallelism
(each rank holds a slice of every expert's intermediate width). A rank's output is a partial sum: the caller's
all-reduce (`all_reduce_sum`) over its process group gives the layer's output."""

from __future__ import annotations

import torch

from ..errors import ContractError
from ..format.experts import ExpertSet
from ..format.shards import shard_range
from .split import block_ranges, column_shard, row_shard


def expert_range(num_experts: int, rank: int, world: int) -> tuple:
    """(first, stop): rank `rank`'s contiguous experts; the first `num_experts % world` ranks hold one more."""
    return shard_range(num_experts, rank, world, "experts", "experts")


def _no_stages(experts: ExpertSet) -> None:
    if not isinstance(experts, ExpertSet):
        raise ContractError("experts", f"must be an ExpertSet, got {type(experts).__name__}")
    if experts.stages:
        raise ContractError(f"{experts.name}.stages", "residual stages are not sharded yet: shard the base alone")


def expert_shard(experts: ExpertSet, rank: int, world: int) -> ExpertSet:
    """Rank `rank`'s experts, whole; route with `local_ids` so that other ranks' ids contribute nothing here."""
    _no_stages(experts)
    first, stop = expert_range(experts.num_experts, rank, world)
    pick = lambda ws: None if ws is None else list(ws[first:stop])  # noqa: E731
    return experts.replace(gate=pick(experts.gate), up=pick(experts.up), down=pick(experts.down),
                           name=f"{experts.name}[experts {first}:{stop}]", layer_experts=experts.planned_experts)


def local_ids(topk_ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """topk_ids in the numbering of a shard holding experts first..first+count-1; every other id becomes `count`,
    an id outside the shard, which the kernels skip (no host sync: capturable)."""
    local = topk_ids - first
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))


def tensor_shard(experts: ExpertSet, rank: int, world: int) -> ExpertSet:
    """Rank `rank`'s slice of every expert's intermediate width: gate / up by columns, down by rows (whole 128-wide
    blocks, the same slice for every expert; down's bias on rank 0)."""
    _no_stages(experts)
    block_ranges(experts.intermediate_size // 128, world, f"{experts.name} intermediate")
    cols = lambda ws: None if ws is None else [column_shard(w, rank, world) for w in ws]  # noqa: E731
    return experts.replace(gate=cols(experts.gate), up=cols(experts.up),
                           down=[row_shard(w, rank, world) for w in experts.down],
                           name=f"{experts.name}[tensor {rank}/{world}]",
                           layer_intermediate=experts.planned_intermediate)


def all_reduce_sum(partial: torch.Tensor, group=None) -> torch.Tensor:
    """The layer's output from each rank's partial output (in place; torch.distributed's default group if None)."""
    import torch.distributed as dist

    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial
