"""exl3moe stages: residuals of a target on an EXL3 base, each stage lowering the layer's error; the stage file read
back as ResidualStages that MoEPlan.load_stages takes and that the float64 oracle evaluates to the target."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from convert_models import FAST_ENCODE, tiny_config
from exl3moe.convert.stages import make_stages, read_stages
from exl3moe.format.checkpoint import open_checkpoint
from exl3moe.hf.synthetic import write_synthetic_checkpoint
from exl3moe.ops.moe import moe_plan
from exl3moe.reference.moe import moe as moe_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PREFIX = "model.layers.0.mlp"


@pytest.fixture(scope="module")
def staged(tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("stages")
    base, target = str(root / "base"), str(root / "target")
    config = write_synthetic_checkpoint(base, tiny_config())
    reader = open_checkpoint(base)
    g = torch.Generator().manual_seed(7)
    tensors, want = {}, {}
    for role in ("gate_proj", "up_proj", "down_proj"):
        for e in range(2):
            key = f"{PREFIX}.experts.{e}.{role}"
            W = reader.linear(key).dense(torch.float32)
            if e == 0:   # expert 1 keeps the base's weights: a negligible residual, skipped
                W = W + 0.1 * W.std() * torch.randn(W.shape, generator=g)
            want[key] = W
            tensors[f"{key}.weight"] = W.T.contiguous()
    os.makedirs(target)
    save_file(tensors, os.path.join(target, "model.safetensors"))
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump({k: v for k, v in config.items() if k != "quantization_config"}, f)
    out = str(root / "stages.safetensors")
    errors = make_stages(base, target, out, stage_bits=2, stages=2, device="cpu", **FAST_ENCODE)
    return {"base": base, "out": out, "errors": errors[PREFIX], "want": want}


def test_each_stage_lowers_the_layer_error(staged):
    before, one, two = staged["errors"]
    print(f"relative weight error: {before:.4g} -> {one:.4g} (1 stage) -> {two:.4g} (2 stages)")
    assert 0 < two < one < 0.6 * before


def test_stage_file_loads_into_a_plan_and_matches_the_target(staged):
    experts = open_checkpoint(staged["base"]).experts(PREFIX)
    stages = read_stages(staged["out"], PREFIX, experts)
    assert len(stages) == 2
    for stage in stages:
        assert all(r is None for r in stage.up[1:]) and float(stage.scales[1].abs().sum()) == 0
        assert stage.up[0].suh is experts.up[0].suh
    plan = moe_plan(experts, 8, 1, stage_capacity=2, max_stage_bits=2)
    plan.load_stages(stages)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    ids = torch.zeros(8, 1, dtype=torch.int64)
    weights = torch.ones(8, 1, dtype=torch.float32)
    staged_out = moe_reference(x, experts, ids, weights, stages=stages)
    base_out = moe_reference(x, experts, ids, weights)
    w = staged["want"]
    h = torch.nn.functional.silu(x.double() @ w[f"{PREFIX}.experts.0.gate_proj"].double()) * \
        (x.double() @ w[f"{PREFIX}.experts.0.up_proj"].double())
    target = h @ w[f"{PREFIX}.experts.0.down_proj"].double()
    err = lambda y: float((y.double() - target).norm() / target.norm())  # noqa: E731
    assert err(staged_out) < 0.6 * err(base_out)
