"""The host side of the CUDA C++ kernels without a GPU: every launch passes as many arguments, of the kinds
(pointer, int, float), as its kernel's signature in kernels/cuda/*.cu declares, with grids that cover the plan."""

import re

import pytest
import torch

from exl3moe.kernels import nvrtc
from exl3moe.ops.moe import moe_plan
from helpers import random_experts, random_stage, random_weight


def signature(file: str, name: str) -> list:
    """'ptr' / 'int' / 'float' for each parameter of extern "C" kernel `name` in kernels/cuda/`file`."""
    text = nvrtc.source(file)
    match = re.search(r"\n" + name + r"\(([^)]*)\)\s*\{", text)
    assert match, f"{name} not found in {file}"
    kinds = []
    for param in match.group(1).split(","):
        param = " ".join(param.split())
        kinds.append("ptr" if "*" in param else "float" if param.startswith("float") else "int")
    return kinds


def kind(arg) -> str:
    if arg is None or isinstance(arg, torch.Tensor):
        return "ptr"
    assert not isinstance(arg, bool), "pass flags as int"
    return "float" if isinstance(arg, float) else "int"


@pytest.fixture
def launches(monkeypatch):
    """Pretend the CUDA kernels are available: compiling returns (file, name); launches are recorded."""
    recorded = []
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    monkeypatch.setattr(nvrtc, "kernel", lambda file, name, defines, index, prelude="": (file, name, prelude))
    monkeypatch.setattr(nvrtc, "launch", lambda func, grid, block, args: recorded.append((func, grid, block, args)))
    return recorded


def check(recorded):
    for (file, name, _), grid, block, args in recorded:
        assert [kind(a) for a in args] == signature(file, name), name
        assert all(g >= 1 for g in grid) and block % 32 == 0 and block <= 1024, (name, grid, block)


@pytest.mark.parametrize("T, block_m", [(3, None), (40, 64), (70, 128)])
def test_moe_launches_match_the_kernel_signatures(launches, T, block_m):
    g = torch.Generator().manual_seed(3)
    experts = random_experts(8, 256, 384, K=[4, 2.5, 3, 2] * 2, codebook=["mcg", "mul1", "3inst", "mcg"] * 2, bias=True,
                             generator=g)
    shared = random_experts(1, 256, 256, K=3, codebook="mcg", generator=g, name="shared")
    stage = random_stage(experts, torch.rand(8, 3, generator=g), K=2, codebook="mcg", generator=g)
    layer = type(experts)(experts.gate, experts.up, experts.down, "gelu", 5.0, [stage], "experts")
    plan = moe_plan(layer, T, 2, shared=shared, block_m=block_m)
    assert plan.mma is not None and plan.shared_mma is not None
    assert "STAGE_DISPATCH_GATE_UP(ACC, WORDS, KEY) switch (KEY) { case" in plan.mma.gate_up_kernel[2]
    runner = plan.bind(plan.allocate())
    x = torch.randn(T, 256).half()
    ids = torch.randint(0, 8, (T, 2), generator=g, dtype=torch.int32)
    calls = runner.chunk_launches(x, ids, torch.rand(T, 2, generator=g), torch.empty(T, 256).half())
    expected = ["gate_up", "down", "shared_gate_up", "shared_down"]
    if plan.mma.pre_rotate:
        expected = ["rotate"] + expected[:2] + ["shared_rotate"] + expected[2:]
    assert [name for name in calls if name not in ("route_pack", "combine")] == expected
    for name in expected:
        calls[name]()
    check(launches)
    names = [func[1] for func, *_ in launches]
    assert names == ["moe_rotate_input" if n.endswith("rotate") else f"moe_{n.split('_', 1)[-1]}_mma"
                     if n.startswith("shared") else f"moe_{n}_mma" for n in expected]
    routed, shared_gate_up = [call for call in launches if call[0][1] == "moe_gate_up_mma"]
    assert routed[3][3].data_ptr() == runner._ws["block_expert"].data_ptr(), "routed blocks come from the route pack"
    block_expert, block_start, offsets, slots = shared_gate_up[3][3:7]
    assert int(offsets[1]) == T and torch.equal(slots[:T], torch.arange(T, dtype=torch.int32))
    assert shared_gate_up[1][0] == -(-T // plan.shared_block_m) == block_expert.numel() == block_start.numel()


def test_linear_launches_match_the_kernel_signatures(launches):
    from exl3moe.kernels.trellis_mma import plan_mma, rotate_input, trellis_mma

    w = random_weight(256, 384, 3, "mul1", bias=True)
    tiles = plan_mma(256, 384)
    for rows in (1, 20):
        x = torch.randn(rows, 256).half()
        if rows > 16:
            rotate_input(x, w.suh, torch.empty(rows, 256).half())
        trellis_mma(x, w, torch.empty(tiles.splits, rows, 384), torch.zeros(64, dtype=torch.int32),
                    torch.empty(rows, 384).half(), tiles)
    check(launches)
    assert [func[1] for func, *_ in launches] == ["trellis_mma", "rotate_input", "trellis_mma"]
