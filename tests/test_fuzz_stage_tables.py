"""MoEPlan.load_stage_tables fuzzed: caller-built stage tables with mutated dtypes, shapes, devices, layouts, values,
fields and ABI versions. A table set that follows docs/moe-tables.md (restated here independently) is loaded exactly;
any other is refused with ContractError and leaves every device table of the plan byte for byte as it was."""

import dataclasses
import types
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from exl3moe import MOE_ADDITIVE_ABI_VERSION, ContractError
from exl3moe.ops import moe_plan
from helpers import random_experts, random_stage
from test_fuzz_safetensors import fuzz_settings
from test_moe import pytestmark  # noqa: F401 (interpreter only: caller-built tables need the kernels)
from test_stage_contract import hand_tables

STAGE_DTYPES = {"stage_addr": torch.int64, "stage_k2": torch.int32, "stage_codebook": torch.int32,
                "stage_scale": torch.float32}
BIASES = ("bias_gate_up", "bias_down")
EMPTY = {"stage_addr": 0, "stage_k2": 2, "stage_codebook": 0, "stage_scale": 0.0}
OTHER_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64, torch.complex64]


@pytest.fixture(scope="module")
def plans():
    """[(plan, valid stage tables)]: a gated plan with bias tables and two stage slots (K up to 3, mcg and mul1),
    and a non-gated relu2 plan without biases and one slot (K = 2, mcg)."""
    g = torch.Generator().manual_seed(60)
    gated = random_experts(4, 128, 128, K=3, codebook="mcg", bias=True, generator=g)
    relu2 = random_experts(2, 128, 128, K=2, codebook="mul1", activation="relu2", generator=g)
    stages = [random_stage(gated, torch.rand(4, 3, generator=g) + 0.1, K=2, codebook="mcg", generator=g),
              random_stage(gated, torch.rand(4, 3, generator=g) + 0.1, K=3, codebook="mul1", generator=g)]
    scales = torch.rand(2, 3, generator=g) + 0.1
    scales[:, 0] = 0.0
    relu2_stage = random_stage(relu2, scales, K=2, codebook="mcg", generator=g)
    return [(moe_plan(gated, 4, 2, stage_capacity=2, max_stage_bits=3, stage_codebooks=["mcg", "mul1"]),
             hand_tables(gated, stages, 2), (gated, stages)),
            (moe_plan(relu2, 4, 2, stage_capacity=1), hand_tables(relu2, [relu2_stage], 1), (relu2, [relu2_stage]))]


def snapshot(plan) -> dict:
    """Every device table of the plan (and its route-block order) as bytes."""
    tensors = {f.name: getattr(plan.tables, f.name) for f in dataclasses.fields(plan.tables)}
    tensors["expert_order"] = plan.expert_order
    return {name: (t.dtype, tuple(t.shape), t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def _dense(t, dtype, plan) -> bool:
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested and t.dtype == dtype
            and t.device == plan.device and t.is_contiguous())


def follows_the_contract(plan, tables, version) -> bool:
    """docs/moe-tables.md, restated: the exact version, a mapping of the four stage tables (and the plan's bias
    tables only), dense contiguous tensors of the right dtype, device and shape, and every entry of nonzero scale
    finite, within 2^-40..2^40, on a positive 4-byte aligned address, of a compiled stage format, never on the gate
    of a non-gated plan."""
    if type(version) is not int or version != MOE_ADDITIVE_ABI_VERSION or not isinstance(tables, Mapping):
        return False
    t = plan.tables
    if not set(STAGE_DTYPES) <= set(tables) <= set(STAGE_DTYPES) | {b for b in BIASES if getattr(t, b) is not None}:
        return False
    for field, dtype in STAGE_DTYPES.items():
        if not _dense(tables[field], dtype, plan) or tables[field].shape != t.stage_scale.shape:
            return False
    for field in set(tables) & set(BIASES):
        bias = tables[field]
        if not _dense(bias, torch.float32, plan) or bias.shape != getattr(t, field).shape:
            return False
        if not torch.isfinite(bias).all():
            return False
    scale, addr = tables["stage_scale"].detach().double(), tables["stage_addr"]
    for s, p, e in (scale != 0).nonzero().tolist():
        fmt = (int(tables["stage_k2"][s, p, e]), int(tables["stage_codebook"][s, p, e]))
        v, a = float(scale[s, p, e]), int(addr[s, p, e])
        if not (2.0 ** -40 <= abs(v) <= 2.0 ** 40) or a <= 0 or a % 4 or fmt not in plan.stage_formats:
            return False
        if p == 0 and not t.gated:
            return False
    return True


def expected_tables(plan, tables, before: dict) -> dict:
    """What an accepted load leaves in the plan: the caller's entries of nonzero scale, empty ones elsewhere, the
    caller's bias tables where given, every other table unchanged."""
    after = dict(before)
    active = tables["stage_scale"] != 0
    for field, dtype in STAGE_DTYPES.items():
        t = torch.where(active, tables[field].detach(), torch.tensor(EMPTY[field], dtype=dtype)).contiguous()
        after[field] = (dtype, tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
    for field in set(tables) & set(BIASES):
        t = tables[field].detach().contiguous()
        after[field] = (t.dtype, tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
    return after


SCALES = st.sampled_from([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 2.0 ** -40, -(2.0 ** -40),
                          2.0 ** 40, 2.0 ** -41, 2.0 ** 41, 1e-45, 3.4e38, 1.0, -0.5]) | st.floats(-4, 4, width=32)
ADDRESSES = (st.sampled_from([0, 1, 2, 4, -4, -1, -(1 << 40), 1 << 62, -(1 << 63), (1 << 63) - 1])
             | st.integers(-(1 << 48), 1 << 48))
FORMAT_IDS = st.sampled_from([-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 99]) | st.integers(-(1 << 31), (1 << 31) - 1)
VALUES = {"stage_scale": SCALES, "stage_addr": ADDRESSES, "stage_k2": FORMAT_IDS, "stage_codebook": FORMAT_IDS}


def _pick(draw, tables, dtype_of_field: bool = False):
    """A stage field that still holds a plain CPU tensor of at least one dim (of its own dtype if asked), or None."""
    fields = [f for f in sorted(STAGE_DTYPES) if isinstance(tables.get(f), torch.Tensor) and tables[f].dim() > 0
              and tables[f].layout == torch.strided and not tables[f].is_nested and tables[f].device.type == "cpu"
              and not tables[f].requires_grad and (tables[f].dtype == STAGE_DTYPES[f] or not dtype_of_field)]
    return draw(st.sampled_from(fields)) if fields else None


def _entry(draw, plan, tables):
    field = _pick(draw, tables, dtype_of_field=True)
    if field:
        index = tuple(draw(st.integers(0, n - 1)) for n in tables[field].shape)
        tables[field][index] = draw(VALUES[field])


def _shift_address(draw, plan, tables):
    if _pick(draw, tables, dtype_of_field=True) == "stage_addr":
        addr = tables["stage_addr"]
        addr[tuple(draw(st.integers(0, n - 1)) for n in addr.shape)] += draw(st.sampled_from([1, 2, 3, 4, -4]))


def _fill(draw, plan, tables):
    field = _pick(draw, tables, dtype_of_field=True)
    if field:
        tables[field].fill_(draw(VALUES[field]))


def _dtype(draw, plan, tables):
    field = _pick(draw, tables)
    if field:
        tables[field] = tables[field].to(draw(st.sampled_from(OTHER_DTYPES)))


def _shape(draw, plan, tables):
    field = _pick(draw, tables)
    if field:
        t = tables[field]
        shapes = [lambda: t[:1], lambda: t.unsqueeze(0), lambda: t.flatten(), lambda: t.reshape(-1, 1),
                  lambda: torch.cat([t, t]), lambda: t[0], lambda: t.reshape(-1)[0]]
        shapes += [lambda: t[:, :2], lambda: t.transpose(0, 1).contiguous()] if t.dim() > 1 else []
        tables[field] = draw(st.sampled_from(shapes))()


def _layout(draw, plan, tables):
    """The same values and shape, but strided, expanded, transposed back, sparse, nested, on meta or a grad leaf."""
    field = _pick(draw, tables)
    if field:
        t = tables[field]
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        choices = {"strided": lambda: wide[..., ::2], "expanded": lambda: t[:1].expand(t.shape),
                   "transposed": lambda: t.transpose(0, -1).contiguous().transpose(0, -1),
                   "sparse": lambda: t.to_sparse(), "meta": lambda: t.to("meta"),
                   "nested": lambda: torch.nested.nested_tensor(list(t)),
                   "grad": lambda: t.clone().requires_grad_() if t.is_floating_point() else t}
        tables[field] = choices[draw(st.sampled_from(sorted(choices)))]()


def _not_a_tensor(draw, plan, tables):
    field = _pick(draw, tables)
    if field:
        t = tables[field]
        tables[field] = draw(st.sampled_from([t.numpy(), t.tolist(), None, 0, "tensor"]))


def _fields(draw, plan, tables):
    """A field dropped, an unknown one added, or a bias table (of the plan's shape or not, finite or not)."""
    t = plan.tables
    choice = draw(st.sampled_from(["drop", "unknown", "bias"]))
    if choice == "drop":
        del tables[draw(st.sampled_from(sorted(tables, key=str)))]
    elif choice == "unknown":
        tables[draw(st.sampled_from(["stage_bits", "trellis_addr", "k2", 3, ("stage_scale",)]))] = torch.zeros(1)
    else:
        field = draw(st.sampled_from(BIASES))
        shape = tuple(getattr(t, field).shape) if getattr(t, field) is not None else (2, 128)
        shape = draw(st.sampled_from([shape, shape[::-1], shape[1:]]))
        bias = torch.randn(shape).to(draw(st.sampled_from([torch.float32, torch.float32, torch.float16])))
        if draw(st.booleans()):
            bias.view(-1)[0] = draw(st.sampled_from([float("nan"), float("inf"), 1.0]))
        tables[field] = bias.requires_grad_(draw(st.booleans()))


EDITS = [_entry, _entry, _entry, _shift_address, _fill, _dtype, _shape, _layout, _not_a_tensor, _fields, _fields]
VERSIONS = st.sampled_from([MOE_ADDITIVE_ABI_VERSION, 0, 2, True, 1.0, "1", None, np.int64(1), 1 << 64])
CONTAINERS = st.sampled_from([types.MappingProxyType, lambda d: list(d.items()), lambda d: list(d.values()), tuple])


@pytest.mark.filterwarnings("ignore:.*(nested|Sparse|Casting complex).*:UserWarning")
@fuzz_settings(200)
@given(data=st.data())
def test_mutated_tables_load_exactly_or_are_refused_untouched(plans, data):
    """0-3 edits of valid caller tables, any ABI version and container: loaded with exactly the documented result
    when they follow the contract, else ContractError with every device table byte-identical."""
    plan, valid, _ = plans[data.draw(st.integers(0, len(plans) - 1))]
    tables = {name: t.clone() for name, t in valid.items()}
    for _ in range(data.draw(st.integers(0, 3))):
        data.draw(st.sampled_from(EDITS))(data.draw, plan, tables)
    version = data.draw(VERSIONS) if data.draw(st.integers(0, 7)) == 0 else MOE_ADDITIVE_ABI_VERSION
    container = data.draw(CONTAINERS)(tables) if data.draw(st.integers(0, 7)) == 0 else tables
    lawful = follows_the_contract(plan, container, version)
    before = snapshot(plan)
    try:
        plan.load_stage_tables(container, version)
    except ContractError as err:
        event(f"refused: {err.rule[:40]}")
        assert err.name and err.rule
        assert snapshot(plan) == before, "a refusal wrote into the plan"
        assert not lawful, f"tables that follow the contract were refused: {err}"
        return
    event("loaded")
    assert lawful, "tables that break the contract were loaded"
    assert snapshot(plan) == expected_tables(plan, tables, before)
    assert not any(getattr(plan.tables, b).requires_grad for b in BIASES if getattr(plan.tables, b) is not None)


def test_valid_tables_reload_the_stages(plans):
    """The unmutated tables load and restore exactly the tables load_stages writes for the same stages; the plans
    compiled the documented formats (every 2K up to the stage limit in their codebooks, odd 2K with mul1 only)."""
    assert plans[0][0].stage_formats == ((2, 1), (2, 2), (3, 2), (4, 1), (4, 2), (5, 2), (6, 1), (6, 2))
    assert plans[1][0].stage_formats == ((2, 1), (4, 1))
    for plan, valid, (_, stages) in plans:
        plan.load_stages(stages)
        by_stages = snapshot(plan)
        plan.load_stages([])
        plan.load_stage_tables(dict(valid), MOE_ADDITIVE_ABI_VERSION)
        assert snapshot(plan) == by_stages


def _with(valid: dict, **changes) -> dict:
    return {**{name: t.clone() for name, t in valid.items()}, **changes}


@pytest.mark.filterwarnings("ignore:.*(nested|Sparse).*:UserWarning")
def test_refusals_found_by_fuzzing(plans):
    """Cases the property found before they were refused: a negative address (aligned, of nonzero scale), sparse and
    nested tables (RuntimeError from is_contiguous / sizes), each refused with nothing written."""
    plan, valid, _ = plans[0]
    addr = valid["stage_addr"].clone()
    addr[1, 2, 3] = -(1 << 40)
    for tables, name, rule in ((_with(valid, stage_addr=addr), "stage_addr[1, 2, 3]", "must not be negative"),
                               (_with(valid, stage_scale=valid["stage_scale"].to_sparse()), "stage_scale", "dense"),
                               (_with(valid, stage_k2=valid["stage_k2"][0].to_sparse_csr()), "stage_k2", "dense"),
                               (_with(valid, stage_codebook=torch.nested.nested_tensor(list(valid["stage_codebook"]))),
                                "stage_codebook", "dense")):
        before = snapshot(plan)
        with pytest.raises(ContractError, match=rule) as err:
            plan.load_stage_tables(tables, MOE_ADDITIVE_ABI_VERSION)
        assert err.value.name == name and snapshot(plan) == before


def test_bias_of_a_grad_leaf_is_copied_without_its_history(plans):
    """A caller's bias that requires grad is loaded by value: the plan's table joins no autograd graph, and a later
    in-place change of the caller's tensor does not reach the plan."""
    plan, valid, _ = plans[0]
    bias = torch.randn(plan.tables.bias_down.shape, requires_grad=True)
    plan.load_stage_tables(_with(valid, bias_down=bias), MOE_ADDITIVE_ABI_VERSION)
    assert not plan.tables.bias_down.requires_grad and plan.tables.bias_down.grad_fn is None
    assert torch.equal(plan.tables.bias_down, bias.detach())
