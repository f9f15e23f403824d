"""Modules with equal plan layouts share one workspace, and a layer's output bytes do not depend on it."""

import os

import pytest
import torch

from exl3moe.ops.modules import EXL3Linear
from exl3moe.ops.moe_module import EXL3MoE
from exl3moe.ops.router import Router
from helpers import random_experts, random_weight

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
DEVICES = [pytest.param("cpu", marks=interpreted), pytest.param("cuda", marks=pytest.mark.gpu)]


def moe_layer(seed: int, device: str, share: bool = True, H: int = 128, I: int = 128, E: int = 4,
              gated: bool = False) -> EXL3MoE:
    g = torch.Generator().manual_seed(seed)
    experts = random_experts(E, H, I, K=[2, 3, 4, 3][:E], codebook="mcg", generator=g).to(device)
    router = Router(torch.randn(E, H, generator=g).half().to(device), top_k=2)
    if not gated:
        return EXL3MoE(experts, router, max_tokens=16, share_workspace=share)
    shared = random_experts(1, H, 256, K=3, codebook="mul1", generator=g, name="shared").to(device)
    gate = (torch.randn(1, H, generator=g) * 0.2).half().to(device)
    return EXL3MoE(experts, router, shared, gate, max_tokens=16, share_workspace=share)


def workspace_ptrs(module) -> list:
    return [w.data_ptr() for w in module._workspaces]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_moe_layers_share_a_workspace_and_keep_their_bytes(device, gated):
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(1)).half().to(device)
    first, second = moe_layer(1, device, gated=gated), moe_layer(2, device, gated=gated)
    other_shape = moe_layer(3, device, I=256, gated=gated)
    private = moe_layer(1, device, share=False, gated=gated)
    expected = private(x)
    out_first = first(x)
    out_second = second(x)   # overwrites the shared scratch between the two calls of `first`
    out_other = other_shape(x)
    again = first(x)
    assert workspace_ptrs(first) == workspace_ptrs(second)
    assert workspace_ptrs(first) != workspace_ptrs(private)
    assert workspace_ptrs(first)[0] != workspace_ptrs(other_shape)[0]
    assert torch.equal(out_first, expected) and torch.equal(again, expected)
    assert not torch.equal(out_second, expected) and torch.isfinite(out_other.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_linear_layers_share_a_workspace_and_keep_their_bytes(device):
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).half().to(device)
    w1, w2 = (random_weight(256, 512, K, "mcg", generator=torch.Generator().manual_seed(K)).to(device)
              for K in (3, 4))
    first, second, private = EXL3Linear(w1, 16), EXL3Linear(w2, 16), EXL3Linear(w1, 16, share_workspace=False)
    expected = private(x)
    out_first, out_second, again = first(x), second(x), first(x)
    assert first._workspace.data_ptr() == second._workspace.data_ptr() != private._workspace.data_ptr()
    assert torch.equal(out_first, expected) and torch.equal(again, expected)
    assert not torch.equal(out_second, expected)
