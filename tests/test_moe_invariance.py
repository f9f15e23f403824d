"""A token's MoE output bytes under the Triton interpreter and on the torch path, whatever call it is in: calls of any
size (each planned for itself), skewed routings, mixed widths and codebooks, a shared expert, every output dtype."""

import pytest
import torch

from exl3moe.ops import fused_experts
from helpers import random_experts

E, H, I, TOP_K, FULL = 8, 256, 128, 2, 32
TOKENS = [1, 2, 3, 17]


def routing(T, skew, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if skew == "one expert":
        logits[:, 0] += 100.0
    elif skew == "half empty":
        logits[:, E // 2:] -= 100.0
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, -1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("skew,shared,dtype,target", [("random", False, torch.float16, None),
                                                      ("one expert", True, torch.float32, None),
                                                      ("half empty", False, torch.bfloat16, 16)])
def test_token_bytes_do_not_depend_on_the_call(skew, shared, dtype, target, monkeypatch, kernel_path):
    """target: a smaller gate/up program target, under which splits planned from a call's size would differ."""
    if target is not None:
        monkeypatch.setattr("exl3moe.ops.moe_planning.SPLIT_TARGET_PROGRAMS", target)
    g = torch.Generator().manual_seed(31)
    experts = random_experts(E, H, I, K=[4, 3, 2.5, 2] * 2, codebook=["mcg", "3inst", "mul1", "mcg"] * 2, generator=g)
    shared_expert = random_experts(1, H, I, K=4, codebook="mcg", generator=g, name="shared") if shared else None
    hidden = (torch.randn(FULL, H, generator=g) * 0.5).half()
    ids, weights = routing(FULL, skew, 32)
    full = fused_experts(hidden, experts, ids, weights, shared=shared_expert, out_dtype=dtype)
    for T in TOKENS:
        part = fused_experts(hidden[:T], experts, ids[:T], weights[:T], shared=shared_expert, out_dtype=dtype)
        assert torch.equal(part, full[:T]), T
    tail = fused_experts(hidden[-5:], experts, ids[-5:], weights[-5:], shared=shared_expert, out_dtype=dtype)
    assert torch.equal(tail, full[-5:])
