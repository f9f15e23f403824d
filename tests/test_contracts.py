"""Weights that cannot go stale, outputs whose rows do not overlap, workspaces checked in every bind (issue 51).

Small shapes (k = n = 128, two experts) on the CPU, where kernels run under the interpreter (TRITON_INTERPRET=1) or
on the torch path, and on the GPU (`gpu`). Each refusal is checked for its type, the tensor it names and its rule.
"""

import copy
import dataclasses
import pickle

import pytest
import torch

from exl3moe import ContractError, EXL3Weight, ExpertSet, FormatError, ResidualStage, reference
from exl3moe.format.frozen import FrozenFieldError
from exl3moe.ops import linear as linear_ops
from exl3moe.ops.linear import LinearPlan, dense_weight, linear
from exl3moe.ops.modules import EXL3Linear
from exl3moe.ops.moe import moe_plan
from exl3moe.ops.moe_module import EXL3MoE
from exl3moe.ops.router import Router
from helpers import random_experts, random_scales, random_stage, random_weight

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
KERNELS = ("trellis_decode", "hadamard128", "trellis_matmul", "trellis_epilogue", "linear_torch", "rotate_input",
           "trellis_mma")


def weight(bias: bool = True, seed: int = 0, device: str = "cpu") -> EXL3Weight:
    return random_weight(128, 128, 2, "mcg", bias=bias, generator=torch.Generator().manual_seed(seed)).to(device)


def inputs(rows: int, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    return torch.randn(rows, 128, generator=torch.Generator().manual_seed(seed)).half().to(device)


def two_experts(seed: int, device: str = "cpu") -> ExpertSet:
    return random_experts(2, 128, 128, K=2, generator=torch.Generator().manual_seed(seed)).to(device)


def no_kernels(monkeypatch) -> None:
    """Every compute path of the linear op raises: a refusal must come before any of them."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel ran before the refusal")
    for name in KERNELS:
        monkeypatch.setattr(linear_ops, name, launched)


def refused(call, name: str, rule: str, kinds=(FormatError, ContractError)):
    with pytest.raises(kinds) as err:
        call()
    assert err.value.name == name and rule in err.value.rule, str(err.value)
    return err.value


# --- frozen records ---------------------------------------------------------------------------------------------------

def test_weight_fields_cannot_be_assigned_and_say_how_to_copy():
    w = weight()
    for field in ("trellis", "suh", "svh", "codebook", "bias", "name"):
        with pytest.raises(FrozenFieldError) as err:
            setattr(w, field, getattr(w, field))
        assert isinstance(err.value, AttributeError) and isinstance(err.value, ContractError)
        assert err.value.name == f"weight.{field}" and f".replace({field}=...)" in err.value.rule
    with pytest.raises(FrozenFieldError):
        del w.suh


def test_modified_copy_is_validated_and_shares_untouched_tensors():
    w = weight()
    svh = random_scales(128, torch.Generator().manual_seed(5))
    copied = w.replace(svh=svh)
    assert copied.svh is svh and copied.trellis is w.trellis and w.svh is not svh
    assert dataclasses.replace(w, codebook="3inst").codebook == "3inst"
    x = inputs(3)
    assert torch.equal(linear(x, copied), linear(x, EXL3Weight(w.trellis, w.suh, svh, "mcg", w.bias)))
    refused(lambda: w.replace(suh=w.suh[:64]), "weight.suh", "must have shape [128], got [64]", FormatError)
    refused(lambda: dataclasses.replace(w, bias=w.bias[:64]), "weight.bias", "shape [128]", FormatError)
    refused(lambda: w.replace(trellis=w.trellis.view(torch.int32)), "weight.trellis", "int16", FormatError)
    err = refused(lambda: w.replace(codebook="xyz"), "weight.codebook", "'xyz'", FormatError)
    assert all(cb in err.rule for cb in ("3inst", "mcg", "mul1")), "the allowed codebooks are named"


def test_copies_and_moves_keep_a_valid_weight():
    w = weight()
    for other in (copy.copy(w), copy.deepcopy(w), pickle.loads(pickle.dumps(w)), w.to("cpu")):
        assert other.ensure_valid() == other.fingerprint()
        assert torch.equal(other.inner(), w.inner())
        with pytest.raises(FrozenFieldError):
            other.suh = w.suh


def test_expert_sets_and_stages_are_frozen_with_tuples():
    experts = random_experts(2, 128, 128, K=2, generator=torch.Generator().manual_seed(2))
    assert isinstance(experts.up, tuple) and experts.stages == ()
    with pytest.raises(FrozenFieldError, match=r"\.replace\(stages=\.\.\.\)"):
        experts.stages = []
    with pytest.raises(TypeError):
        experts.up[0] = experts.up[1]
    stage = random_stage(experts, torch.ones(2, 3), generator=torch.Generator().manual_seed(3))
    with pytest.raises(FrozenFieldError, match="stage.scales"):
        stage.scales = torch.zeros(2, 3)
    staged = experts.replace(stages=[stage])
    assert staged.stages == (stage,) and staged.up is experts.up and experts.stages == ()
    refused(lambda: stage.replace(down=stage.down[:1]), "stage.down", "has 1 entries, gate has 2", FormatError)
    refused(lambda: stage.replace(up=[stage.up[0], "w"]), "stage.up[1]", "must be an EXL3Weight or None",
            FormatError)
    refused(lambda: experts.replace(up=list(experts.up[:1])), "experts.gate", "has 2 experts, up has 1",
            FormatError)


@pytest.mark.parametrize("limit", ["7", True, float("nan"), float("inf"), 0, -1.0, [7]])
def test_expert_set_limit_must_be_a_positive_finite_number(limit):
    experts = random_experts(2, 128, 128, K=2, generator=torch.Generator().manual_seed(4))
    refused(lambda: experts.replace(limit=limit), "experts.limit", "positive finite number", ContractError)
    assert experts.replace(limit=7).limit == 7


# --- weights changed behind their back --------------------------------------------------------------------------------

def _short_suh(w):
    object.__setattr__(w, "suh", w.suh[:64])


def _short_bias(w):
    object.__setattr__(w, "bias", w.bias[:64].clone())


def _int32_trellis(w):
    object.__setattr__(w, "trellis", w.trellis.view(torch.int32))


def _unknown_codebook(w):
    object.__setattr__(w, "codebook", "xyz")


def _suh_shrunk_in_place(w):
    w.suh.set_(torch.ones(64, dtype=torch.float16, device=w.device))


def _svh_expanded_in_place(w):
    w.svh.set_(w.svh.untyped_storage(), 0, (128,), (0,))


STALE = {   # change -> (the tensor named, its rule)
    "short suh": (_short_suh, "weight.suh", "must have shape [128], got [64]"),
    "short bias": (_short_bias, "weight.bias", "must have shape [128], got [64]"),
    "int32 trellis": (_int32_trellis, "weight.trellis", "must be int16"),
    "codebook xyz": (_unknown_codebook, "weight.codebook", "must be one of ('3inst', 'mcg', 'mul1'), got 'xyz'"),
    "suh shrunk in place": (_suh_shrunk_in_place, "weight.suh", "must have shape [128], got [64]"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", sorted(STALE))
def test_changed_weight_is_refused_by_every_linear_entry_before_any_kernel(change, device, monkeypatch):
    edit, name, rule = STALE[change]
    w = weight(device=device)
    module = EXL3Linear(w, 4)
    plan = LinearPlan(w, 4)
    runner = plan.bind(plan.allocate())
    workspace = plan.allocate()
    edit(w)
    no_kernels(monkeypatch)
    x, out = inputs(4, device=device), torch.empty(4, 128, dtype=torch.float16, device=device)
    calls = {"linear": lambda: linear(x, w), "linear(out=)": lambda: linear(x, w, out=out),
             "dense_weight": lambda: dense_weight(w), "EXL3Linear": lambda: module(x),
             "EXL3Linear(out=)": lambda: module(x, out=out), "LinearPlan": lambda: LinearPlan(w, 4),
             "bind": lambda: plan.bind(workspace), "run": lambda: runner.run(x, out)}
    for entry, call in calls.items():
        err = refused(call, name, rule)
        assert "changed after it was validated" in err.rule, (entry, str(err))


def test_expanded_scale_in_place_is_refused_as_not_contiguous(monkeypatch):
    w = weight()
    _svh_expanded_in_place(w)
    no_kernels(monkeypatch)
    refused(lambda: linear(inputs(2), w), "weight.svh", "must be contiguous", ContractError)


def test_valid_change_is_validated_once_and_replanned_by_modules_and_the_cache(monkeypatch):
    w = weight()
    x, out = inputs(3), torch.empty(3, 128, dtype=torch.float16)
    module = EXL3Linear(w, 4)
    plan = LinearPlan(w, 4)
    runner = plan.bind(plan.allocate())
    module(x), linear(x, w, out=out)
    svh = random_scales(128, torch.Generator().manual_seed(9))
    object.__setattr__(w, "svh", svh)
    validations = []
    validate = EXL3Weight.validate
    monkeypatch.setattr(EXL3Weight, "validate", lambda self: (validations.append(self.name), validate(self))[1])
    expected = linear(x, EXL3Weight(w.trellis, w.suh, svh, "mcg", w.bias))
    assert torch.equal(module(x), expected), "the module re-planned for the new svh"
    assert torch.equal(linear(x, w, out=out), expected), "the cached runner re-planned"
    refused(lambda: runner.run(x, out), "weight", "changed after the plan was made", ContractError)
    assert validations == ["weight", "weight"], "the changed weight validated once, the new copy once"
    for _ in range(3):
        module(x), linear(x, w, out=out)
    assert len(validations) == 2, "an unchanged weight is not validated again"
    reassigned = weight(seed=3)
    module.weight = reassigned
    assert torch.equal(module(x), linear(x, reassigned)), "a reassigned module weight is planned for"


@pytest.mark.parametrize("device", DEVICES)
def test_moe_plan_refuses_a_changed_expert_and_bind_a_changed_plan(device):
    experts = two_experts(6, device)
    plan = moe_plan(experts, 4, 2)
    suh = experts.up[1].suh
    object.__setattr__(experts.up[1], "suh", suh[:64])
    refused(lambda: moe_plan(experts, 4, 2), "experts.up[1]", "suh/svh must have 128/128 elements", ContractError)
    refused(lambda: plan.bind(plan.allocate()), "experts", "changed after the plan was made", ContractError)
    object.__setattr__(experts.up[1], "suh", random_scales(128, torch.Generator().manual_seed(7)).to(device))
    refused(lambda: plan.bind(plan.allocate()), "experts", "changed after the plan was made", ContractError)
    assert moe_plan(experts, 4, 2).bind(plan.allocate()) is not None, "a new plan takes the changed (valid) set"
    object.__setattr__(experts.up[1], "suh", suh)
    assert plan.bind(plan.allocate()) is not None, "the tensors the plan was made for"


def test_moe_plan_refuses_non_finite_scales_changed_in_place_of_a_field():
    experts = two_experts(8)
    object.__setattr__(experts.down[0], "svh", torch.full((128,), float("nan"), dtype=torch.float16))
    refused(lambda: moe_plan(experts, 4, 2), "experts.down[0].svh", "must be finite", FormatError)


def test_linear_plan_arguments_are_checked_by_type():
    w = weight()
    refused(lambda: LinearPlan(w, True), "max_rows", "positive int", ContractError)
    refused(lambda: LinearPlan(w, 4, tiles=(128, 64, 1)), "tiles", "LinearTiles", ContractError)
    refused(lambda: EXL3Linear("w", 4), "w", "must be an EXL3Weight", ContractError)


# --- outputs ----------------------------------------------------------------------------------------------------------

def overlapping_outputs(rows: int, n: int, device: str) -> dict:
    return {"expanded": torch.zeros(1, n, dtype=torch.float16, device=device).expand(rows, n),
            "rows 64 apart": torch.zeros(rows * 64 + n, dtype=torch.float16, device=device).as_strided((rows, n),
                                                                                                    (64, 1))}


def half(*shape, device: str) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.float16, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_refuses_overlapping_output_rows_everywhere(device, monkeypatch):
    w = weight(device=device)
    module = EXL3Linear(w, 4)
    runner = LinearPlan(w, 4).bind(LinearPlan(w, 4).allocate())
    no_kernels(monkeypatch)
    x = inputs(4, device=device)
    for kind, out in overlapping_outputs(4, 128, device).items():
        for call in (lambda: linear(x, w, out=out), lambda: module(x, out=out), lambda: runner.run(x, out)):
            refused(call, "out", "rows overlap", ContractError)
    for call in (lambda: linear(x, w, out=half(3, 128, device=device)),
                 lambda: runner.run(x, half(5, 128, device=device))):
        refused(call, "out", "row count", ContractError)
    refused(lambda: linear(x, w, out=half(4, 256, device=device)[:, :128]), "out", "must be contiguous",
            ContractError)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_run_refuses_overlapping_output_rows_and_accepts_padded_ones(device):
    experts = two_experts(10, device)
    plan = moe_plan(experts, 4, 2, out_dtype=torch.float16)
    runner = plan.bind(plan.allocate())
    x = inputs(4, 11, device)
    ids, weights = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]], device=device), torch.full((4, 2), 0.5, device=device)
    for kind, out in overlapping_outputs(4, 128, device).items():
        refused(lambda: runner.run(x, ids, weights, out), "out", "rows overlap: row stride", ContractError)
    cases = [((x, ids, weights, half(3, 128, device=device)), "out", "row count must be 4"),
             ((x, ids[:3], weights, half(4, 128, device=device)), "topk_ids", "row count must be 4"),
             ((x, ids, weights[:, :1], half(4, 128, device=device)), "topk_weights", "column count must be 2"),
             ((x, ids, weights, half(4, 256, device=device)[:, ::2]), "out", "columns must be contiguous"),
             ((x[:, None], ids, weights, half(4, 128, device=device)), "hidden", "must be 2-D")]
    for args, name, rule in cases:
        refused(lambda: runner.run(*args), name, rule, ContractError)
    padded = torch.full((4, 256), float("nan"), dtype=torch.float16, device=device)
    runner.run(x, ids, weights, padded[:, :128])
    packed = runner.run(x, ids, weights, half(4, 128, device=device))
    assert torch.equal(padded[:, :128], packed) and padded[:, 128:].isnan().all()
    expected = reference.moe(x, experts, ids, weights).double()
    assert float((packed.double() - expected).norm() / expected.norm()) < 2e-3


@pytest.mark.parametrize("device", DEVICES)
def test_moe_module_refuses_overlapping_output_rows(device):
    router = Router(torch.randn(2, 128, generator=torch.Generator().manual_seed(13)).half().to(device), 2)
    module = EXL3MoE(two_experts(12, device), router, max_tokens=4)
    for kind, out in overlapping_outputs(4, 128, device).items():
        refused(lambda: module(inputs(4, 14, device), out=out), "out", "rows overlap", ContractError)


# --- workspaces -------------------------------------------------------------------------------------------------------

def bad_workspaces(nbytes: int, device: str) -> dict:
    def raw(size, dtype=torch.uint8, on=device):
        return torch.empty(size, dtype=dtype, device=on)
    return {"stride 2": (raw(2 * nbytes)[::2], "must be contiguous (stride 1)"),
            "1 byte off": (raw(nbytes + 16)[1:], "16-byte aligned address, got one 1 "),
            "2 bytes off": (raw(nbytes + 16)[2:], "16-byte aligned address, got one 2 "),
            "int8": (raw(nbytes, torch.int8), "dtype must be uint8"),
            "2-D": (raw((1, nbytes)), "1-D"),
            "short": (raw(nbytes - 1), f"needs {nbytes} bytes"),
            "meta": (raw(nbytes, on="meta"), "is on meta")}


@pytest.mark.parametrize("device", DEVICES)
def test_every_bind_checks_workspace_stride_alignment_dtype_and_device(device):
    plans = {"LinearPlan": LinearPlan(weight(device=device), 4), "MoEPlan": moe_plan(two_experts(15, device), 4, 2)}
    for kind, plan in plans.items():
        for case, (workspace, rule) in bad_workspaces(plan.workspace_bytes, device).items():
            refused(lambda: plan.bind(workspace), "workspace", rule, ContractError)
        aligned = torch.empty(plan.workspace_bytes + 32, dtype=torch.uint8, device=device)[16:]
        assert plan.bind(aligned) is not None, kind
