"""Fused MoE layouts the other MoE tests leave out, against the float64 oracle under the Triton interpreter:
gate, up and down of one expert in their own widths and codebooks, K = 2..8 in one layer, and top_k 5 to 7."""

import os

import pytest
import torch

from exl3moe import ExpertSet
from exl3moe.ops import fused_experts, moe_plan
from helpers import random_experts, random_weight
from test_moe import OTHER_CODEBOOK, OTHER_K, check, inputs, routing, run

# Per expert (cycled), each projection's (K, codebook): an expert's three differ in both; half-integer K in each.
PROJECTION_FORMATS = {"gate": [(2, "mcg"), (3.5, "mul1"), (8, "3inst"), (5, "mcg")],
                      "up": [(6, "3inst"), (4, "mcg"), (2.5, "mul1"), (7, "3inst")],
                      "down": [(1.5, "mul1"), (7, "3inst"), (3, "mcg"), (2, "mul1")]}
# Every integer width in one layer, each expert's codebook cycling through all three.
INTEGER_WIDTHS = [2, 3, 4, 5, 6, 7, 8]
INTEGER_WIDTH_CODEBOOKS = ["mcg", "3inst", "mul1", "3inst", "mcg", "mul1", "mcg"]

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under "
                                "TRITON_INTERPRET=1 (conftest sets it where no GPU is present)")


def projection_experts(make_weight, E: int, hidden: int, inter: int, formats: dict = PROJECTION_FORMATS) -> ExpertSet:
    """Silu experts whose projection p of expert e is make_weight(k, n, K, codebook, name) with formats[p][e % len]."""
    shapes = {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    weights = {p: [make_weight(*shapes[p], *formats[p][e % len(formats[p])], f"experts.{p}[{e}]") for e in range(E)]
               for p in shapes}
    return ExpertSet(weights["gate"], weights["up"], weights["down"], "silu")


def planned_k2(plan) -> list:
    """[[2K of gate, up, down] per expert] as the plan's tables hold them."""
    return plan.tables.k2.t().tolist()


def test_projections_of_one_expert_in_their_own_widths_and_codebooks():
    g = torch.Generator().manual_seed(40)
    experts = projection_experts(lambda k, n, K, cb, name: random_weight(k, n, K, cb, generator=g, name=name),
                                 4, 256, 128)
    plan = moe_plan(experts, 12, 2)
    assert planned_k2(plan) == [[int(2 * PROJECTION_FORMATS[p][e][0]) for p in ("gate", "up", "down")]
                                for e in range(4)]
    hidden = inputs(12, 256, 41)
    ids, weights = routing(12, 2, 4, 42)
    check(run(plan, hidden, ids, weights), hidden, experts, ids, weights)


def test_every_integer_width_in_one_layer():
    g = torch.Generator().manual_seed(43)
    experts = random_experts(7, 256, 128, K=INTEGER_WIDTHS, codebook=INTEGER_WIDTH_CODEBOOKS, generator=g)
    plan = moe_plan(experts, 10, 3)
    assert sorted({k2 // 2 for row in planned_k2(plan) for k2 in row}) == INTEGER_WIDTHS
    hidden = inputs(10, 256, 44)
    ids, weights = routing(10, 3, 7, 45)
    check(run(plan, hidden, ids, weights), hidden, experts, ids, weights)


@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize("top_k", [5, 6, 7])
def test_top_k_between_four_and_eight(top_k, T):
    g = torch.Generator().manual_seed(46 + top_k)
    experts = random_experts(8, 128, 128, K=OTHER_K, codebook=OTHER_CODEBOOK, generator=g)
    hidden = inputs(T, 128, 47)
    ids, weights = routing(T, top_k, 8, 48 + T)
    check(fused_experts(hidden, experts, ids, weights), hidden, experts, ids, weights)
