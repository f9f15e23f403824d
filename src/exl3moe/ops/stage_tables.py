"""A MoE plan's residual-stage tables rewritten in place: from ResidualStages or from caller-built tables.

Both ways are validated against what the plan compiled (its stage formats, capacity and bias tables), write nothing
when refused, and end in `write_stage_tables`, which copies into the plan's device tables and rewrites its
route-block order. Layout and rules: docs/moe-tables.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ..errors import ContractError
from ..format.codebook import CODEBOOK_ID
from ..format.experts import ExpertSet
from ..kernels.trellis_decode import interpreting
from .stage_limits import residual_codebooks, widest_residual_k2
from .tables import EMPTY_STAGE_K2, MOE_ADDITIVE_ABI_VERSION, _check_tensor, build_tables, outside_stage_range

# The caller-built stage tables of ABI version 1 and their dtypes (each [S, 3, E]).
STAGE_TABLES = {"stage_addr": torch.int64, "stage_k2": torch.int32, "stage_codebook": torch.int32,
                "stage_scale": torch.float32}
BIAS_TABLES = ("bias_gate_up", "bias_down")


def staged_first(stage_scale: torch.Tensor, order: list | None) -> list:
    """`order` (or 0..E-1) with the experts that have a nonzero scale in the stage table (float32 [S, 3, E], as the
    kernels read it) moved first, stably. Route blocks that run base and stages one after the other are the long
    ones, so they start first; with stage blocks, the stage half of the grid starts with the blocks that work and ends
    with those that exit. EXL3MOE_MOE_STAGED_FIRST=0 keeps `order`."""
    active = (stage_scale.detach().cpu() != 0).flatten(0, 1).any(0).tolist()
    order = list(range(len(active))) if order is None else order
    if os.environ.get("EXL3MOE_MOE_STAGED_FIRST", "1") == "0":
        return order
    return sorted(order, key=lambda e: not active[e])


def write_stage_tables(plan, new: dict) -> None:
    """Copy validated tables (name -> tensor of the plan's table shape) into the plan's, in place, then rewrite its
    route-block order from the new scales (route-packed mma.sync plans of stages)."""
    tables = plan.tables
    for field, table in new.items():
        getattr(tables, field).copy_(table)
    if plan.staged_order:
        order = staged_first(tables.stage_scale, plan.base_order)
        plan.expert_order.copy_(torch.tensor(order, dtype=torch.int32))


def stage_set_tables(plan, stages) -> tuple:
    """(the plan's experts with `stages`, their tables for write_stage_tables); ContractError naming `stages` unless
    they fit the plan (load_stages' rules)."""
    if not isinstance(stages, (list, tuple)):
        raise ContractError("stages", f"must be a list of ResidualStage, got {type(stages).__name__}")
    t = plan.tables
    if len(stages) > t.num_stages:
        raise ContractError("stages", f"{len(stages)} stages exceed the plan's capacity of {t.num_stages} "
                            "(moe_plan(..., stage_capacity=...))")
    base = plan.experts
    swapped = ExpertSet(base.gate, base.up, base.down, base.activation, base.limit, list(stages), base.name)
    new = build_tables(swapped, stage_capacity=t.num_stages)
    widest = widest_residual_k2(stages)
    if widest > plan.stage_max_k2:
        raise ContractError("stages", f"a residual of K={widest / 2:g} is wider than the plan allows "
                            f"(K={plan.stage_max_k2 / 2:g}; moe_plan(..., max_stage_bits=...))")
    outside = residual_codebooks(stages) - set(plan.stage_codebooks)
    if outside:
        raise ContractError("stages", f"residual codebooks {sorted(outside)} are outside the plan's "
                            f"{list(plan.stage_codebooks)} (moe_plan(..., stage_codebooks=...))")
    for field in BIAS_TABLES:
        if (getattr(new, field) is None) != (getattr(t, field) is None):
            raise ContractError(f"stages.{field}", "residual biases must match the plan's bias tables "
                                "(present in both or in neither)")
    fields = [*STAGE_TABLES, *(f for f in BIAS_TABLES if getattr(t, f) is not None)]
    return swapped, {field: getattr(new, field) for field in fields}


def _refuse_where(mask: torch.Tensor, field: str, rule: str) -> None:
    """ContractError naming the first entry of `field` where `mask` holds, e.g. stage_k2[1, 2, 17]."""
    hits = mask.nonzero()
    if len(hits):
        raise ContractError(f"{field}[{', '.join(str(i) for i in hits[0].tolist())}]", rule)


def _check_entries(plan, addr, k2, codebook, scale) -> None:
    """Every entry of nonzero scale in the plan's range and formats, with a pointer (CPU tables [S, 3, E])."""
    _refuse_where(~torch.isfinite(scale), "stage_scale", "must be finite")
    active = scale != 0
    _refuse_where(outside_stage_range(scale), "stage_scale",
                  "must be 0 or within [2^-40, 2^40] in magnitude (kernels divide by it)")
    if not plan.tables.gated:
        _refuse_where(active[:, :1], "stage_scale", "must be 0 on the gate (p = 0): the experts have no gate")
    _refuse_where(active & (addr == 0), "stage_addr", "must be nonzero where the scale is nonzero")
    _refuse_where(active & (addr < 0), "stage_addr", "must not be negative (a data_ptr()) where the scale is nonzero")
    _refuse_where(active & (addr % 4 != 0), "stage_addr", "must be 4-byte aligned (kernels read int32 words)")
    _refuse_where(active & ~torch.isin(codebook, torch.tensor(sorted(CODEBOOK_ID.values()), dtype=torch.int32)),
                  "stage_codebook", "must be 0 (3inst), 1 (mcg) or 2 (mul1)")
    _refuse_where(active & ((k2 < 2) | (k2 > 16)), "stage_k2", "must be a 2K in 2..16")
    _refuse_where(active & (k2 % 2 == 1) & (codebook != CODEBOOK_ID["mul1"]), "stage_k2",
                  "a half-integer K (odd 2K) needs the mul1 codebook (2)")
    allowed = torch.tensor([CODEBOOK_ID[name] for name in plan.stage_codebooks], dtype=torch.int32)
    _refuse_where(active & ~torch.isin(codebook, allowed), "stage_codebook",
                  f"is outside the plan's stage codebooks {list(plan.stage_codebooks)} "
                  "(moe_plan(..., stage_codebooks=...))")
    formats = torch.tensor(plan.stage_formats or [(0, -1)], dtype=torch.int32)
    compiled = ((k2[..., None] == formats[:, 0]) & (codebook[..., None] == formats[:, 1])).any(-1)
    _refuse_where(active & ~compiled, "stage_k2", f"(2K, codebook) must be one of the plan's compiled stage formats "
                  f"{plan.stage_formats} (moe_plan(..., stage_capacity=..., max_stage_bits=...))")


def _check_table(table, field: str, dtype: torch.dtype, device: torch.device) -> None:
    """A dense (strided, not nested) contiguous tensor of `dtype` on `device`: what copy_ into a plan table reads."""
    if isinstance(table, torch.Tensor) and (table.layout != torch.strided or table.is_nested):
        raise ContractError(field, f"must be a dense strided tensor, got layout {table.layout}"
                            f"{' (nested)' if table.is_nested else ''}")
    _check_tensor(table, field, dtype, device)


def _check_bias(plan, tables: Mapping, field: str) -> torch.Tensor:
    """A caller's bias table of the plan's shape, float32 and finite, as a private copy (no autograd history, no
    memory shared with the plan's); only where the plan has that table."""
    t = plan.tables
    if getattr(t, field) is None:
        raise ContractError(field, "the plan has no bias table to rewrite (its experts and stages have no biases)")
    table = tables[field]
    _check_table(table, field, torch.float32, plan.device)
    shape = tuple(getattr(t, field).shape)
    if tuple(table.shape) != shape:
        raise ContractError(field, f"must have shape {list(shape)}, got {list(table.shape)}")
    if not bool(torch.isfinite(table).all()):
        raise ContractError(field, "must be finite")
    return table.detach().clone()


def caller_stage_tables(plan, tables, abi_version) -> dict:
    """Caller-built stage tables checked against the plan, as write_stage_tables takes them (entries of zero scale
    written empty, as build_tables writes them); ContractError naming the field (and entry) otherwise. Syncs."""
    if isinstance(abi_version, bool) or not isinstance(abi_version, int) or abi_version != MOE_ADDITIVE_ABI_VERSION:
        raise ContractError("abi_version", f"must be exactly {MOE_ADDITIVE_ABI_VERSION}: this library reads no other "
                            f"table layout, got {abi_version!r}")
    if not (plan.device.type == "cuda" or interpreting()):
        raise ContractError("tables", "caller-built tables need the kernels (a CUDA plan, or TRITON_INTERPRET=1): "
                            "the torch path reads ExpertSet weights, not addresses")
    if not isinstance(tables, Mapping):
        raise ContractError("tables", f"must be a mapping of table name to tensor, got {type(tables).__name__}")
    for field in tables:
        if field not in STAGE_TABLES and field not in BIAS_TABLES:
            raise ContractError(str(field), f"is not a stage table of ABI version {MOE_ADDITIVE_ABI_VERSION} "
                                f"(expected {', '.join(STAGE_TABLES)}, optionally {', '.join(BIAS_TABLES)})")
    shape = tuple(plan.tables.stage_scale.shape)   # [S, 3, E], S at least 1
    host = {}
    for field, dtype in STAGE_TABLES.items():
        if field not in tables:
            raise ContractError(field, f"is missing: a {dtype} [{shape[0]}, 3, {shape[2]}] table is required")
        table = tables[field]
        _check_table(table, field, dtype, plan.device)
        if tuple(table.shape) != shape:
            raise ContractError(field, f"must have shape {list(shape)} (the plan's [S, 3, E]), got {list(table.shape)}")
        host[field] = table.detach().cpu()
    _check_entries(plan, host["stage_addr"], host["stage_k2"], host["stage_codebook"], host["stage_scale"])
    biases = {field: _check_bias(plan, tables, field) for field in BIAS_TABLES if field in tables}
    active = host["stage_scale"] != 0
    return {"stage_addr": torch.where(active, host["stage_addr"], 0),
            "stage_k2": torch.where(active, host["stage_k2"], EMPTY_STAGE_K2),
            "stage_codebook": torch.where(active, host["stage_codebook"], 0),
            "stage_scale": torch.where(active, host["stage_scale"], 0.0), **biases}
