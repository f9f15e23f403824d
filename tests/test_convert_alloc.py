"""Per-expert widths: within the budget, never worse than uniform on the proxy, and on a MoE block whose routing is
skewed, at least 10 % lower output error than uniform widths at the same trellis bytes (real encodings)."""

import pytest
import torch

from convert_models import FAST_ENCODE, tiny_config
from exl3moe.convert import allocate_widths, relative_error, widths_for
from exl3moe.convert.allocate import predicted_error
from exl3moe.convert.calibration import LayerCalibration
from exl3moe.errors import ContractError
from exl3moe.hf.synthetic import synthetic_model_config
from exl3moe.quant import quantize_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bits(K, sizes):
    n = torch.broadcast_to(sizes, K.shape).double()
    return float((K * n).sum() / n.sum())


@pytest.mark.parametrize("codebook,budget", [("mcg", 3), ("mcg", 4.4), ("mul1", 2.5), ("mul1", 3.25), ("3inst", 8)])
def test_allocation_within_budget_and_no_worse_than_uniform(codebook, budget):
    g = torch.Generator().manual_seed(1)
    importance = torch.rand(16, 3, generator=g, dtype=torch.float64) ** 4 * 100
    sizes = torch.tensor([2048 * 768, 2048 * 768, 768 * 2048], dtype=torch.float64)
    K = allocate_widths(importance, sizes, budget, codebook)
    assert _bits(K, sizes) <= budget + 1e-9
    assert set(K.flatten().tolist()) <= set(widths_for(codebook))
    uniform = max(k for k in widths_for(codebook) if k <= budget)
    assert predicted_error(importance, K) <= predicted_error(importance, torch.full_like(K, uniform)) * (1 + 1e-12)


def test_half_widths_only_with_mul1():
    assert widths_for("mcg") == (2, 3, 4, 5, 6, 8) and widths_for("mul1") == (2, 2.5, 3, 3.5, 4, 5, 6, 8)
    skewed = torch.tensor([[100.0, 100.0, 100.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    K = allocate_widths(skewed, torch.ones(3), 3, "mul1")
    assert K[0, 0] > K[1, 0]
    with pytest.raises(ContractError, match="expert_bits"):
        allocate_widths(skewed, torch.ones(3), 1.5, "mcg")
    assert relative_error(2) > relative_error(2.5) > relative_error(3)


def _skewed_block(offset: float = 1.0):
    """A qwen3_moe MoE block (2 experts, top-1) whose router sends about 85 % of the tokens to expert 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    full, _ = synthetic_model_config(tiny_config())
    rest = {k: v for k, v in full.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(3)
    block = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **rest)).model.layers[0].mlp.float()
    for p in (block.experts.gate_up_proj, block.experts.down_proj):
        p.data.normal_(0, 128 ** -0.5)
    direction = torch.randn(128)
    block.gate.weight.data = torch.stack([direction, -direction]) * 0.05
    g = torch.Generator().manual_seed(4)
    tokens = torch.randn(1536, 128, generator=g) + offset * direction / direction.norm()
    return block, tokens[:1024], tokens[1024:]


def _encode_block(block, cal, K):
    """Copy of the block's experts with every (expert, projection) encoded at K[e, p]; decoded weights in place."""
    experts = block.experts
    inter = experts.gate_up_proj.shape[1] // 2
    gate_up, down = experts.gate_up_proj.data.clone(), experts.down_proj.data.clone()
    views = {0: lambda e: gate_up[e, :inter], 1: lambda e: gate_up[e, inter:], 2: lambda e: down[e]}
    for p in range(3):
        for e in range(K.shape[0]):
            H = cal.hessians(e, 32)[0 if p < 2 else 1]
            (w, _), = quantize_weights([views[p](e).T], [H], float(K[e, p]), "mcg", 10 * e + p, **FAST_ENCODE)
            views[p](e).copy_(w.dense(torch.float32).T)
    return gate_up, down


def test_allocated_widths_beat_uniform_by_10_percent_on_skewed_routing():
    block, calib, held_out = _skewed_block()
    cal = LayerCalibration(block, "cpu").experts[""]
    with torch.no_grad():
        block(calib[None])
    share = float(cal.tokens[0]) / float(cal.tokens.sum())
    assert 0.75 < share < 0.98
    sizes = torch.full((3,), 128.0 * 128)
    K = allocate_widths(cal.importance, sizes, 3, "mcg")
    uniform = torch.full_like(K, 3.0)
    assert _bits(K, sizes) <= 3 and not torch.equal(K, uniform)
    with torch.no_grad():
        want = block(held_out[None])
        errors = {}
        for label, widths in (("uniform", uniform), ("allocated", K)):
            original = block.experts.gate_up_proj.data.clone(), block.experts.down_proj.data.clone()
            block.experts.gate_up_proj.data, block.experts.down_proj.data = _encode_block(block, cal, widths)
            errors[label] = float((block(held_out[None]) - want).norm() / want.norm())
            block.experts.gate_up_proj.data, block.experts.down_proj.data = original
    print(f"expert 0 share {share:.2f}, widths {K.tolist()}, MoE output rel. L2: {errors}")
    assert errors["allocated"] <= 0.9 * errors["uniform"]
