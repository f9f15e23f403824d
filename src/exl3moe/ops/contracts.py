"""Checks shared by the ops: matrices, outputs, workspaces and weights that changed after a plan was made.

Each refusal is a ContractError naming the tensor and the one rule that failed (row count, column count,
column stride, overlapping rows, dtype, alignment, ...), raised before anything reaches the device.
"""

from __future__ import annotations

import torch

from ..errors import ContractError

WORKSPACE_ALIGN = 16   # the kernels' vector loads and TMA boxes over workspace entries need 16-byte addresses


def check_matrix(t: torch.Tensor, name: str, rows: int | None, cols: int, rows_are: str, cols_are: str,
                 layout: str) -> None:
    """t is a 2-D [rows, cols] tensor (rows None: any count) with unit column stride; layout "rows" allows any row
    stride, "disjoint" one of at least `cols` (rows that do not overlap), "contiguous" exactly `cols`. rows_are /
    cols_are say where the expected counts come from (e.g. "hidden's tokens")."""
    if t.dim() != 2:
        raise ContractError(name, f"must be 2-D [{'rows' if rows is None else rows}, {cols}], got shape "
                            f"{list(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ContractError(name, f"row count must be {rows} ({rows_are}), got {t.shape[0]}")
    if t.shape[1] != cols:
        raise ContractError(name, f"column count must be {cols} ({cols_are}), got {t.shape[1]}")
    if cols > 1 and t.stride(1) != 1:
        raise ContractError(name, f"columns must be contiguous (column stride 1), got strides {list(t.stride())}")
    many = t.shape[0] > 1
    if many and layout != "rows" and t.stride(0) < cols:
        raise ContractError(name, f"rows overlap: row stride {t.stride(0)} is below the row length {cols}")
    if many and layout == "contiguous" and t.stride(0) != cols:
        raise ContractError(name, f"must be contiguous: row stride must be {cols}, got {t.stride(0)}")


def check_packed(t: torch.Tensor, name: str) -> None:
    """t (any shape) is contiguous; otherwise the rule it breaks: last-dim stride, overlapping rows, or gaps."""
    if t.is_contiguous():
        return
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ContractError(name, f"must be contiguous: last-dim stride must be 1, got strides {list(t.stride())}")
    if t.dim() > 1 and any(t.stride(d) < t.shape[-1] for d in range(t.dim() - 1) if t.shape[d] > 1):
        raise ContractError(name, f"rows overlap: strides {list(t.stride())} for shape {list(t.shape)} put rows "
                            f"less than a row length ({t.shape[-1]}) apart")
    raise ContractError(name, f"must be contiguous (rows back to back), got strides {list(t.stride())} for shape "
                        f"{list(t.shape)}")


def check_workspace(workspace: torch.Tensor, nbytes: int, device: torch.device, owner: str) -> None:
    """A workspace is a 1-D, contiguous uint8 tensor of at least nbytes on device, at a WORKSPACE_ALIGN address."""
    if not isinstance(workspace, torch.Tensor):
        raise ContractError("workspace", f"must be a 1-D uint8 tensor, got {type(workspace).__name__}")
    if workspace.dtype != torch.uint8:
        raise ContractError("workspace", f"dtype must be uint8, got {workspace.dtype}")
    if workspace.dim() != 1:
        raise ContractError("workspace", f"must be a 1-D uint8 tensor, got shape {list(workspace.shape)}")
    if workspace.numel() > 1 and workspace.stride(0) != 1:
        raise ContractError("workspace", f"must be contiguous (stride 1), got stride {workspace.stride(0)}")
    if workspace.numel() < nbytes:
        raise ContractError("workspace", f"needs {nbytes} bytes, got {workspace.numel()}")
    if workspace.device != device:
        raise ContractError("workspace", f"is on {workspace.device}, {owner} on {device}")
    if workspace.data_ptr() % WORKSPACE_ALIGN:
        raise ContractError("workspace", f"must start at a {WORKSPACE_ALIGN}-byte aligned address, got one "
                            f"{workspace.data_ptr() % WORKSPACE_ALIGN} bytes past")


def weights_key(*expert_sets) -> tuple:
    """The fingerprints of the sets' base weights (the ones a plan's tables point at); None sets are skipped."""
    return tuple(w.fingerprint() for s in expert_sets if s is not None for ws in s.projections().values() for w in ws)


def check_weights_unchanged(planned: tuple, *expert_sets) -> None:
    """ContractError unless the sets' base weights are those a plan's tables were built from."""
    if weights_key(*expert_sets) != planned:
        raise ContractError("experts", "a weight changed after the plan was made (its tables hold the old tensors' "
                            "addresses): make a new plan")
