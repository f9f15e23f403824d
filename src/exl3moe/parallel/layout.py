"""Where a rank sits in a TP x EP world: rank = ep_rank * tp + tp_rank, so a tensor-parallel group is `tp` adjacent
ranks; attention and dense MLPs reduce over the rank's TP group, routed-expert blocks over the whole group."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ContractError


@dataclass(frozen=True)
class ParallelLayout:
    """tp x ep ranks; `group` is the whole process group (None: torch.distributed's default), `tp_group` the rank's
    tensor-parallel peers (None when tp == 1)."""

    tp: int
    ep: int
    rank: int
    group: object = None
    tp_group: object = None

    @property
    def world(self) -> int:
        return self.tp * self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.tp


def check_degrees(tp, ep) -> None:
    for name, value in (("tp", tp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ContractError(name, f"must be a positive int, got {value!r}")


def make_layout(tp: int, ep: int, group=None) -> ParallelLayout:
    """The layout of this process in `group` (default: the default group), creating the TP subgroups; every rank of
    the group must call it, in the same order as its other collectives."""
    import torch.distributed as dist

    check_degrees(tp, ep)
    if not dist.is_available() or not dist.is_initialized():
        raise ContractError("tp", "tp / ep need an initialized torch.distributed process group (run under torchrun, "
                            "or call torch.distributed.init_process_group first)")
    world = dist.get_world_size(group)
    if world != tp * ep:
        raise ContractError("tp", f"tp {tp} x ep {ep} = {tp * ep} ranks, the process group has {world}")
    rank = dist.get_rank(group)
    tp_group = None
    if tp > 1:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        for e in range(ep):
            members = ranks[e * tp:(e + 1) * tp]
            made = group if ep == 1 else dist.new_group(members)
            if e == rank // tp:
                tp_group = made
    return ParallelLayout(tp, ep, rank, group, tp_group)
