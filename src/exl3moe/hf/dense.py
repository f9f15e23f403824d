"""The plain transformers model of an EXL3 checkpoint with every quantized weight dequantized (dense_weight).

The reference for exactness tests (float32) and a same-shape baseline for benchmarks (bf16): transformers'
own modules throughout, experts as its gate_up_proj / down_proj tensors.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..ops.linear import dense_weight
from .architectures import SHARED_EXPERT_CHILDREN, SHARED_GATE_CHILD
from .loader import load_plain_tensors, meta_model, open_supported, rebuild_computed_buffers
from .plan import ROLE_NAMES, LoadPlan, plan_load


def _dense(reader, key: str, dtype: torch.dtype, device) -> torch.Tensor:
    """[out, in] weight of the quantized linear `key` (nn.Linear layout)."""
    return dense_weight(reader.linear(key, device), torch.float32).t().to(dtype=dtype).contiguous()


def _role_key(reader, base: str, role: str) -> str:
    return next(f"{base}.{n}" for n in ROLE_NAMES[role] if f"{base}.{n}.trellis" in reader)


def _fill_linear(module: nn.Linear, reader, key: str, device) -> None:
    dtype = module.weight.dtype
    module.weight = nn.Parameter(_dense(reader, key, dtype, device), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(reader.tensor(f"{key}.bias").to(device=device, dtype=dtype), requires_grad=False)


def _fill_moe(block: nn.Module, reader, prefix: str, device) -> None:
    experts = block.experts
    dtype, E = experts.gate_up_proj.dtype, experts.gate_up_proj.shape[0]
    gate_up, down = [], []
    for e in range(E):
        base = f"{prefix}.experts.{e}"
        gate, up = (_dense(reader, _role_key(reader, base, r), dtype, device) for r in ("gate", "up"))
        gate_up.append(torch.cat([gate, up]))
        down.append(_dense(reader, _role_key(reader, base, "down"), dtype, device))
    experts.gate_up_proj = nn.Parameter(torch.stack(gate_up), requires_grad=False)
    experts.down_proj = nn.Parameter(torch.stack(down), requires_grad=False)
    router = block.gate
    router.weight = nn.Parameter(reader.tensor(f"{prefix}.gate.weight").to(device, router.weight.dtype),
                                 requires_grad=False)
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:
        router.e_score_correction_bias = reader.tensor(f"{prefix}.gate.e_score_correction_bias").to(device, bias.dtype)
    for child in SHARED_EXPERT_CHILDREN:
        shared = getattr(block, child, None)
        if shared is not None:
            for role in ("gate", "up", "down"):
                _fill_linear(getattr(shared, ROLE_NAMES[role][0]), reader, _role_key(reader, f"{prefix}.{child}", role),
                             device)
    gate = getattr(block, SHARED_GATE_CHILD, None)
    if gate is not None:
        gate.weight = nn.Parameter(reader.tensor(f"{prefix}.{SHARED_GATE_CHILD}.weight").to(device, gate.weight.dtype),
                                   requires_grad=False)


def dense_model(path, dtype: torch.dtype = torch.float32, device="cpu",
                attn_implementation: str = "sdpa") -> nn.Module:
    """The transformers model of `path` in `dtype` with dense (dequantized) weights, in eval mode."""
    path = os.fspath(path)
    device = torch.device(device)
    reader = open_supported(path)
    model = meta_model(path, dtype, attn_implementation)
    plan: LoadPlan = plan_load(model, reader, reader.config["model_type"])
    load_plain_tensors(model, plan, device)
    for name, key in plan.linears.items():
        _fill_linear(model.get_submodule(name), reader, key, device)
    for name, prefix in plan.moe_blocks.items():
        _fill_moe(model.get_submodule(name), reader, prefix, device)
    rebuild_computed_buffers(model, device)
    return model.eval().requires_grad_(False)
