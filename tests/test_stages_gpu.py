"""Residual-stage hot swaps under one captured CUDA graph on every kind of plan: direct, route-packed mma.sync,
warp-specialized and the Triton experts, each swap written by load_stages and by caller-built tables."""

import pytest
import torch

from exl3moe import MOE_ADDITIVE_ABI_VERSION, ExpertSet
from exl3moe.ops import moe_plan
from exl3moe.reference import moe
from helpers import capture_allocation_free
from test_moe_gpu import QWEN3, bits, qwen3_layer, random_experts, rel_l2, residual_stage, routing  # noqa: F401
from test_stage_contract import hand_tables, written

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def k4_layer():
    """The Qwen3-30B-A3B MoE shape on one format, K4 MCG (direct plans up to 16 slots)."""
    return random_experts(QWEN3["experts"], QWEN3["hidden"], QWEN3["inter"], [4], ["mcg"], seed=90)


def stage_sets(layer, seed, first=(2, "mcg"), second=(1, "mcg")) -> tuple:
    """Set A: a `first` (K, codebook) residual on every expert; set B: a `first` residual on one quarter of the
    experts and a `second` on another quarter."""
    E = layer.num_experts
    g = torch.Generator(device="cuda").manual_seed(seed)
    quarter, other = torch.zeros(E, 3, device="cuda"), torch.zeros(E, 3, device="cuda")
    quarter[::4], other[1::4] = 0.1, 0.1
    return ([residual_stage(layer, torch.rand(E, 3, device="cuda", generator=g) * 0.1, *first, seed + 1)],
            [residual_stage(layer, quarter, *first, seed + 2), residual_stage(layer, other, *second, seed + 3)])


def by_stages(plan, stages) -> None:
    plan.load_stages(stages)


def by_tables(plan, stages) -> None:
    tables = hand_tables(plan.experts, stages, plan.tables.stage_scale.shape[0], "cuda")
    plan.load_stage_tables(tables, MOE_ADDITIVE_ABI_VERSION)


def assert_swaps_replay_fresh_bytes(layer, T, sets, planned, **stage_args) -> None:
    """One plan of T tokens (planned(plan) holds), its run captured once; base -> each stage set -> base, each loaded
    between replays by load_stages and then by caller-built tables: both write the same tables, and every replay
    gives the bytes of an uncaptured run of a fresh plan made with those stages and the same arguments (which matches
    float64); the final base gives the first's bytes, and each stage set changes the output."""
    top_k, H = QWEN3["top_k"], layer.hidden_size
    plan = moe_plan(layer, T, top_k, out_dtype=torch.float16, **stage_args)
    assert planned(plan)
    runner = plan.bind(plan.allocate())
    x = (torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)) / 32).half()
    ids, weights = routing(T, layer.num_experts, top_k, T + 1)
    out = torch.empty(T, H, device="cuda", dtype=torch.float16)
    runner.run(x, ids, weights, out)
    graph = capture_allocation_free(lambda: runner.run(x, ids, weights, out), out)
    results = []
    for stages in ([], *sets, []):
        with_stages = ExpertSet(layer.gate, layer.up, layer.down, layer.activation, stages=stages)
        fresh = moe_plan(with_stages, T, top_k, out_dtype=torch.float16, **stage_args)
        eager = fresh.bind(fresh.allocate()).run(x, ids, weights, torch.empty_like(out))
        assert rel_l2(eager, moe(x, with_stages, ids, weights)) < 2e-3, len(results)
        tables = []
        for load in (by_stages, by_tables):
            load(plan, stages)
            tables.append(written(plan))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(bits(out), bits(eager)), (len(results), load.__name__)
        assert all(torch.equal(a, b) for a, b in zip(*tables, strict=True)), len(results)
        results.append(out.clone())
    assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])
    assert torch.equal(bits(results[0]), bits(results[-1]))


def test_caller_tables_give_load_stages_bytes_under_one_captured_graph(qwen3_layer):  # noqa: F811
    """The mixed Qwen3 layer at 16 tokens (route-packed mma.sync, route blocks of experts with a stage first):
    K2 MCG and K3 MUL1 stages by load_stages and by caller-built tables."""
    assert_swaps_replay_fresh_bytes(qwen3_layer, 16, stage_sets(qwen3_layer, 100, (2, "mcg"), (3, "mul1")),
                                    lambda plan: plan.mma is not None and plan.staged_order,
                                    stage_capacity=2, max_stage_bits=3, stage_codebooks=["mcg", "mul1"])


@pytest.mark.parametrize("T", [1, 2])
def test_direct_plan_stage_swaps_under_one_captured_graph(k4_layer, T):
    """A direct plan (8 or 16 slots, no route pack) of a K4 MCG base with K2 and K1 MCG stages."""
    assert_swaps_replay_fresh_bytes(k4_layer, T, stage_sets(k4_layer, 110 + T),
                                    lambda plan: plan.mma is not None and plan.mma.direct,
                                    stage_capacity=2, max_stage_bits=2)


def test_warp_specialized_plan_stage_swaps_under_one_captured_graph(k4_layer):
    """1024 tokens of a K4 MCG base on the warp-specialized experts (128-row route blocks) with K2 and K1 MCG stages:
    each replay must finish with every ring it waits on filled."""
    assert_swaps_replay_fresh_bytes(k4_layer, 1024, stage_sets(k4_layer, 120),
                                    lambda plan: plan.mma is not None and plan.mma.ws and plan.block_m == 128,
                                    stage_capacity=2, max_stage_bits=2)


@pytest.mark.parametrize("forced", ["env", "wide-stage"])
def test_triton_experts_stage_swaps_under_one_captured_graph(qwen3_layer, k4_layer, forced, monkeypatch):  # noqa: F811
    """The Triton experts, chosen by EXL3MOE_CUDA_KERNELS=0 (the mixed layer, K2 MCG and K3 MUL1 stages) or by a K6
    stage wider than the CUDA experts read (the K4 layer, K6 and K2 MCG stages)."""
    if forced == "env":
        monkeypatch.setenv("EXL3MOE_CUDA_KERNELS", "0")
        layer, sets, args = qwen3_layer, stage_sets(qwen3_layer, 130, (2, "mcg"), (3, "mul1")), dict(
            max_stage_bits=3, stage_codebooks=["mcg", "mul1"])
    else:
        layer, sets, args = k4_layer, stage_sets(k4_layer, 140, (6, "mcg"), (2, "mcg")), dict(max_stage_bits=6)
    assert_swaps_replay_fresh_bytes(layer, 16, sets, lambda plan: plan.mma is None, stage_capacity=2, **args)
