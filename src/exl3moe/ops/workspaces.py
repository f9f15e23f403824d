"""Workspaces shared by the modules (EXL3Linear, EXL3MoE) whose plans have one layout on one device.

Layers of a model run one after another on one stream, and every run leaves its arrival counters at zero, so
plans with equal layouts can bind the same bytes: scratch stays one layer's, not one per layer. A module made
with share_workspace=False binds its own (for calls on concurrent streams).
"""

from __future__ import annotations

import weakref

import torch

# (device, layout) -> the workspace the plans of that layout bind; alive while a runner's module holds it.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def workspace_for(plan, share: bool) -> torch.Tensor:
    """The workspace shared by plans of this layout on this device (allocated by the first), or a private one."""
    if not share:
        return plan.allocate()
    key = (str(plan.device), plan.workspace_layout)
    workspace = _SHARED.get(key)
    if workspace is None:
        workspace = _SHARED[key] = plan.allocate()
    return workspace
