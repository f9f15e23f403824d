"""nn.Modules over the ops: EXL3Linear (and the MoE module in ops/moe_module.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..format.weight import EXL3Weight
from .linear import LinearPlan, check_input, check_output, check_weight
from .workspaces import workspace_for


class EXL3Linear(nn.Module):
    """y = x @ W + bias for an EXL3 weight, with a workspace for calls of up to `max_rows` rows (shared with
    every module of the same plan layout unless share_workspace=False); pass `out` to make a call allocate
    nothing (CUDA-graph capture)."""

    def __init__(self, weight: EXL3Weight, max_rows: int = 128, share_workspace: bool = True):
        super().__init__()
        self.weight = weight
        self.max_rows = max_rows
        self.share_workspace = bool(share_workspace)
        self._plan = LinearPlan(weight, max_rows)
        self._runner = None

    @classmethod
    def from_checkpoint(cls, reader, key: str, device: torch.device | str | None = None, max_rows: int = 128):
        weight = reader.linear(key)
        return cls(weight.to(device) if device is not None else weight, max_rows)

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def _runner_for(self, rows: int, key: tuple):
        """The runner for calls of `rows`, planned again for more rows or for a weight that is not the plan's (the
        attribute reassigned, or its tensors changed since: `key` is its fingerprint from check_weight)."""
        if rows > self._plan.max_rows or self._plan.weight is not self.weight or self._plan.weight_key != key:
            self._plan = LinearPlan(self.weight, max(rows, self._plan.max_rows))
            self._runner = None
        if self._runner is None:
            self._workspace = workspace_for(self._plan, self.share_workspace)
            self._runner = self._plan.bind(self._workspace)
        return self._runner

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        key = check_weight(self.weight)
        x2 = check_input(x, self.weight)
        rows = x2.shape[0]
        if out is None:
            out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        out2 = check_output(out, rows, self.weight, tuple(x.shape[:-1]))   # before the first call binds the workspace
        return self._runner_for(max(rows, 1), key).run_checked(x, x2, out, out2)

    def extra_repr(self) -> str:
        w = self.weight
        return f"in={w.in_features}, out={w.out_features}, K={w.K}, codebook={w.codebook}, bias={w.bias is not None}"
