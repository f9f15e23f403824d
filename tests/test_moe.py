"""Fused routed MoE (ops.moe) against the float64 oracle, under the Triton interpreter at small shapes."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exl3moe import ContractError, ExpertSet, ResidualStage
from exl3moe.ops import MOE_ADDITIVE_ABI_VERSION, fused_experts, moe_plan
from exl3moe.reference import moe
from helpers import load_moe_fixture, random_experts, random_stage, random_weight

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 6e-3, torch.float32: 2e-3}
MIXED_K = [2, 3, 4, 5, 6, 8, 2.5, 1.5]
MIXED_CODEBOOK = ["3inst", "mcg", "mul1", "3inst", "mcg", "mul1", "mul1", "mul1"]
OTHER_K = [1, 7, 3.5, 3, 2, 8, 2.5, 1.5]
OTHER_CODEBOOK = ["mcg", "3inst", "mul1", "mul1", "mcg", "3inst", "mul1", "mul1"]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under "
                                "TRITON_INTERPRET=1 (conftest sets it where no GPU is present)")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    return float((actual.to(torch.float64) - expected).norm() / expected.norm())


def routing(T: int, top_k: int, E: int, seed: int, dtype=torch.int64, weight_dtype=torch.float32):
    """Distinct experts per token (like a real router) and positive weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(dtype)
    weights = torch.rand(T, top_k, generator=g) + 0.1
    return ids, (weights / weights.sum(-1, keepdim=True)).to(weight_dtype)


def inputs(T: int, H: int, seed: int, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run(plan, hidden, ids, weights, out_dtype=torch.float16):
    out = torch.empty(hidden.shape[0], plan.tables.hidden_size, dtype=out_dtype)
    return plan.bind(plan.allocate()).run(hidden, ids, weights, out)


def check(out, hidden, experts, ids, weights, shared=None):
    err = rel_l2(out, moe(hidden, experts, ids, weights, shared))
    assert err < TOLERANCE[out.dtype], err


def test_abi_version():
    assert MOE_ADDITIVE_ABI_VERSION == 1


def test_mixed_widths_and_codebooks_in_one_layer():
    g = torch.Generator().manual_seed(1)
    experts = random_experts(8, 256, 256, K=MIXED_K, codebook=MIXED_CODEBOOK, generator=g)
    hidden = inputs(40, 256, 2)
    ids, weights = routing(40, 4, 8, 3)
    check(fused_experts(hidden, experts, ids, weights), hidden, experts, ids, weights)


def test_mixed_layer_route_blocks_grouped_by_format_give_the_same_bytes():
    """A mixed layer's route blocks follow its experts sorted by format; the output bytes do not depend on it."""
    g = torch.Generator().manual_seed(4)
    experts = random_experts(6, 256, 256, K=[4, 2, 4, 3, 2, 4], codebook="mcg", generator=g)
    plan = moe_plan(experts, 40, 4, block_m=16)
    assert plan.expert_order.tolist() == [1, 4, 3, 0, 2, 5]
    assert moe_plan(random_experts(3, 256, 256, K=3, generator=g), 4, 2).expert_order is None
    runner = plan.bind(plan.allocate())
    hidden = inputs(40, 256, 5)
    ids, weights = routing(40, 4, 6, 6)
    grouped = runner.run(hidden, ids, weights, torch.empty(40, 256, dtype=torch.float16))
    check(grouped, hidden, experts, ids, weights)
    plan.expert_order = None
    by_id = runner.run(hidden, ids, weights, torch.empty(40, 256, dtype=torch.float16))
    assert torch.equal(grouped.view(torch.int16), by_id.view(torch.int16))


@pytest.mark.parametrize("activation,limit", [("silu", None), ("silu", 8.0), ("gelu", None), ("gelu", 0.5),
                                              ("relu2", None), ("relu2", 6.0)])
def test_activations_and_limit(activation, limit):
    g = torch.Generator().manual_seed(4)
    experts = random_experts(4, 128, 128, K=[3, 4, 2, 2.5], codebook=["mcg", "3inst", "mul1", "mul1"],
                             activation=activation, limit=limit, generator=g)
    hidden = inputs(9, 128, 5)
    ids, weights = routing(9, 2, 4, 6)
    check(fused_experts(hidden, experts, ids, weights), hidden, experts, ids, weights)


@pytest.mark.parametrize("top_k,T", [(1, 17), (2, 9), (3, 5), (8, 6)])
def test_top_k(top_k, T):
    g = torch.Generator().manual_seed(7 + top_k)
    experts = random_experts(8, 128, 128, K=OTHER_K, codebook=OTHER_CODEBOOK, generator=g)
    hidden = inputs(T, 128, 8)
    ids, weights = routing(T, top_k, 8, 9, dtype=torch.int32)
    check(fused_experts(hidden, experts, ids, weights), hidden, experts, ids, weights)


def test_shared_expert_with_its_own_width_and_biases():
    g = torch.Generator().manual_seed(10)
    experts = random_experts(4, 128, 128, K=[2, 4, 3, 5], codebook=["mcg", "mul1", "3inst", "mcg"], bias=True,
                             generator=g)
    shared = random_experts(1, 128, 256, K=3, codebook="mul1", activation="gelu", limit=1.5, generator=g,
                            name="shared")
    hidden = inputs(11, 128, 11)
    ids, weights = routing(11, 2, 4, 12)
    check(fused_experts(hidden, experts, ids, weights, shared=shared), hidden, experts, ids, weights, shared)


def test_residual_stages_with_zero_scales_skipped():
    g = torch.Generator().manual_seed(13)
    experts = random_experts(4, 128, 128, K=[2, 3, 2, 4], codebook=["3inst", "mcg", "mul1", "3inst"], generator=g)
    scales = torch.rand(4, 3, generator=g) * 0.3
    scales[1] = 0.0
    scales[2, 1] = 0.0
    stage = random_stage(experts, scales, K=2, codebook="mcg", generator=g)
    stage = stage.replace(down=stage.down[:3] + (None,))
    second = random_stage(experts, torch.rand(4, 3, generator=g) * 0.1, K=3, codebook="mul1", generator=g)
    staged = experts.replace(stages=[stage, second])
    hidden = inputs(10, 128, 14)
    ids, weights = routing(10, 2, 4, 15)
    out = fused_experts(hidden, staged, ids, weights)
    check(out, hidden, staged, ids, weights)
    assert rel_l2(out, moe(hidden, experts, ids, weights)) > 1e-2


def test_experts_never_selected_and_invalid_ids_skipped():
    g = torch.Generator().manual_seed(16)
    experts = random_experts(8, 128, 128, K=MIXED_K, codebook=MIXED_CODEBOOK, generator=g)
    hidden = inputs(12, 128, 17)
    ids = torch.tensor([[1, 5, 8, -1]] * 6 + [[5, 1, -3, 100]] * 6, dtype=torch.int64)
    weights = torch.rand(12, 4, generator=g)
    weights[ids >= 8] = float("nan")
    weights[ids < 0] = float("inf")
    out = fused_experts(hidden, experts, ids, weights)
    assert torch.isfinite(out).all()
    check(out, hidden, experts, ids, weights)
    no_valid = torch.tensor([[8, -1, 9, -2]] * 12)
    assert torch.equal(fused_experts(hidden, experts, no_valid, weights), torch.zeros(12, 128, dtype=torch.float16))


def test_every_token_on_one_expert_is_chunked_and_chunking_keeps_bytes():
    g = torch.Generator().manual_seed(18)
    experts = random_experts(4, 128, 128, K=[4, 2, 3, 2.5], codebook=["mcg", "3inst", "3inst", "mul1"], generator=g)
    T, top_k = 40, 2
    hidden = inputs(T, 128, 19)
    ids = torch.stack([torch.full((T,), 2), torch.randint(0, 2, (T,), generator=g)], 1)
    weights = torch.rand(T, top_k, generator=g)
    chunked = moe_plan(experts, T, top_k, slot_capacity=24, block_m=16)
    assert chunked.slot_capacity == 24 and chunked.chunk_tokens == 12
    out = run(chunked, hidden, ids, weights)
    check(out, hidden, experts, ids, weights)
    whole = run(moe_plan(experts, T, top_k, block_m=16), hidden, ids, weights)
    assert torch.equal(out.view(torch.int16), whole.view(torch.int16))
    runner = chunked.bind(chunked.allocate())
    with pytest.raises(ContractError, match="topk_ids.*at most 12 tokens"):
        runner.chunk_launches(hidden, ids, weights, torch.empty_like(hidden))


def test_deterministic_and_batch_invariant():
    g = torch.Generator().manual_seed(20)
    experts = random_experts(8, 128, 128, K=MIXED_K, codebook=MIXED_CODEBOOK, generator=g)
    shared = random_experts(1, 128, 128, K=4, codebook="mcg", generator=g, name="shared")
    hidden = inputs(33, 128, 21)
    ids, weights = routing(33, 4, 8, 22)
    plan = moe_plan(experts, 33, 4, shared=shared)
    runner = plan.bind(plan.allocate())
    outs = [runner.run(hidden, ids, weights, torch.empty(33, 128, dtype=torch.float16)) for _ in range(2)]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    alone = runner.run(hidden[:1], ids[:1], weights[:1], torch.empty(1, 128, dtype=torch.float16))
    assert torch.equal(alone.view(torch.int16), outs[0][:1].view(torch.int16))
    check(outs[0], hidden, experts, ids, weights, shared)


@pytest.mark.parametrize("hidden_dtype,weight_dtype,out_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16, torch.float32),
    (torch.bfloat16, torch.float32, torch.float16)])
def test_dtypes(hidden_dtype, weight_dtype, out_dtype):
    g = torch.Generator().manual_seed(23)
    experts = random_experts(4, 128, 128, K=[3, 4, 2, 6], codebook=["mcg", "3inst", "mul1", "mul1"], generator=g)
    hidden = inputs(7, 128, 24, hidden_dtype)
    ids, weights = routing(7, 2, 4, 25, dtype=torch.int32, weight_dtype=weight_dtype)
    out = fused_experts(hidden, experts, ids, weights, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    check(out, hidden, experts, ids, weights)


@pytest.mark.parametrize("decode_k,block_m", [(16, 32), (32, 16), (64, 64)])
def test_decode_sub_blocks_and_route_block_sizes(decode_k, block_m):
    g = torch.Generator().manual_seed(26)
    experts = random_experts(4, 256, 128, K=[2, 8, 2.5, 4], codebook=["3inst", "mcg", "mul1", "mul1"], generator=g)
    hidden = inputs(6, 256, 27)
    ids, weights = routing(6, 2, 4, 28)
    plan = moe_plan(experts, 6, 2, decode_k=decode_k, block_m=block_m)
    check(run(plan, hidden, ids, weights), hidden, experts, ids, weights)


def test_torch_path_matches_oracle(monkeypatch):
    g = torch.Generator().manual_seed(29)
    experts = random_experts(4, 128, 128, K=[2, 3, 4, 2.5], codebook=["3inst", "mcg", "mcg", "mul1"], bias=True,
                             generator=g)
    experts = experts.replace(stages=[random_stage(experts, torch.rand(4, 3, generator=g) * 0.2, generator=g)])
    shared = random_experts(1, 128, 128, K=3, generator=g, name="shared")
    hidden = inputs(9, 128, 30)
    ids, weights = routing(9, 2, 4, 31)
    ids[0, 1] = 4
    triton_out = fused_experts(hidden, experts, ids, weights, shared=shared)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch_out = fused_experts(hidden, experts, ids, weights, shared=shared)
    check(torch_out, hidden, experts, ids, weights, shared)
    assert rel_l2(torch_out, triton_out) < 1e-3


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(E=st.integers(1, 6), top_k=st.integers(1, 4), T=st.integers(1, 12), hidden=st.sampled_from([128, 256]),
       activation=st.sampled_from(["silu", "gelu", "relu2"]), seed=st.integers(0, 2**16))
def test_random_layers_match_oracle(E, top_k, T, hidden, activation, seed):
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(OTHER_K), (E,), generator=g).tolist()
    experts = random_experts(E, hidden, 128, K=[OTHER_K[i] for i in pick], codebook=[OTHER_CODEBOOK[i] for i in pick],
                             activation=activation, generator=g)
    hidden_states = inputs(T, hidden, seed)
    ids = torch.randint(-1, E + 1, (T, top_k), generator=g)
    weights = torch.rand(T, top_k, generator=g)
    out = fused_experts(hidden_states, experts, ids, weights, out_dtype=torch.float32)
    ref = moe(hidden_states, experts, ids, weights)
    if ref.norm() == 0:
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert rel_l2(out, ref) < 2e-3


@pytest.mark.parametrize("name", ["exllamav3_moe_mcg_k4", "exllamav3_moe_mul1_k3"])
def test_exllamav3_fixture(fixtures_dir, name):
    t, meta, experts = load_moe_fixture(fixtures_dir, name)
    out = fused_experts(t["x"], experts, t["sel"], t["w"])
    check(out, t["x"], experts, t["sel"], t["w"])
    assert rel_l2(out, t["out"]) < 2e-3


def test_zero_tokens():
    experts = random_experts(2, 128, 128, K=2)
    out = fused_experts(torch.zeros(0, 128, dtype=torch.float16), experts, torch.zeros(0, 2, dtype=torch.int64),
                        torch.zeros(0, 2))
    assert out.shape == (0, 128)


def test_plan_contract():
    g = torch.Generator().manual_seed(32)
    experts = random_experts(2, 128, 128, K=2, generator=g)
    for kwargs, name in [({"max_tokens": 0}, "max_tokens"), ({"top_k": 0}, "top_k"),
                         ({"slot_capacity": 1}, "slot_capacity"), ({"block_m": 24}, "block_m"),
                         ({"block_m": 192}, "block_m"),   # the H200's warp-specialized experts only
                         ({"decode_k": 8}, "decode_k"), ({"out_dtype": torch.int8}, "out_dtype")]:
        args = {"max_tokens": 4, "top_k": 2, **kwargs}
        with pytest.raises(ContractError) as info:
            moe_plan(experts, **args)
        assert info.value.name == name
    with pytest.raises(ContractError) as info:
        moe_plan("experts", 4, 2)
    assert info.value.name == "experts"
    with pytest.raises(ContractError) as info:
        moe_plan(experts, 4, 2, shared=random_experts(2, 128, 128, K=2, name="shared"))
    assert info.value.name == "shared"
    strided = random_weight(128, 128, 2, generator=g).replace(suh=torch.zeros(256, dtype=torch.float16)[::2])
    bad = ExpertSet([strided, experts.gate[1]], experts.up, experts.down)
    with pytest.raises(ContractError, match="contiguous") as info:
        moe_plan(bad, 4, 2)
    assert info.value.name == "experts.gate[0].suh"
    other = random_weight(128, 128, 2, generator=g)
    experts = experts.replace(stages=[ResidualStage(None, [other, None], None, torch.ones(2, 3))])
    with pytest.raises(ContractError, match="share") as info:
        moe_plan(experts, 4, 2)
    assert info.value.name == "experts.stages[0].up[0]"


def test_run_contract():
    g = torch.Generator().manual_seed(33)
    experts = random_experts(2, 128, 128, K=2, generator=g)
    plan = moe_plan(experts, 4, 2, out_dtype=torch.float16)
    runner = plan.bind(plan.allocate())
    x, ids, w = inputs(3, 128, 34), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    out = torch.empty(3, 128, dtype=torch.float16)
    cases = [
        ((x.float(), ids, w, out), "hidden"), ((inputs(5, 128, 1), torch.zeros(5, 2, dtype=torch.int64),
                                                torch.ones(5, 2), torch.empty(5, 128).half()), "hidden"),
        ((x, ids.float(), w, out), "topk_ids"), ((x, ids[:, :1], w, out), "topk_ids"),
        ((x, torch.zeros(2, 3, dtype=torch.int64).t(), w, out), "topk_ids"),
        ((x, ids, w.double(), out), "topk_weights"), ((x, ids, w[:2], out), "topk_weights"),
        ((x, ids, w, out.float()), "out"), ((x, ids, w, out[:2]), "out"),
    ]
    for args, name in cases:
        with pytest.raises(ContractError) as info:
            runner.run(*args)
        assert info.value.name == name
    for workspace in (torch.empty(plan.workspace_bytes - 1, dtype=torch.uint8), torch.empty(10, dtype=torch.int32)):
        with pytest.raises(ContractError) as info:
            plan.bind(workspace)
        assert info.value.name == "workspace"


def test_split_gate_up_for_small_batches_matches_oracle_and_is_deterministic():
    """Few slots on a wide hidden size: gate/up is split over the hidden size, partials summed in order."""
    from exl3moe.ops.moe_planning import gate_up_splits

    experts = random_experts(4, 512, 128, K=[3, 4, 2.5, 6], codebook=["mcg", "3inst", "mul1", "mul1"],
                             generator=torch.Generator().manual_seed(11))
    plan = moe_plan(experts, 2, 2)
    assert plan.gate_up_splits == gate_up_splits(4, 512, 128) == 4
    assert all(moe_plan(experts, T, 2).gate_up_splits == 4 for T in (1, 7, 300)), "from the shape alone"
    hidden = (torch.randn(2, 512, generator=torch.Generator().manual_seed(12)) * 0.5).half()
    ids = torch.tensor([[0, 2], [3, 1]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    runner = plan.bind(plan.allocate())
    first = torch.empty(2, 512, dtype=torch.float16)
    runner.run(hidden, ids, weights, first)
    check(first, hidden, experts, ids, weights)
    again = torch.full_like(first, float("nan"))
    runner.run(hidden, ids, weights, again)
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    single = torch.empty(1, 512, dtype=torch.float16)
    runner.run(hidden[1:], ids[1:], weights[1:], single)
    assert torch.equal(single.view(torch.int16), first[1:].view(torch.int16))


def test_stage_hot_swap_rewrites_tables_in_place():
    """base -> stage set A -> stage set B -> base on one plan: equal to fresh plans, base bytes restored."""
    g = torch.Generator().manual_seed(21)
    experts = random_experts(4, 128, 128, K=[3, 4, 2, 4], codebook=["mcg", "mul1", "3inst", "mcg"], generator=g)
    set_a = [random_stage(experts, torch.rand(4, 3, generator=g), K=2, codebook="mcg", generator=g)]
    scales_b = torch.rand(4, 3, generator=g)
    scales_b[1] = 0.0
    set_b = [random_stage(experts, scales_b, K=3, codebook="mcg", generator=g),
             random_stage(experts, torch.rand(4, 3, generator=g), K=2, codebook="mul1", generator=g)]
    hidden = (torch.randn(5, 128, generator=g) * 0.5).half()
    ids = torch.randint(0, 4, (5, 2), generator=g)
    weights = torch.rand(5, 2, generator=g)
    plan = moe_plan(experts, 5, 2, stage_capacity=2, max_stage_bits=3, stage_codebooks=["mcg", "mul1"])
    runner = plan.bind(plan.allocate())
    tables = (plan.tables.stage_addr, plan.tables.stage_scale)

    def run():
        out = torch.full((5, 128), float("nan"), dtype=torch.float16)
        return runner.run(hidden, ids, weights, out)

    base_first = run()
    check(base_first, hidden, experts, ids, weights)
    for stages in (set_a, set_b):
        plan.load_stages(stages)
        assert plan.tables.stage_addr is tables[0] and plan.tables.stage_scale is tables[1]
        with_stages = ExpertSet(experts.gate, experts.up, experts.down, experts.activation, stages=stages)
        out = run()
        check(out, hidden, with_stages, ids, weights)
        fresh = fused_experts(hidden, with_stages, ids, weights)
        assert torch.equal(out.view(torch.int16), fresh.view(torch.int16))
    plan.load_stages([])
    assert torch.equal(run().view(torch.int16), base_first.view(torch.int16))


def test_stage_hot_swap_refuses_what_the_plan_cannot_read():
    g = torch.Generator().manual_seed(22)
    experts = random_experts(2, 128, 128, K=3, codebook="mcg", generator=g)
    plan = moe_plan(experts, 4, 2, stage_capacity=1, max_stage_bits=2)
    before = plan.tables.stage_scale.clone()
    wide = [random_stage(experts, torch.ones(2, 3), K=4, codebook="mcg", generator=g)]
    two = [random_stage(experts, torch.ones(2, 3), K=2, generator=g) for _ in range(2)]
    bad_scales = torch.ones(2, 3)
    bad_scales[0, 1] = float("nan")
    nan = [random_stage(experts, bad_scales, K=2, generator=g)]
    tiny = [random_stage(experts, torch.full((2, 3), 1e-13), K=2, generator=g)]
    mul1 = [random_stage(experts, torch.ones(2, 3), K=2, codebook="mul1", generator=g)]
    for stages, rule in ((wide, "wider"), (two, "capacity"), (nan, "finite"), (tiny, "2^-40"), ("x", "list"),
                         (mul1, "outside the plan's ['mcg']")):
        with pytest.raises(ContractError) as err:
            plan.load_stages(stages)
        assert rule in str(err.value) and "stages" in err.value.name
        assert torch.equal(plan.tables.stage_scale, before), "a refused swap must write nothing"
    with pytest.raises(ContractError, match="max_stage_bits"):
        moe_plan(experts, 4, 2, max_stage_bits=2.2)
    for codebooks in (["mcg", "fp8"], [], "mcg"):
        with pytest.raises(ContractError, match="stage_codebooks"):
            moe_plan(experts, 4, 2, stage_capacity=1, stage_codebooks=codebooks)
    staged = ExpertSet(experts.gate, experts.up, experts.down, experts.activation, stages=mul1)
    with pytest.raises(ContractError, match="must include the codebooks of the plan's stages"):
        moe_plan(staged, 4, 2, stage_codebooks=["mcg"])
    assert moe_plan(staged, 4, 2).stage_codebooks == ("mul1",)
    wider = moe_plan(experts, 4, 2, stage_capacity=1, stage_codebooks=["mul1", "mcg"])
    assert wider.stage_codebooks == ("mcg", "mul1") and (3, 2) in wider.stage_formats
    assert plan.stage_formats == ((2, 1), (4, 1)), "K <= 2 MCG residuals: two compiled stage formats"
    wider.load_stages(mul1)
