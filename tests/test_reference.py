"""The float64 oracles against exllamav3's outputs and against hand-written formulas."""

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from exl3moe import ContractError, EXL3Weight, ExpertSet, FormatError, ResidualStage
from exl3moe.format import decode
from exl3moe.reference import linear, moe, route_pack_reference
from exl3moe.reference.moe import GELU_TANH_COEF
from helpers import load_moe_fixture, random_experts, random_stage, random_weight
from test_format import DECODE_TAGS, tag_tensors


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    return float((actual.to(torch.float64) - expected).norm() / expected.norm())


# ---------------------------------------------------------------------------------------------- linear

@pytest.fixture(scope="module")
def linear_fixture(fixtures_dir):
    return load_file(os.path.join(fixtures_dir, "exllamav3_decode_linear.safetensors"))


@pytest.mark.parametrize("tag", DECODE_TAGS)
def test_linear_matches_exllamav3(linear_fixture, tag):
    sub = tag_tensors(linear_fixture, tag)
    w = EXL3Weight.from_tensors(sub, tag)
    y = linear(sub["x"], w)
    assert y.dtype == torch.float64 and y.shape == (5, 384)
    assert rel_l2(y, sub["y"]) < 1e-3
    assert rel_l2(linear(sub["x"][:1], w), sub["y_row0"]) < 1e-3


def _sylvester_blockdiag(size: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(7):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(128)] * (size // 128))


def test_linear_is_the_forward_formula():
    w = random_weight(256, 384, 3, "mcg", bias=True, generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(6))
    inner = decode(w.trellis, 3, "mcg").to(torch.float64)
    rotated_x = (x.double() * w.suh.double()) @ _sylvester_blockdiag(256)
    expected = (rotated_x @ inner) @ _sylvester_blockdiag(384) * w.svh.double() + w.bias.double()
    y = linear(x, w)
    assert y.shape == (2, 3, 384)
    assert torch.allclose(y, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_linear_input_dtypes_are_exact(dtype):
    w = random_weight(128, 128, 2, "mul1", generator=torch.Generator().manual_seed(7))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8)).to(dtype)
    assert torch.equal(linear(x, w), linear(x.double(), w))


def test_linear_contract():
    w = random_weight(128, 256, 2)
    for bad, name in ((torch.zeros(2, 256), "x"), (torch.zeros(2, 128, dtype=torch.int32), "x"),
                      (torch.zeros(()), "x")):
        with pytest.raises(ContractError) as info:
            linear(bad, w)
        assert info.value.name == name
    with pytest.raises(ContractError):
        linear(torch.zeros(2, 128), "not a weight")


# ------------------------------------------------------------------------------------- MoE fixtures

@pytest.mark.parametrize("name", ["exllamav3_moe_mcg_k4", "exllamav3_moe_mul1_k3"])
def test_moe_matches_exllamav3(fixtures_dir, name):
    tensors, meta, experts = load_moe_fixture(fixtures_dir, name)
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == \
        (int(meta["E"]), int(meta["H"]), int(meta["I"]))
    assert all(w.K == float(meta["K"]) for w in experts.up)
    assert tensors["sel"].shape[1] == int(meta["topk"])
    out = moe(tensors["x"], experts, tensors["sel"], tensors["w"])
    assert out.dtype == torch.float64 and out.shape == tensors["out"].shape
    assert rel_l2(out, tensors["out"]) < 1.1e-3


def _qwen3_experts(model: dict, layer: int) -> ExpertSet:
    def proj(e: int, p: str) -> EXL3Weight:
        prefix = f"model.layers.{layer}.mlp.experts.{e}.{p}_proj."
        return EXL3Weight.from_tensors({k[len(prefix):]: v for k, v in model.items() if k.startswith(prefix)},
                                       prefix[:-1])

    E = model[f"model.layers.{layer}.mlp.gate.weight"].shape[0]
    return ExpertSet(*[[proj(e, p) for e in range(E)] for p in ("gate", "up", "down")], "silu")


@pytest.fixture(scope="module")
def qwen3(fixtures_dir):
    model = load_file(os.path.join(fixtures_dir, "tiny_qwen3_moe_exl3", "model.safetensors"))
    outputs = load_file(os.path.join(fixtures_dir, "tiny_qwen3_moe_exl3_moe_outputs.safetensors"))
    return model, outputs


@pytest.mark.parametrize("layer", [0, 1])
def test_tiny_qwen3_routing(qwen3, layer):
    model, outputs = qwen3
    x, router = outputs[f"layer{layer}.x"], model[f"model.layers.{layer}.mlp.gate.weight"]
    probs = torch.softmax(x.double() @ router.double().t(), dim=-1)
    top_w, top_i = probs.topk(4, dim=-1)
    assert torch.equal(top_i, outputs[f"layer{layer}.sel"])
    assert torch.allclose(top_w / top_w.sum(-1, keepdim=True), outputs[f"layer{layer}.w"].double(), atol=1e-5)


@pytest.mark.parametrize("layer", [0, 1])
def test_tiny_qwen3_moe(qwen3, layer):
    model, outputs = qwen3
    experts = _qwen3_experts(model, layer)
    assert experts.num_experts == 16 and experts.up[0].K == 2.5 and experts.up[0].codebook == "mul1"
    out = moe(outputs[f"layer{layer}.x"], experts, outputs[f"layer{layer}.sel"], outputs[f"layer{layer}.w"])
    assert 3e-3 <= rel_l2(out, outputs[f"layer{layer}.out"]) <= 1e-2


# ------------------------------------------------------------------------------ MoE semantics

def _silu(v):
    return v / (1 + torch.exp(-v))


def _gelu(v):
    return 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


def _hand_moe(x, experts, ids, weights, stage_terms=None):
    """Token by token, slot by slot: sum_j w * down(act(gate(x), up(x))), with explicit activations."""
    limit = experts.limit
    out = torch.zeros(x.shape[0], experts.hidden_size, dtype=torch.float64)
    for t in range(x.shape[0]):
        row = x[t:t + 1].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < experts.num_experts:
                continue
            project = stage_terms or (lambda p, e_, v: linear(v, getattr(experts, p)[e_]))
            u = project("up", e, row)
            if experts.activation == "relu2":
                a, gated_up = torch.clamp(u, min=0), torch.clamp(u, min=0)
            else:
                a = (_silu if experts.activation == "silu" else _gelu)(project("gate", e, row))
                gated_up = u
            if limit is not None:
                a = torch.minimum(a, torch.tensor(limit, dtype=torch.float64))
                gated_up = torch.clamp(gated_up, -limit, limit)
            out[t] += float(weights[t, j]) * project("down", e, a * gated_up)[0]
    return out


def _routing(T, top_k, E, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    weights = torch.rand(T, top_k, generator=g)
    return ids, weights


@pytest.mark.parametrize("activation,limit", [("silu", None), ("gelu", None), ("relu2", None), ("silu", 0.6),
                                              ("gelu", 0.6), ("relu2", 0.6), ("silu", 0.2), ("gelu", 0.12)])
def test_moe_activations(activation, limit):
    g = torch.Generator().manual_seed(11)
    experts = random_experts(3, 128, 256, K=[2, 2.5, 4], codebook=["3inst", "mul1", "mcg"],
                             activation=activation, limit=limit, generator=g)
    x = (torch.randn(6, 128, generator=g) * 0.05).to(torch.float16)
    ids, weights = _routing(6, 2, 3, 12)
    out = moe(x, experts, ids, weights)
    assert torch.allclose(out, _hand_moe(x, experts, ids, weights), rtol=1e-10, atol=1e-9)
    if limit is not None:  # the clamps bite on this data: u on both sides, the activated gate from above only
        up = linear(x, experts.up[0])
        assert (up > limit).any() and (up < -limit).any() and (up.abs() < limit).any()
        if activation != "relu2":
            act = (_silu if activation == "silu" else _gelu)(linear(x, experts.gate[0]))
            assert (act > limit).any() and (act < -limit).any() == (limit < 0.25)
        unlimited = ExpertSet(experts.gate, experts.up, experts.down, activation, None)
        assert rel_l2(moe(x, unlimited, ids, weights), out) > 1e-3


def test_gelu_constant_is_sqrt_2_over_pi():
    assert math.isclose(GELU_TANH_COEF, math.sqrt(2 / math.pi), rel_tol=1e-9)


def test_moe_invalid_ids_contribute_nothing():
    experts = random_experts(4, 128, 128, K=2, generator=torch.Generator().manual_seed(13))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(14)) * 0.1
    ids = torch.tensor([[0, -1, 2], [4, 1, 3], [-7, 100, 4], [3, 3, 0], [2, 1, 0]])
    weights = torch.rand(5, 3, generator=torch.Generator().manual_seed(15))
    out = moe(x, experts, ids, weights)
    assert torch.equal(out[2], torch.zeros(128, dtype=torch.float64))
    assert torch.allclose(out, _hand_moe(x, experts, ids, weights), rtol=1e-10, atol=1e-9)
    valid_only = torch.where((ids >= 0) & (ids < 4), weights, torch.zeros_like(weights))
    assert torch.allclose(out, moe(x, experts, ids.clamp(0, 3), valid_only), rtol=1e-12, atol=1e-12)
    assert out[0].abs().sum() > 0


def test_moe_shared_expert_adds():
    g = torch.Generator().manual_seed(16)
    experts = random_experts(3, 128, 128, K=3, generator=g)
    shared = random_experts(1, 128, 256, K=4, codebook="mcg", generator=g, name="shared")
    x = torch.randn(4, 128, generator=g) * 0.1
    ids, weights = _routing(4, 2, 3, 17)
    with_shared = moe(x, experts, ids, weights, shared=shared)
    only_shared = _hand_moe(x, shared, torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1))
    assert torch.allclose(with_shared - moe(x, experts, ids, weights), only_shared, rtol=1e-9, atol=1e-9)
    assert only_shared.norm() > 0
    with pytest.raises(ContractError):
        moe(x, experts, ids, weights, shared=experts)


def _stage_setup(scales_list):
    g = torch.Generator().manual_seed(21)
    experts = random_experts(3, 128, 128, K=2, generator=g)
    stages = [random_stage(experts, torch.tensor(s), K=1 + i, generator=g) for i, s in enumerate(scales_list)]
    x = torch.randn(5, 128, generator=g) * 0.1
    ids, weights = _routing(5, 2, 3, 22)
    return experts, stages, x, ids, weights


def test_zero_scale_stage_equals_base():
    experts, stages, x, ids, weights = _stage_setup([[[0.0] * 3] * 3])
    base = moe(x, experts, ids, weights)
    assert torch.equal(moe(x, experts, ids, weights, stages=stages), base)
    staged = ExpertSet(experts.gate, experts.up, experts.down, stages=stages)
    assert torch.equal(moe(x, staged, ids, weights), base)
    assert torch.equal(moe(x, staged, ids, weights, stages=[]), base)


def test_stages_add_scaled_residuals():
    scales = [[[0.5, -0.25, 0.125], [0.0, 1.0, -2.0], [0.75, 0.0, 0.3]],
              [[0.1, 0.2, 0.3], [-0.4, 0.0, 0.6], [0.0, 0.0, 0.0]]]
    experts, stages, x, ids, weights = _stage_setup(scales)
    stages[1] = stages[1].replace(down=stages[1].down[:2] + (None,))  # absent residual: skipped
    staged = ExpertSet(experts.gate, experts.up, experts.down, stages=stages)
    index = {"gate": 0, "up": 1, "down": 2}

    def project(p, e, v):
        y = linear(v, getattr(experts, p)[e])
        for stage in stages:
            residual = getattr(stage, p)[e]
            if residual is not None:  # scales are float32: use the stored value, not the Python literal
                y = y + float(stage.scales[e, index[p]]) * linear(v, residual)
        return y

    expected = _hand_moe(x, experts, ids, weights, stage_terms=project)
    out = moe(x, staged, ids, weights)
    assert torch.allclose(out, expected, rtol=1e-9, atol=1e-9)
    assert rel_l2(out, moe(x, experts, ids, weights)) > 1e-2
    assert torch.equal(moe(x, experts, ids, weights, stages=stages), out)


def test_stage_shape_is_checked():
    experts, stages, x, ids, weights = _stage_setup([[[1.0] * 3] * 3])
    bad_scales = ResidualStage(stages[0].gate, stages[0].up, stages[0].down, torch.ones(2, 3))
    with pytest.raises(FormatError) as info:
        moe(x, experts, ids, weights, stages=[bad_scales])
    assert info.value.name == "experts.stages[0].scales"
    wrong = list(stages[0].up)
    wrong[1] = random_weight(128, 256, 2)
    with pytest.raises(FormatError) as info:
        moe(x, experts, ids, weights, stages=[ResidualStage(stages[0].gate, wrong, stages[0].down,
                                                            stages[0].scales)])
    assert info.value.name == "experts.stages[0].up[1]"


def test_moe_decodes_each_used_weight_once(monkeypatch):
    experts = random_experts(4, 128, 128, K=2, generator=torch.Generator().manual_seed(31))
    calls = []
    original = EXL3Weight.dense
    monkeypatch.setattr(EXL3Weight, "dense", lambda self, dtype=torch.float64: calls.append(self.name)
                        or original(self, dtype))
    ids = torch.tensor([[0, 2], [2, 0], [0, 2], [2, -1]])
    moe(torch.randn(4, 128), experts, ids, torch.ones(4, 2))
    assert sorted(calls) == sorted(f"experts.{p}[{e}]" for p in ("gate", "up", "down") for e in (0, 2))


def test_moe_contract():
    experts = random_experts(2, 128, 128, K=2)
    x, ids, weights = torch.randn(3, 128), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    cases = [((torch.randn(3, 256), experts, ids, weights), "hidden"),
             ((x, experts, ids.float(), weights), "topk_ids"),
             ((x, experts, ids[:2], weights[:2]), "topk_ids"),
             ((x, experts, ids, weights[:, :1]), "topk_weights"),
             ((x, experts, ids, weights.long()), "topk_weights"),
             ((x, "experts", ids, weights), "experts")]
    for args, name in cases:
        with pytest.raises(ContractError) as info:
            moe(*args)
        assert info.value.name == name
    assert moe(x[:0], experts, ids[:0], weights[:0]).shape == (0, 128)


# ------------------------------------------------------------------------------------- route_pack

def test_route_pack_example():
    pack = route_pack_reference(torch.tensor([[1, 0], [5, 1], [-1, 0]]), 2)
    assert pack.counts.tolist() == [2, 2, 2]
    assert pack.offsets.tolist() == [0, 2, 4]
    assert pack.order.tolist() == [1, 5, 0, 3, 2, 4]


@pytest.mark.parametrize("T,top_k,E", [(1, 1, 1), (7, 2, 8), (33, 4, 16), (64, 8, 5)])
def test_route_pack_matches_stable_argsort(T, top_k, E):
    ids = torch.randint(-2, E + 3, (T, top_k), generator=torch.Generator().manual_seed(T * E), dtype=torch.int32)
    pack = route_pack_reference(ids, E)
    flat = ids.reshape(-1).long()
    mapped = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    assert torch.equal(pack.order, torch.argsort(mapped, stable=True))
    assert torch.equal(pack.counts, torch.bincount(mapped, minlength=E + 1))
    assert pack.offsets[0] == 0 and torch.equal(pack.offsets[1:], torch.cumsum(pack.counts, 0)[:-1])
    for e in range(E + 1):
        bucket = pack.order[pack.offsets[e]:pack.offsets[e] + pack.counts[e]]
        assert (mapped[bucket] == e).all() and torch.equal(bucket, bucket.sort().values)


def test_route_pack_contract():
    with pytest.raises(ContractError):
        route_pack_reference(torch.zeros(4), 2)
    with pytest.raises(ContractError):
        route_pack_reference(torch.zeros(2, 2), 2)
    with pytest.raises(ContractError):
        route_pack_reference(torch.zeros(2, 2, dtype=torch.int64), 0)
