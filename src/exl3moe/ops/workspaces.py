"""Workspaces shared by the modules (EXL3Linear, EXL3MoE) whose plans have one layout on one device.

Layers of a model run one after another on one stream, and every run leaves its arrival counters at zero, so
plans with equal layouts can bind the same bytes: scratch stays one layer's, not one per layer. The same holds
for a module's own scratch of one (device, purpose, shape). A module made with share_workspace=False allocates
its own (for calls on concurrent streams).
"""

from __future__ import annotations

import weakref

import torch

# key -> the buffer every module asking for that key binds; alive while a module holds it.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_buffer(key: tuple, allocate, share: bool = True) -> torch.Tensor:
    """The buffer shared under `key` (made by allocate() for the first caller), or a private one."""
    if not share:
        return allocate()
    buffer = _SHARED.get(key)
    if buffer is None:
        buffer = _SHARED[key] = allocate()
    return buffer


def workspace_for(plan, share: bool) -> torch.Tensor:
    """The workspace shared by plans of this layout on this device, or a private one."""
    return shared_buffer((str(plan.device), plan.workspace_layout), plan.allocate, share)
