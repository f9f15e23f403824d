"""The fused MoE on plain torch (CPU tensors without the Triton interpreter): the kernels' semantics in fp32, with
the Triton path's powers of two (kernels/row_scale.py): each token's before gate and up, undone before the activation,
and each intermediate row's before down, undone after down's svh."""

from __future__ import annotations

import torch

from ..format.experts import ExpertSet
from ..format.hadamard import hadamard_blockwise_by_rows
from ..kernels.row_scale import fp32_row_scales_torch, row_scales_torch
from ..reference.moe import activate
from .rowwise import matmul_by_rows
from .tables import PROJECTIONS, MoETables

FP32_MAX = torch.finfo(torch.float32).max


def _projection_torch(x32: torch.Tensor, experts: ExpertSet, tables: MoETables, proj: str, e: int,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
    """One projection of expert e in fp32, as the kernels compute it (rotated input rounded to fp16), each row on
    its own (butterfly Hadamards, matmul_by_rows: a token's bytes do not depend on the batch); scales [rows, 1]: the
    powers of two x32's rows were multiplied by, else (down) chosen from the rotated rows' maxima."""
    p = PROJECTIONS.index(proj)
    w = getattr(experts, proj)[e]
    inner = w.inner().float()
    for s, stage in enumerate(experts.stages):
        scale = float(tables.stage_scale[s, p, e])
        if scale != 0.0:
            inner = inner + scale * getattr(stage, proj)[e].inner().float()
    xr = hadamard_blockwise_by_rows(x32 * w.suh.float())
    if scales is None:
        scales = fp32_row_scales_torch(xr)[:, None]
        xr = xr * scales
    y = hadamard_blockwise_by_rows(matmul_by_rows(xr.half().float(), inner)) * w.svh.float() * (1.0 / scales)
    if proj == "down" and tables.bias_down is not None:
        y = y + tables.bias_down[e].float()
    elif proj != "down" and tables.bias_gate_up is not None:
        y = y + tables.bias_gate_up[p, e].float()
    return y


def _expert_torch(x32: torch.Tensor, scales: torch.Tensor, experts: ExpertSet, tables: MoETables,
                  e: int) -> torch.Tensor:
    """Expert e on rows x32 [rows, H] fp32 that were multiplied by their powers of two scales [rows, 1]."""
    up = _projection_torch(x32, experts, tables, "up", e, scales)
    gate = _projection_torch(x32, experts, tables, "gate", e, scales) if experts.gated else None
    if gate is not None:   # an overflowed gate activates as its finite neighbour, as in the kernels
        gate = gate.clamp(-FP32_MAX, FP32_MAX)
    h = activate(gate, up, experts.activation, experts.limit)
    return _projection_torch(h, experts, tables, "down", e)


def moe_torch(hidden: torch.Tensor, plan, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The torch path of a MoEPlan (CPU without the interpreter): the kernels' semantics in fp32, slot-order
    combine."""
    experts, tables = plan.experts, plan.tables
    E = tables.num_experts
    scales = row_scales_torch(hidden, plan.token_scale_bound)[:, None]
    x32 = hidden.float() * scales
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    y = torch.zeros(*ids.shape, tables.hidden_size, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(ids[valid]).tolist():
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        y[tokens, slots] = _expert_torch(x32[tokens], scales[tokens], experts, tables, e)
    weights = torch.where(valid, topk_weights.float(), torch.zeros((), device=hidden.device))
    acc = torch.zeros(hidden.shape[0], tables.hidden_size, dtype=torch.float32, device=hidden.device)
    for j in range(ids.shape[1]):
        acc += weights[:, j, None] * y[:, j]
    if plan.shared is not None:
        acc += _expert_torch(x32, scales, plan.shared, plan.shared_tables, 0)
    return acc
