"""Residual-stage contract at plan level: invalid stages refused by moe_plan, caller-built stage tables
(MoEPlan.load_stage_tables) validated field by field, and stage scales at the ends of their range (interpreter)."""

import pytest
import torch

from exl3moe import MOE_ADDITIVE_ABI_VERSION, ContractError, ExpertSet
from exl3moe.format.codebook import CODEBOOK_ID
from exl3moe.ops import fused_experts, moe_plan
from exl3moe.ops.tables import PROJECTIONS
from exl3moe.reference import moe
from helpers import random_experts, random_stage, random_weight
from test_cuda_launch_glue import launches  # noqa: F401 (fixture: the CUDA plan's host side without a GPU)
from test_moe import check, inputs, pytestmark, rel_l2, routing  # noqa: F401 (pytestmark: interpreter only)

STAGE_FIELDS = ("stage_addr", "stage_k2", "stage_codebook", "stage_scale")


def hand_tables(experts: ExpertSet, stages: list, num_stages: int, device="cpu") -> dict:
    """The four stage tables of `stages` as docs/moe-tables.md lays them out, written entry by entry (entries of no
    residual hold nonsense formats beside a zero scale, which the plan must ignore)."""
    shape = (num_stages, 3, experts.num_experts)
    tables = {"stage_addr": torch.zeros(shape, dtype=torch.int64), "stage_k2": torch.full(shape, 99, dtype=torch.int32),
              "stage_codebook": torch.full(shape, 7, dtype=torch.int32), "stage_scale": torch.zeros(shape)}
    for s, stage in enumerate(stages):
        for p, proj in enumerate(PROJECTIONS):
            for e, r in enumerate(getattr(stage, proj) or []):
                if r is not None:
                    tables["stage_addr"][s, p, e] = r.trellis.data_ptr()
                    tables["stage_k2"][s, p, e] = int(2 * r.K)
                    tables["stage_codebook"][s, p, e] = CODEBOOK_ID[r.codebook]
                    tables["stage_scale"][s, p, e] = float(stage.scales[e, p])
    return {name: table.to(device) for name, table in tables.items()}


def written(plan) -> list:
    """Copies of everything a stage swap may write: the stage and bias tables and the route-block order."""
    t = plan.tables
    tables = [getattr(t, f) for f in (*STAGE_FIELDS, "bias_gate_up", "bias_down")] + [plan.expert_order]
    return [x.clone() for x in tables if x is not None]


def assert_unchanged(plan, before: list) -> None:
    assert all(torch.equal(a, b) for a, b in zip(written(plan), before, strict=True)), "a refusal must write nothing"


def two_experts(seed: int, **kwargs) -> ExpertSet:
    return random_experts(2, 128, 128, K=3, codebook="mcg", generator=torch.Generator().manual_seed(seed), **kwargs)


def force(record, **fields) -> None:
    """Change a frozen record's fields behind its back, past its own checks: the plan must refuse it too."""
    for field, value in fields.items():
        object.__setattr__(record, field, value)


def _wrong_shape(experts, stage):
    force(stage, up=(random_weight(256, 128, 2, generator=torch.Generator().manual_seed(1)),) + stage.up[1:])


def _short_list(experts, stage):
    force(stage, down=stage.down[:1])


def _half_k_mcg(experts, stage):
    r = random_weight(128, 128, 2.5, "mul1", generator=torch.Generator().manual_seed(2))
    residual = type(r)(r.trellis, experts.up[1].suh, experts.up[1].svh, "mul1")
    force(residual, codebook="mcg")
    force(stage, up=(stage.up[0], residual))


def _scales(value, shape=(2, 3)):
    def edit(experts, stage):
        force(stage, scales=torch.full(shape, value))
    return edit


@pytest.mark.parametrize("edit, name, rule", [
    (_wrong_shape, "experts.stages[0].up[0].trellis", "must describe a 128x128 weight"),
    (_short_list, "experts.stages[0].down", "has 1 entries, the set has 2 experts"),
    (_half_k_mcg, "experts.stages[0].up[1].trellis", "half-integer K=2.5 needs the mul1 codebook"),
    (_scales(0.5, (2, 2)), "experts.stages[0].scales", "must be a floating tensor [2, 3]"),
    (_scales(0.5, (3, 2)), "experts.stages[0].scales", "must be a floating tensor [2, 3]"),
    (_scales(float("inf")), "experts.stages[0].scales", "must be finite"),
    (_scales(float("nan")), "experts.stages[0].scales", "must be finite"),
    (_scales(2.0 ** 41), "experts.stages[0].scales", "[2^-40, 2^40]"),
    (_scales(-(2.0 ** -41)), "experts.stages[0].scales", "[2^-40, 2^40]"),
], ids=["residual-shape", "list-length", "half-K-mcg", "scales-shape", "scales-transposed", "inf", "nan", "huge",
        "tiny"])
def test_plan_refuses_stages_it_cannot_read(edit, name, rule):
    """moe_plan over an ExpertSet whose stage was changed to break a rule raises ContractError naming its field."""
    experts = two_experts(40)
    stage = random_stage(experts, torch.ones(2, 3), K=2, codebook="mcg", generator=torch.Generator().manual_seed(41))
    staged = experts.replace(stages=[stage])
    edit(experts, stage)
    with pytest.raises(ContractError) as err:
        moe_plan(staged, 4, 2)
    assert err.value.name == name and rule in err.value.rule, str(err.value)


def stage_sets(experts: ExpertSet, g: torch.Generator) -> tuple:
    """Set A: one K2 MCG stage; set B: a K3 MCG stage without expert 1 and a K2 MUL1 stage without down of 3."""
    scales_b = torch.rand(4, 3, generator=g)
    scales_b[1] = 0.0
    second = random_stage(experts, torch.rand(4, 3, generator=g), K=2, codebook="mul1", generator=g)
    second = second.replace(down=second.down[:3] + (None,))
    return ([random_stage(experts, torch.rand(4, 3, generator=g), K=2, codebook="mcg", generator=g)],
            [random_stage(experts, scales_b, K=3, codebook="mcg", generator=g), second])


def test_caller_tables_give_the_bytes_of_load_stages():
    """Stage sets written by hand through load_stage_tables: the plan's tables and outputs equal load_stages' with
    the same stages (and float64); all-zero scales restore the base bytes."""
    g = torch.Generator().manual_seed(42)
    experts = random_experts(4, 128, 128, K=[3, 4, 2, 4], codebook=["mcg", "mul1", "3inst", "mcg"], generator=g)
    plan = moe_plan(experts, 5, 2, stage_capacity=2, max_stage_bits=3, stage_codebooks=["mcg", "mul1"])
    runner = plan.bind(plan.allocate())
    hidden, (ids, weights) = inputs(5, 128, 43), routing(5, 2, 4, 44)

    def run():
        return runner.run(hidden, ids, weights, torch.full((5, 128), float("nan"), dtype=torch.float16))

    base = run()
    for stages in stage_sets(experts, g):
        plan.load_stages(stages)
        by_stages, tables = run(), written(plan)
        plan.load_stages([])
        plan.load_stage_tables(hand_tables(experts, stages, 2), MOE_ADDITIVE_ABI_VERSION)
        assert all(torch.equal(a, b) for a, b in zip(written(plan), tables, strict=True))
        by_tables = run()
        assert torch.equal(by_tables.view(torch.int16), by_stages.view(torch.int16))
        check(by_tables, hidden, ExpertSet(experts.gate, experts.up, experts.down, stages=stages), ids, weights)
    plan.load_stage_tables(hand_tables(experts, [], 2), MOE_ADDITIVE_ABI_VERSION)
    assert plan.experts.stages == () and torch.equal(run().view(torch.int16), base.view(torch.int16))


def _set(field, index, value):
    def edit(tables):
        tables[field][index] = value
    return edit


def _replace(field, make):
    def edit(tables):
        tables[field] = make(tables[field])
    return edit


def _drop(field):
    def edit(tables):
        del tables[field]
    return edit


def _add(field, value):
    def edit(tables):
        tables[field] = value
    return edit


def _null_pointer(tables):
    tables["stage_addr"][0, 1, 2] = 0


def _unaligned(tables):
    tables["stage_addr"][0, 2, 3] += 2


@pytest.mark.parametrize("edit, name, rule", [
    (_replace("stage_k2", lambda t: t.long()), "stage_k2", "must be torch.int32"),
    (_replace("stage_scale", lambda t: t.double()), "stage_scale", "must be torch.float32"),
    (_replace("stage_scale", lambda t: t[:1]), "stage_scale", "must have shape [2, 3, 4]"),
    (_replace("stage_addr", lambda t: t.reshape(2, 4, 3).transpose(1, 2)), "stage_addr", "contiguous"),
    (_replace("stage_codebook", lambda t: t.to("meta")), "stage_codebook", "is on meta"),
    (_replace("stage_scale", lambda t: [0.0] * 24), "stage_scale", "must be a tensor"),
    (_drop("stage_scale"), "stage_scale", "is missing"),
    (_add("stage_bits", torch.zeros(2, 3, 4)), "stage_bits", "is not a stage table of ABI version 1"),
    (_add("bias_down", torch.zeros(4, 128)), "bias_down", "the plan has no bias table"),
    (_set("stage_scale", (1, 2, 3), float("nan")), "stage_scale[1, 2, 3]", "must be finite"),
    (_set("stage_scale", (0, 0, 1), float("-inf")), "stage_scale[0, 0, 1]", "must be finite"),
    (_set("stage_scale", (1, 1, 0), 2.0 ** 41), "stage_scale[1, 1, 0]", "within [2^-40, 2^40]"),
    (_set("stage_scale", (0, 2, 2), -(2.0 ** -41)), "stage_scale[0, 2, 2]", "within [2^-40, 2^40]"),
    (_null_pointer, "stage_addr[0, 1, 2]", "must be nonzero where the scale is nonzero"),
    (_unaligned, "stage_addr[0, 2, 3]", "4-byte aligned"),
    (_set("stage_codebook", (1, 0, 2), 5), "stage_codebook[1, 0, 2]", "must be 0 (3inst), 1 (mcg) or 2 (mul1)"),
    (_set("stage_codebook", (1, 0, 2), 0), "stage_codebook[1, 0, 2]", "outside the plan's stage codebooks"),
    (_set("stage_k2", (0, 1, 2), 0), "stage_k2[0, 1, 2]", "must be a 2K in 2..16"),
    (_set("stage_k2", (0, 1, 2), 5), "stage_k2[0, 1, 2]", "half-integer K (odd 2K) needs the mul1 codebook"),
    (_set("stage_k2", (1, 2, 3), 8), "stage_k2[1, 2, 3]", "one of the plan's compiled stage formats"),
], ids=["k2-dtype", "scale-dtype", "shape", "strided", "device", "not-a-tensor", "missing", "unknown-table",
        "bias-without-table", "nan", "inf", "huge", "tiny", "null-pointer", "unaligned", "codebook-id",
        "codebook-not-compiled", "k2-range", "half-K-mcg", "K-too-wide"])
def test_caller_tables_refused_field_by_field(edit, name, rule):
    """Each broken field of caller-built tables raises ContractError naming the field (and entry) and writes
    nothing; the same tables unbroken load."""
    g = torch.Generator().manual_seed(45)
    experts = random_experts(4, 128, 128, K=3, codebook="mcg", generator=g)
    stages = [random_stage(experts, torch.rand(4, 3, generator=g) + 0.1, K=2, codebook="mcg", generator=g),
              random_stage(experts, torch.rand(4, 3, generator=g) + 0.1, K=3, codebook="mul1", generator=g)]
    plan = moe_plan(experts, 4, 2, stage_capacity=2, max_stage_bits=3, stage_codebooks=["mcg", "mul1"])
    before, tables = written(plan), hand_tables(experts, stages, 2)
    edit(tables)
    with pytest.raises(ContractError) as err:
        plan.load_stage_tables(tables, MOE_ADDITIVE_ABI_VERSION)
    assert err.value.name == name and rule in err.value.rule, str(err.value)
    assert_unchanged(plan, before)
    plan.load_stage_tables(hand_tables(experts, stages, 2), MOE_ADDITIVE_ABI_VERSION)
    assert plan.tables.stage_scale.count_nonzero() == 24


def test_caller_tables_refused_by_version_kind_and_plan():
    """Only version MOE_ADDITIVE_ABI_VERSION (an int, exactly) and a mapping are read; a plan without stage slots
    compiled no stage format, a non-gated plan reads no gate stage; bias tables of the plan's shape only."""
    g = torch.Generator().manual_seed(46)
    experts = two_experts(47)
    stage = random_stage(experts, torch.full((2, 3), 0.5), K=2, codebook="mcg", generator=g)
    plan = moe_plan(experts, 4, 2, stage_capacity=1)
    before = written(plan)
    for version in (MOE_ADDITIVE_ABI_VERSION + 1, 0, True, "1", 1.0, None):
        with pytest.raises(ContractError, match="must be exactly 1") as err:
            plan.load_stage_tables(hand_tables(experts, [stage], 1), version)
        assert err.value.name == "abi_version"
    with pytest.raises(ContractError, match="mapping") as err:
        plan.load_stage_tables(list(hand_tables(experts, [stage], 1).values()), MOE_ADDITIVE_ABI_VERSION)
    assert err.value.name == "tables"
    assert_unchanged(plan, before)
    without_slots = moe_plan(experts, 4, 2)
    with pytest.raises(ContractError, match=r"compiled stage formats \(\)") as err:
        without_slots.load_stage_tables(hand_tables(experts, [stage], 1), MOE_ADDITIVE_ABI_VERSION)
    assert err.value.name == "stage_k2[0, 0, 0]"
    relu2 = two_experts(48, activation="relu2")
    gate = hand_tables(experts, [stage], 1)
    non_gated = moe_plan(relu2, 4, 2, stage_capacity=1)
    with pytest.raises(ContractError, match="no gate") as err:
        non_gated.load_stage_tables(gate, MOE_ADDITIVE_ABI_VERSION)
    assert err.value.name == "stage_scale[0, 0, 0]"
    biased = moe_plan(two_experts(49, bias=True), 4, 2, stage_capacity=1)
    tables = hand_tables(experts, [], 1)
    for bias, name, rule in ((torch.zeros(128, 2), "bias_down", "must have shape [2, 128]"),
                             (torch.zeros(2, 2, 128, dtype=torch.float64), "bias_gate_up", "must be torch.float32"),
                             (torch.full((2, 2, 128), float("nan")), "bias_gate_up", "must be finite")):
        with pytest.raises(ContractError, match=rule.replace("[", r"\[")) as err:
            biased.load_stage_tables({**tables, name: bias}, MOE_ADDITIVE_ABI_VERSION)
        assert err.value.name == name
    down = torch.randn(2, 128, generator=g)
    biased.load_stage_tables({**tables, "bias_down": down}, MOE_ADDITIVE_ABI_VERSION)
    assert torch.equal(biased.tables.bias_down, down)


def test_caller_tables_rewrite_the_route_order_as_load_stages(launches):  # noqa: F811
    """A route-packed mma.sync plan of stages (host side only) orders experts of a nonzero scale first after
    load_stage_tables exactly as after load_stages, in the same tensor."""
    g = torch.Generator().manual_seed(50)
    experts = random_experts(8, 256, 256, K=4, codebook="mcg", generator=g)
    plan = moe_plan(experts, 20, 2, block_m=16, stage_capacity=1)
    order = plan.expert_order
    assert plan.staged_order and order.tolist() == list(range(8))
    for active in ([7], [3, 6], []):
        scales = torch.zeros(8, 3)
        scales[active, 2] = 0.25
        stages = [random_stage(experts, scales, K=2, codebook="mcg", generator=g)]
        plan.load_stages(stages)
        by_stages = order.tolist()
        plan.load_stages([])
        plan.load_stage_tables(hand_tables(experts, stages, 1), MOE_ADDITIVE_ABI_VERSION)
        assert plan.expert_order is order and order.tolist() == by_stages == active + [
            e for e in range(8) if e not in active]


def test_stage_scales_at_the_ends_of_their_range_keep_fp32_accuracy():
    """Stage scales of 2^30 (down) and 2^-30 (gate, up) on the Triton experts: R is never rounded to fp16 after
    scaling, so the huge scale does not overflow to inf (fp32 output against float64; beside its base a 2^-30
    residual lies below fp32 resolution, so that end checks only that nothing breaks)."""
    g = torch.Generator().manual_seed(51)
    experts = random_experts(2, 128, 128, K=4, codebook="mcg", generator=g)
    hidden, (ids, weights) = inputs(3, 128, 52), routing(3, 2, 2, 53)
    for down_scale in (2.0 ** 30, 2.0 ** -30):
        scales = torch.tensor([[2.0 ** -30, 2.0 ** -30, down_scale]] * 2)
        staged = ExpertSet(experts.gate, experts.up, experts.down,
                           stages=[random_stage(experts, scales, K=2, codebook="mcg", generator=g)])
        out = fused_experts(hidden, staged, ids, weights, out_dtype=torch.float32)
        assert torch.isfinite(out).all() and rel_l2(out, moe(hidden, staged, ids, weights)) < 2e-3, down_scale

