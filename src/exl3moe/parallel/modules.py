"""nn.Modules of a sharded model: row-parallel linears and routed-expert blocks whose fp32 partial outputs are summed
over a process group (one all-reduce per block output) before the single cast to the activations' dtype."""

from __future__ import annotations

import torch
from torch import nn

from ..hf.moe_dispatch import EXL3MoEByTokens
from ..ops.modules import EXL3Linear
from ..ops.moe_module import EXL3MoE
from ..ops.router import Router
from .experts import all_reduce_sum, local_ids


class RowParallelLinear(nn.Module):
    """A row shard of a linear: its fp32 partial output, summed over `group`, in the input's dtype."""

    def __init__(self, linear: EXL3Linear, group=None):
        super().__init__()
        self.linear, self.group = linear, group

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32, device=x.device)
        self.linear(x, out=partial)
        return all_reduce_sum(partial, self.group).to(x.dtype)


class ReducedMoE(nn.Module):
    """A routed-expert block holding a rank's experts (or expert slices): fp32 partial output summed over `group`."""

    def __init__(self, block: EXL3MoEByTokens, group=None):
        super().__init__()
        self.block, self.group = block, group

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        partial = all_reduce_sum(self.block(hidden), self.group)
        if out is None:
            return partial.to(hidden.dtype)
        return out.copy_(partial)


class ExpertShardRouter(Router):
    """The whole router, its ids renumbered for a shard of experts first..first+count-1 (other ranks' ids become
    `count`, which the kernels skip)."""

    def __init__(self, router: Router, first: int, count: int):
        super().__init__(router.weight, router.top_k, router.kind, router.normalize, router.correction_bias,
                         router.n_group, router.topk_group, router.routed_scaling_factor)
        self.first, self.count = first, count

    @property
    def num_experts(self) -> int:
        return self.count

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = super().forward(hidden)
        return local_ids(ids, self.first, self.count), weights

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.count - 1} of {self.weight.shape[0]}"


def reduced_moe(experts, router: Router, shared, shared_gate, first: int, decode_tokens: int, max_tokens: int,
                group=None) -> ReducedMoE:
    """A rank's block: its experts (ids first.. of the whole router), its shared-expert slice or none, fp32 partials
    summed over `group`; a decode plan and, above decode_tokens, a large-call plan (hf/moe_dispatch.py)."""
    local_router = ExpertShardRouter(router, first, experts.num_experts)
    decode_max = min(decode_tokens, max_tokens)
    make = lambda tokens: EXL3MoE(experts, local_router, shared, shared_gate, tokens, torch.float32)  # noqa: E731
    decode = make(decode_max)
    return ReducedMoE(EXL3MoEByTokens(decode, make(max_tokens) if max_tokens > decode_max else None), group)
