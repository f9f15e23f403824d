"""EXL3MoE and the routers: the tiny Qwen3-MoE fixture, float64 routing references, configs, the shared gate."""

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from exl3moe import ContractError, FormatError, open_checkpoint
from exl3moe.ops.moe_module import EXL3MoE, activation_from_config
from exl3moe.ops.router import Router, router_logits, sigmoid_topk, softmax_topk
from exl3moe.reference import moe
from helpers import random_experts

CHECKPOINT = "tiny_qwen3_moe_exl3"
OUTPUTS = "tiny_qwen3_moe_exl3_moe_outputs.safetensors"
PREFIX = "model.layers.{}.mlp"

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="CPU kernel tests run under TRITON_INTERPRET=1")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    return float((actual.to(torch.float64) - expected).norm() / expected.norm())


def softmax_topk_reference(logits: torch.Tensor, top_k: int, normalize: bool):
    """Float64, token by token: softmax, the k largest (ties to the lower id), renormalised."""
    ids, weights = [], []
    for row in logits.tolist():
        peak = max(row)
        exps = [math.exp(v - peak) for v in row]
        probs = [v / sum(exps) for v in exps]
        chosen = sorted(range(len(row)), key=lambda e: (-probs[e], e))[:top_k]
        w = [probs[e] for e in chosen]
        ids.append(chosen)
        weights.append([v / sum(w) for v in w] if normalize else w)
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


def sigmoid_topk_reference(logits, top_k, bias=None, n_group=1, topk_group=1, scale=1.0, normalize=True):
    """Float64, token by token, DeepSeek-V3's rule: grouped selection on biased scores, unbiased weights."""
    E = logits.shape[1]
    bias = [0.0] * E if bias is None else bias.tolist()
    size = E // n_group
    ids, weights = [], []
    for row in logits.tolist():
        scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        biased = [s + b for s, b in zip(scores, bias)]
        members = [list(range(g * size, (g + 1) * size)) for g in range(n_group)]
        group_score = [sum(sorted((biased[e] for e in m), reverse=True)[:2]) for m in members]
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group] if n_group > 1 else [0]
        candidates = [e for g in kept for e in members[g]]
        chosen = sorted(candidates, key=lambda e: (-biased[e], e))[:top_k]
        w = [scores[e] for e in chosen]
        total = sum(w) if normalize else 1.0
        ids.append(chosen)
        weights.append([v / total * scale for v in w])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


def random_logits(T: int, E: int, seed: int) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2


def assert_routing(actual, expected) -> None:
    ids, weights = actual
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), expected[0])
    assert (weights.double() - expected[1]).abs().max() < 1e-6


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("E,top_k", [(16, 4), (64, 8), (8, 1)])
def test_softmax_topk_matches_float64(E, top_k, normalize):
    logits = random_logits(40, E, seed=E + top_k)
    assert_routing(softmax_topk(logits, top_k, normalize), softmax_topk_reference(logits, top_k, normalize))


@pytest.mark.parametrize("n_group,topk_group,normalize,scale",
                         [(1, 1, True, 1.0), (4, 2, True, 2.5), (8, 3, False, 1.0), (8, 4, True, 1.8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sigmoid_topk_matches_float64(n_group, topk_group, normalize, scale, with_bias):
    E, top_k = 64, 6
    logits = random_logits(48, E, seed=n_group * 10 + topk_group)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.5 if with_bias else None
    actual = sigmoid_topk(logits, top_k, bias, n_group, topk_group, scale, normalize)
    assert_routing(actual, sigmoid_topk_reference(logits.double(), top_k, bias, n_group, topk_group, scale, normalize))
    if normalize:
        assert torch.allclose(actual[1].sum(-1), torch.full((48,), scale), atol=1e-5)


def test_grouped_selection_never_picks_outside_kept_groups():
    """All biased scores negative: experts of dropped groups must still lose (masked to -inf, not 0)."""
    E, top_k = 32, 4
    logits = random_logits(24, E, seed=11)
    bias = torch.full((E,), -2.0)
    actual = sigmoid_topk(logits, top_k, bias, n_group=4, topk_group=2)
    assert_routing(actual, sigmoid_topk_reference(logits.double(), top_k, bias, 4, 2))


def test_groups_bias_and_scores_change_the_result():
    """Each rule is live: the groups, the bias in selection, and unbiased weights all change the answer."""
    E, top_k = 64, 6
    logits = random_logits(48, E, seed=3)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.5
    plain_ids, _ = sigmoid_topk(logits, top_k)
    grouped_ids, _ = sigmoid_topk(logits, top_k, n_group=8, topk_group=2)
    biased_ids, biased_w = sigmoid_topk(logits, top_k, bias, normalize=False)
    assert not torch.equal(plain_ids, grouped_ids) and not torch.equal(plain_ids, biased_ids)
    assert torch.allclose(biased_w, torch.sigmoid(logits).gather(1, biased_ids.long()))


def test_router_rejects_impossible_groups():
    logits = random_logits(2, 16, seed=0)
    with pytest.raises(ContractError, match="n_group"):
        sigmoid_topk(logits, 2, n_group=3, topk_group=1)
    with pytest.raises(ContractError, match="top_k"):
        sigmoid_topk(logits, 9, n_group=4, topk_group=2)
    with pytest.raises(ContractError, match="top_k"):
        softmax_topk(logits, 17)


class FakeReader:
    """Enough of CheckpointReader for Router.from_config: `in` and tensor()."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def __contains__(self, key):
        return key in self.tensors

    def tensor(self, key, device=None):
        return self.tensors[key] if device is None else self.tensors[key].to(device)


def gate_tensors(E=16, H=128, bias=True, prefix="m"):
    g = torch.Generator().manual_seed(1)
    tensors = {f"{prefix}.gate.weight": torch.randn(E, H, generator=g).half()}
    if bias:
        tensors[f"{prefix}.gate.e_score_correction_bias"] = torch.randn(E, generator=g)
    return FakeReader(tensors)


DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_experts_per_tok": 4, "n_routed_experts": 16, "n_group": 4,
               "topk_group": 2, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
               "norm_topk_prob": True}
GLM_45 = {"model_type": "glm4_moe", "num_experts_per_tok": 4, "n_routed_experts": 16, "n_group": 1, "topk_group": 1,
          "routed_scaling_factor": 1.0, "norm_topk_prob": True}


def test_router_from_deepseek_and_glm_configs():
    deepseek = Router.from_config(DEEPSEEK_V3, gate_tensors(), "m")
    assert (deepseek.kind, deepseek.top_k, deepseek.n_group, deepseek.topk_group) == ("sigmoid", 4, 4, 2)
    assert deepseek.routed_scaling_factor == 2.5 and deepseek.correction_bias.dtype == torch.float32
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(2)).half()
    logits = router_logits(x, deepseek.weight).double()
    expected = sigmoid_topk_reference(logits, 4, deepseek.correction_bias.double(), 4, 2, 2.5, True)
    assert_routing(deepseek(x), expected)
    glm = Router.from_config(GLM_45, gate_tensors(), "m")
    assert glm.kind == "sigmoid" and glm.normalize and glm.correction_bias is not None


def test_router_from_mixtral_and_qwen3_configs(fixtures_dir):
    reader = open_checkpoint(os.path.join(fixtures_dir, CHECKPOINT))
    qwen = Router.from_config(reader.config, reader, PREFIX.format(0))
    assert (qwen.kind, qwen.top_k, qwen.normalize, qwen.num_experts) == ("softmax", 4, True, 16)
    mixtral = Router.from_config({"model_type": "mixtral", "num_experts_per_tok": 2, "num_local_experts": 16},
                                 gate_tensors(bias=False), "m")
    assert mixtral.kind == "softmax" and mixtral.normalize and mixtral.top_k == 2


@pytest.mark.parametrize("change,key", [
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"n_routed_experts": 8}, "n_routed_experts"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 5}, "topk_group"),
    ({"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
    ({"model_type": "unknown_moe", "norm_topk_prob": None}, "norm_topk_prob"),
])
def test_bad_config_names_the_key(change, key):
    config = {k: v for k, v in {**DEEPSEEK_V3, **change}.items() if v is not None}
    with pytest.raises(FormatError) as err:
        Router.from_config(config, gate_tensors(), "m")
    assert err.value.name == key


def test_missing_tensors_and_activation_raise_format_error():
    with pytest.raises(FormatError, match="m.gate.e_score_correction_bias"):
        Router.from_config(DEEPSEEK_V3, gate_tensors(bias=False), "m")
    with pytest.raises(FormatError, match="other.gate.weight"):
        Router.from_config(DEEPSEEK_V3, gate_tensors(), "other")
    with pytest.raises(FormatError, match="hidden_act"):
        activation_from_config({"hidden_act": "tanh"})
    assert activation_from_config({"hidden_act": "gelu_pytorch_tanh"}) == "gelu"


@needs_interpreter
@pytest.mark.parametrize("layer", [0, 1])
def test_fixture_layer_matches_reference(fixtures_dir, layer):
    reader = open_checkpoint(os.path.join(fixtures_dir, CHECKPOINT))
    stored = load_file(os.path.join(fixtures_dir, OUTPUTS))
    module = EXL3MoE.from_checkpoint(reader, PREFIX.format(layer), max_tokens=16)
    x = stored[f"layer{layer}.x"]
    ids, weights = module.router(x)
    assert torch.equal(ids.long(), stored[f"layer{layer}.sel"])
    assert (weights - stored[f"layer{layer}.w"]).abs().max() < 1e-5
    out = module(x)
    assert out.dtype == torch.float16 and out.shape == x.shape
    assert rel_l2(out, moe(x, module.experts, ids, weights)) < 2e-3
    assert rel_l2(out, stored[f"layer{layer}.out"]) < 1e-2


def synthetic_layer(gated: bool, max_tokens: int):
    g = torch.Generator().manual_seed(5)
    experts = random_experts(4, 128, 128, K=[2, 3, 4, 3], codebook=["3inst", "mcg", "mul1", "3inst"], generator=g)
    shared = random_experts(1, 128, 256, K=4, codebook="mcg", generator=g, name="shared")
    router = Router(torch.randn(4, 128, generator=g).half(), top_k=2)
    gate = (torch.randn(1, 128, generator=g) * 0.2).half() if gated else None
    return EXL3MoE(experts, router, shared, gate, max_tokens=max_tokens)


@needs_interpreter
def test_gated_shared_expert_matches_float64():
    module = synthetic_layer(gated=True, max_tokens=2)
    x = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(6)).half()
    out = module(x)  # 5 tokens > max_tokens: re-planned for 5
    assert out.shape == x.shape and module.max_tokens == 5
    rows = x.reshape(5, 128)
    ids, weights = module.router(rows)
    gate64 = torch.sigmoid(rows.double() @ module.shared_gate.double())
    shared_part = moe(rows, module.shared, torch.zeros(5, 1, dtype=torch.int64), gate64)
    expected = moe(rows, module.experts, ids, weights) + shared_part
    assert rel_l2(out.reshape(5, 128), expected) < 2e-3
    ungated = moe(rows, module.experts, ids, weights, shared=module.shared)
    assert rel_l2(expected, ungated) > 1e-2  # the gate changes the answer, so the check above can fail
    plan, given = module.plan, torch.empty(3, 128, dtype=torch.float32)
    assert module(rows[:3], out=given) is given and module.plan is plan  # no re-plan at T <= max_tokens
    assert rel_l2(given, expected[:3]) < 2e-3


@needs_interpreter
def test_always_on_shared_expert_matches_float64():
    module = synthetic_layer(gated=False, max_tokens=8)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8)).half()
    ids, weights = module.router(x)
    assert rel_l2(module(x), moe(x, module.experts, ids, weights, shared=module.shared)) < 2e-3


def test_module_refuses_mismatched_parts():
    g = torch.Generator().manual_seed(9)
    experts = random_experts(4, 128, 128, generator=g)
    with pytest.raises(ContractError, match="router.weight"):
        EXL3MoE(experts, Router(torch.randn(8, 128), top_k=2))
    with pytest.raises(ContractError, match="shared_gate"):
        EXL3MoE(experts, Router(torch.randn(4, 128), top_k=2), shared_gate=torch.randn(1, 128))
    module = EXL3MoE(experts, Router(torch.randn(4, 128), top_k=2), out_dtype=torch.float16)
    with pytest.raises(ContractError, match="out"):
        module(torch.randn(2, 128).half(), out=torch.empty(2, 128, dtype=torch.float32))
    with pytest.raises(ContractError, match="hidden"):
        module(torch.randn(2, 64).half())
