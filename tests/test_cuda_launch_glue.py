"""The host side of the CUDA C++ kernels without a GPU: every launch passes as many arguments, of the kinds
(pointer, int, float), as its kernel's signature in kernels/cuda/*.cu declares, with grids that cover the plan."""

import os
import re

import pytest
import torch

from exl3moe.kernels import moe_mma, moe_mma_config, moe_mma_source, nvrtc
from exl3moe.ops import moe_planning
from exl3moe.ops.moe import moe_plan
from helpers import random_experts, random_stage, random_weight


def signature(file: str, name: str) -> list:
    """'ptr' / 'int' / 'float' for each parameter of extern "C" kernel `name` in kernels/cuda/`file`, then 'map?'
    where the list ends with X_MAP_PARAM (a tensor map in builds that stage x by TMA)."""
    text = nvrtc.source(file)
    match = re.search(r"\n" + name + r"\(([^)]*)\)\s*\{", text)
    assert match, f"{name} not found in {file}"
    kinds = []
    for param in match.group(1).split(","):
        param = " ".join(param.split())
        kinds.append("ptr" if "*" in param else "float" if param.startswith("float") else "int")
    return kinds + (["map?"] if match.group(1).rstrip().endswith("X_MAP_PARAM") else [])


def kind(arg) -> str:
    if arg is None or isinstance(arg, torch.Tensor):
        return "ptr"
    if isinstance(arg, tuple) and arg[0] == "map":
        return "map"
    assert not isinstance(arg, bool), "pass flags as int"
    return "float" if isinstance(arg, float) else "int"


@pytest.fixture
def launches(monkeypatch):
    """Pretend the CUDA kernels are available (on an H200's 132 SMs): compiling returns (file, name); launches are
    recorded."""
    recorded = []
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    monkeypatch.setattr(nvrtc, "sm_count", lambda device: 132)
    monkeypatch.setattr(nvrtc, "kernel",
                        lambda file, name, defines, index, prelude="", arch_suffix="": (file, name, prelude))
    monkeypatch.setattr(nvrtc, "launch",
                        lambda func, grid, block, args, shared=0, early=False: recorded.append((func, grid, block,
                                                                                                  args, early)))
    monkeypatch.setattr(nvrtc, "local_bytes", lambda func: 0)
    monkeypatch.setattr(nvrtc, "x_tensor_map",
                        lambda x, rows, cols, stride=None, box_rows=128: ("map", x.data_ptr(), rows, cols,
                                                                          stride or cols, box_rows))
    return recorded


def check(recorded):
    for (file, name, *_), grid, block, args, _ in recorded:
        kinds, expected = [kind(a) for a in args], signature(file, name)
        if expected[-1:] == ["map?"]:
            expected = expected[:-1] + kinds[-1:] if kinds[-1:] == ["map"] else expected[:-1]
        assert kinds == expected, name
        assert all(g >= 1 for g in grid) and block % 32 == 0 and block <= 1024, (name, grid, block)


@pytest.mark.parametrize("T, block_m", [(3, None), (20, 16), (40, 64), (70, 128)])
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
    out = torch.empty(T, 256).half()
    calls = runner.chunk_launches(x, ids, torch.rand(T, 2, generator=g), out)
    if plan.mma.direct:
        expected = ["shared_gate_up", "shared_down", "gate_up", "down"]
    else:
        expected = ["route_pack", "gate_up", "down", "shared_gate_up", "shared_down", "combine"]
        if plan.mma.pre_rotate:
            shared_rotate = ["shared_rotate"] if plan.shared_mma.pre_rotate else []
            expected = ["route_pack", "rotate"] + expected[1:3] + shared_rotate + expected[3:]
    assert list(calls) == expected
    cuda = [name for name in expected if name not in ("route_pack", "combine")]
    for name in cuda:
        calls[name]()
    check(launches)
    names = [func[1] for func, *_ in launches]
    assert names == ["moe_rotate_input" if n.endswith("rotate") else f"moe_{n.split('_', 1)[-1]}_mma"
                     if n.startswith("shared") else f"moe_{n}_mma" for n in cuda]
    shared_gate_up, routed = [call for call in launches if call[0][1] == "moe_gate_up_mma"][::1 if plan.mma.direct
                                                                                             else -1]
    block_expert, block_start, offsets, slots = shared_gate_up[3][3:7]
    assert int(offsets[1]) == T and torch.equal(slots[:T], torch.arange(T, dtype=torch.int32))
    shared_rows = shared_gate_up[1][2 if plan.shared_mma.split_inner else 1]
    assert shared_rows == -(-T // plan.shared_block_m) == block_expert.numel() == block_start.numel()
    down = [call for call in launches if call[0][1] == "moe_down_mma"][-1 if plan.mma.direct else 0]
    rows = 2 if plan.mma.split_inner else 1   # packed calls of more than 32 slots: splits along y, route blocks z
    assert plan.mma.split_inner == (not plan.mma.direct)
    # A packed 16-row plan runs the stage's passes in blocks of their own: z doubles (its route blocks).
    assert plan.mma.stage_blocks == (block_m == 16)
    assert plan.mma.stage_blocks == (("STAGE_BLOCKS", 1) in moe_mma_source.kernel_source(plan.mma, "moe_down_mma")[0])
    passes = (2 if plan.mma.stage_blocks else 1, 1)
    assert (routed[1][0], routed[1][rows]) == (2 * 384 // 128, passes[0] * (runner._ws["block_expert"].numel()
                                                                           if not plan.mma.direct else ids.numel()))
    assert routed[1][3 - rows] == passes[1] * plan.mma.gate_up_splits
    assert down[1][3 - rows] == passes[1] * plan.mma.down_splits
    parts = moe_mma_config.workspace_numels(plan.mma, plan.slot_capacity, 1, 256, 384)
    assert parts["gate_up_partial"] == passes[0] * plan.mma.gate_up_splits * 2 * plan.slot_capacity * 384
    assert down[1][0] == 256 // 128, "grid rows are route blocks, their column blocks along x"
    if plan.mma.direct:
        assert routed[3][3] is ids and routed[1][1] == down[1][1] == ids.numel(), "one block per slot, from the ids"
        assert down[3][-10] is ids and down[3][-5] is out and down[3][-1] == 2, "down combines into out"
    else:
        assert routed[3][3].data_ptr() == runner._ws["block_expert"].data_ptr(), "routed blocks from the route pack"
        assert down[3][-10] is None, "the combine is its own launch"


def test_one_row_gate_up_of_many_mainloops_is_bounded_only_when_a_call_fits_one_wave(launches, monkeypatch):
    """A direct plan's gate/up of two formats gets __launch_bounds__' minimum blocks when a full call's blocks fit
    on the GPU at that many per SM; a uniform layer's (of a format outside ONE_WAVE_BOUND_FORMATS), or a call of more
    blocks, keeps ptxas's own registers. Down reads its combine's inputs ahead with registers for 8 blocks per SM (one
    format) or 7 (more)."""
    from exl3moe.kernels.moe_mma_source import DIRECT_GATE_UP_MIN_BLOCKS, kernel_source

    g = torch.Generator().manual_seed(4)
    mixed = random_experts(8, 256, 256, K=[3, 4] * 4, codebook="mcg", generator=g)
    uniform = random_experts(8, 256, 256, K=3, codebook="mcg", generator=g)   # K4 and K2 take a bound of their own
    monkeypatch.setattr(nvrtc, "sm_count", lambda device: 3)   # 21 blocks in flight: one token's 16, not four's
    for experts, T, bounded in ((mixed, 1, True), (mixed, 4, False), (uniform, 1, False)):
        mma = moe_plan(experts, T, 2).mma
        blocks = T * 2 * (2 * 256 // 128) * mma.gate_up_splits
        assert mma.direct and mma.one_wave == (blocks <= 3 * DIRECT_GATE_UP_MIN_BLOCKS)
        defines = dict(kernel_source(mma, "moe_gate_up_mma")[0])
        assert defines.get("MIN_BLOCKS") == (DIRECT_GATE_UP_MIN_BLOCKS if bounded else None), (T, blocks)
        down = dict(kernel_source(mma, "moe_down_mma")[0])
        assert down["COMBINE_AHEAD"] == 8 and down["MIN_BLOCKS"] == (8 if experts is uniform else 7)


def test_direct_down_drops_its_launch_bound_where_ptxas_spills(launches, monkeypatch):
    """A one-format direct down reads its combine ahead with registers for 8 blocks per SM; where ptxas spills
    under that bound, the kernel is compiled again without it (the read-ahead stays)."""
    experts = random_experts(8, 256, 256, K=3, codebook="mcg", generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(nvrtc, "kernel", lambda file, name, d, index, prelude="", arch_suffix="": (name, dict(d)))
    for spills in (False, True):
        monkeypatch.setattr(nvrtc, "local_bytes", lambda func: 8 if spills and "MIN_BLOCKS" in func[1] else 0)
        name, defines = moe_plan(experts, 1, 2).mma.down_kernel
        assert name == "moe_down_mma" and defines["COMBINE_AHEAD"] == 8
        assert defines.get("MIN_BLOCKS") == (None if spills else 8), spills


def run_ws_chunk(plan, launches, num_experts, g):
    """Binds `plan` (hidden 256, top-2, its max tokens), runs one chunk's rotate, gate/up and down launches on random
    ids, checks their arguments against the kernel signatures and returns the runner."""
    T = plan.max_tokens
    runner = plan.bind(plan.allocate())
    x = torch.randn(T, 256).half()
    ids = torch.randint(0, num_experts, (T, 2), generator=g, dtype=torch.int32)
    calls = runner.chunk_launches(x, ids, torch.rand(T, 2, generator=g), torch.empty(T, 256).half())
    for name in ("rotate", "gate_up", "down"):
        calls[name]()
    check(launches)
    return runner


@pytest.mark.parametrize("persistent_gate_up", ["0", "1"])
@pytest.mark.parametrize("single_split", [False, True])
def test_moe_warp_specialized_launches(launches, monkeypatch, single_split, persistent_gate_up):
    """128-row plans on sm_90: gate/up on trellis_ws.cuh; single-split plans take the persistent down (and gate/up,
    when opted in) over one block per SM, with the shared memory their kernels need."""
    monkeypatch.setattr(moe_planning, "uses_ws", lambda block_m, device: block_m == 128)
    monkeypatch.setattr(nvrtc, "sm_count", lambda device: 5)
    monkeypatch.setenv("EXL3MOE_MOE_WS_GATE_UP", persistent_gate_up)
    if single_split:
        monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)
    shared_bytes = []
    monkeypatch.setattr(nvrtc, "launch", lambda func, grid, block, args, shared=0, early=False: (
        launches.append((func, grid, block, args, early)), shared_bytes.append(shared)))
    g = torch.Generator().manual_seed(4)
    experts = random_experts(8, 256, 384, K=[4, 2.5, 3, 2] * 2, codebook=["mcg", "mul1", "3inst", "mcg"] * 2,
                             generator=g)
    stage = random_stage(experts, torch.rand(8, 3, generator=g), K=2, codebook="mcg", generator=g)
    layer = type(experts)(experts.gate, experts.up, experts.down, "silu", None, [stage], "experts")
    plan = moe_plan(layer, 70, 2, block_m=128)
    mma = plan.mma
    assert mma.ws and mma.pre_rotate
    assert mma.ws_down == single_split and mma.ws_gate_up == (single_split and persistent_gate_up == "1")
    assert (mma.down_splits == 1) == single_split
    producers = mma.gate_up_kernel[2]
    assert "WS_PRODUCE_GATE_UP(WORDS, KEY, CURSOR) switch (KEY) { case" in producers
    assert "produce<4, 1>" in producers, "the stage's format is decoded by the same producers"
    assert ("WS_PRODUCE_DOWN" in mma.down_kernel[2]) == single_split
    runner = run_ws_chunk(plan, launches, 8, g)
    assert ("mma_down_partial" in runner._ws) != single_split, "the persistent down keeps no partials"
    assert mma.x_tma == (persistent_gate_up == "0" or not single_split), "TMA x beside the persistent gate/up: no"
    capacity = plan.slot_capacity
    maps = {func[1]: args[-1] for func, _, _, args, _ in launches if kind(args[-1]) == "map"}
    expected = {"moe_gate_up_mma": ("map", runner._ws["mma_x_rot"].data_ptr(), 2 * capacity, 256, 256, 128)}
    expected.update({"moe_down_ws": ("map", runner._ws["h_rot"].data_ptr(), capacity, 384, 384, 128)}
                    if mma.ws_down else {})
    assert maps == (expected if mma.x_tma else {}), "x by TMA over each kernel's whole x buffer"
    assert mma.ws_paired == (not mma.ws_gate_up), "paired producers beside the persistent gate/up: no"
    threads = 640 if mma.ws_paired else 768
    for (func, grid, block, args, _), shared in zip(launches, shared_bytes):
        name = func[1]
        if name in ("moe_gate_up_ws", "moe_down_ws"):
            assert grid == (5, 1, 1) and block == threads, name
            assert shared == moe_mma_config.ws_shared_bytes(mma, name) <= 227 * 1024, name
        elif name == "moe_gate_up_mma":
            assert (block, shared) == (threads, moe_mma_config.ws_shared_bytes(mma, name))
        else:
            assert (block, shared) == (mma.warps * 32, 0), name


def test_wide_route_blocks_at_128_to_176_rows_per_expert(launches, monkeypatch):
    """Where experts average 128 to 176 rows, sm_90 plans whose down takes one split run 192-row route
    blocks: 640 threads (8 paired producers, 12 consumers), TMA boxes of 192 rows, shared memory within the SM's,
    the rotation over 192-row blocks; EXL3MOE_MOE_WS_192=0, a split down, a smaller or a larger call keep 128. A
    caller may ask for 192 rows anywhere they can run, and is refused where they cannot."""
    from exl3moe.errors import ContractError

    monkeypatch.setattr(moe_planning, "uses_ws", lambda block_m, device: block_m in (128, 192))
    monkeypatch.setattr(nvrtc, "sm_count", lambda device: 5)
    monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)
    shared_bytes = []
    monkeypatch.setattr(nvrtc, "launch", lambda func, grid, block, args, shared=0, early=False: (
        launches.append((func, grid, block, args, early)), shared_bytes.append(shared)))
    monkeypatch.setenv("EXL3MOE_MOE_SPLIT_ROUTE", "0")   # else split_route_blocks takes these calls
    g = torch.Generator().manual_seed(6)
    experts = random_experts(4, 256, 384, K=[4, 3, 4, 3], codebook="mcg", generator=g)
    assert not moe_planning.wide_route_blocks(experts, 511, 511) and moe_planning.wide_route_blocks(experts, 512, 512)
    assert moe_planning.wide_route_blocks(experts, 704, 704) and not moe_planning.wide_route_blocks(experts, 705, 705)
    assert moe_plan(experts, 255, 2).block_m == 128
    monkeypatch.setenv("EXL3MOE_MOE_WS_192", "0")
    assert moe_plan(experts, 300, 2).block_m == 128
    monkeypatch.delenv("EXL3MOE_MOE_WS_192")
    plan = moe_plan(experts, 300, 2)
    mma = plan.mma
    assert plan.block_m == mma.block_m == 192 and mma.ws and mma.ws_down and mma.ws_paired and not mma.ws_gate_up
    down = dict(moe_mma_source.kernel_source(mma, "moe_down_ws")[0])
    assert [down[k] for k in ("WS_BLOCK_ROWS", "WS_PRODUCERS", "ROUTE_ROWS", "WARPS")] == [192, 8, 192, 20]
    rotate = dict(moe_mma_source.kernel_source(mma, "moe_rotate_input")[0])
    assert (rotate["MT"], rotate["ROUTE_ROWS"]) == (8, 192), "the rotation keeps its m16 tiles"
    run_ws_chunk(plan, launches, 4, g)
    for (func, grid, block, args, _), shared in zip(launches, shared_bytes):
        if func[1] == "moe_rotate_input":
            assert grid[2] == 192 // moe_mma.ROTATE_ROWS and block == mma.warps * 32
        else:
            assert block == 640 and shared == moe_mma_config.ws_shared_bytes(mma, func[1]) <= 227 * 1024, func[1]
            assert args[-1][-1] == 192, "TMA boxes of the block's rows"
    assert moe_plan(experts, 353, 2).block_m == 128
    assert moe_plan(experts, 70, 2, block_m=192).block_m == 192, "asked for, outside the window too"
    monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1 << 20)
    assert moe_plan(experts, 300, 2).block_m == 128, "a split down keeps 128-row blocks"
    with pytest.raises(ContractError, match="block_m.*192 needs"):
        moe_plan(experts, 300, 2, block_m=192)
    monkeypatch.setattr(moe_planning, "uses_ws", lambda block_m, device: block_m == 128)
    monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)
    with pytest.raises(ContractError, match="block_m.*192 needs"):
        moe_plan(experts, 300, 2, block_m=192)


def test_split_route_blocks_from_128_rows_per_expert(launches, monkeypatch):
    """Where a chunk's experts average 128 rows or more, sm_90 plans whose down takes one split keep 128-row blocks
    and add a 192-row plan: route_split after the route pack, the rotation over route_pack's 128-row table, then
    gate/up and down of the 128-row table and of the 192-row one, each with its block rows, TMA boxes and grid rows
    (route_split_max_blocks), the 192-row kernels launched early after the 128-row ones (split_chain) and waiting
    for them on exit; a smaller call of the same plan launches the 128-row kernels alone, and
    EXL3MOE_MOE_SPLIT_ROUTE=0 keeps one block size."""
    from exl3moe.kernels.route_pack import route_pack_max_blocks
    from exl3moe.kernels.route_split import route_split_max_blocks

    monkeypatch.setattr(moe_planning, "uses_ws", lambda block_m, device: block_m in (128, 192))
    monkeypatch.setattr(nvrtc, "sm_count", lambda device: 5)
    monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)
    monkeypatch.setattr(moe_planning, "split_chain", lambda device: True)
    shared_bytes = []
    monkeypatch.setattr(nvrtc, "launch", lambda func, grid, block, args, shared=0, early=False: (
        launches.append((func, grid, block, args, early)), shared_bytes.append(shared)))
    g = torch.Generator().manual_seed(7)
    experts = random_experts(4, 256, 384, K=[4, 3, 4, 3], codebook="mcg", generator=g)
    assert not moe_planning.split_route_blocks(experts, 511, 600) and moe_planning.split_route_blocks(experts, 512, 600)
    assert moe_plan(experts, 223, 2).wide_mma is None
    plan = moe_plan(experts, 300, 2)
    assert plan.block_m == plan.mma.block_m == 128 and plan.wide_mma.block_m == 192
    assert plan.mma.ws_down and plan.wide_mma.ws_down and plan.expert_order is not None
    for mma, chained in ((plan.mma, False), (plan.wide_mma, True)):
        for name in ("moe_gate_up_mma", "moe_down_ws"):
            defines = dict(moe_mma_source.kernel_source(mma, name)[0])
            assert defines["EARLY_LAUNCH"] == 1 and ("CHAIN_ON_EXIT" in defines) == chained, (mma.block_m, name)
    runner = plan.bind(plan.allocate())
    x, out = torch.randn(300, 256).half(), torch.empty(300, 256).half()
    ids = torch.randint(0, 4, (300, 2), generator=g, dtype=torch.int32)
    calls = runner.chunk_launches(x, ids, torch.rand(300, 2, generator=g), out)
    assert list(calls) == ["route_pack", "route_split", "rotate", "gate_up", "wide_gate_up", "down", "wide_down",
                           "combine"]
    for name in ("rotate", "gate_up", "wide_gate_up", "down", "wide_down"):
        calls[name]()
    check(launches)
    wide_n, narrow_n = route_split_max_blocks(600, 4)
    ws = runner._ws
    tables = {"wide": (ws["wide_block_expert"], wide_n, 192), "narrow": (ws["narrow_block_expert"], narrow_n, 128)}
    kinds = ["rotate", "narrow", "wide", "narrow", "wide"]
    for kind_, (func, grid, block, args, early), shared in zip(kinds, launches, shared_bytes):
        assert early == (kind_ == "wide"), (kind_, func[1])
        if kind_ == "rotate":
            assert func[1] == "moe_rotate_input" and grid[0] == route_pack_max_blocks(600, 4, 128)
            assert args[3].data_ptr() == ws["block_expert"].data_ptr(), "the rotation walks route_pack's table"
            continue
        table, rows, block_rows = tables[kind_]
        mma = plan.wide_mma if kind_ == "wide" else plan.mma
        assert block == 640 and shared == moe_mma_config.ws_shared_bytes(mma, func[1]), func[1]
        assert args[-1][-1] == block_rows, "TMA boxes of the block's rows"
        expert_arg = args[3] if func[1] == "moe_gate_up_mma" else args[2]
        assert expert_arg.data_ptr() == table.data_ptr() and expert_arg.numel() == rows, (kind_, func[1])
        if func[1] == "moe_gate_up_mma":
            assert grid[1] == rows, "one grid row per route block of the table"
    small = runner.chunk_launches(x[:200], ids[:200], torch.rand(200, 2, generator=g), out[:200])
    assert "route_split" not in small and "wide_gate_up" not in small, "400 slots: 100 rows per expert"
    assert moe_plan(experts, 255, 2).wide_mma is None
    monkeypatch.setenv("EXL3MOE_MOE_SPLIT_ROUTE", "0")
    assert moe_plan(experts, 300, 2).wide_mma is None


def test_moe_down_svh_off_four_byte_alignment_keeps_the_split_down(launches, monkeypatch):
    """moe_down_ws reads svh two fp16 at a time: a down svh that starts 2 bytes off a 4-byte boundary (a view into a
    larger tensor) keeps the plan on moe_down_mma, whose reads need no alignment."""
    monkeypatch.setattr(moe_planning, "uses_ws", lambda block_m, device: block_m == 128)
    monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)
    g = torch.Generator().manual_seed(5)
    experts = random_experts(4, 256, 384, K=4, codebook="mcg", generator=g)
    assert moe_plan(experts, 70, 2, block_m=128).mma.ws_down
    w = experts.down[2]
    odd = torch.cat([torch.zeros(1).half(), w.svh])[1:]
    assert odd.data_ptr() % 4 == 2
    down = list(experts.down)
    down[2] = type(w)(w.trellis, w.suh, odd, w.codebook, w.bias, w.name)
    shifted = type(experts)(experts.gate, experts.up, down, "silu")
    mma = moe_plan(shifted, 70, 2, block_m=128).mma
    assert mma.ws and not mma.ws_down and mma.down_kernel[1] == "moe_down_mma"


@pytest.mark.parametrize("env", [dict(STAGES="2"), dict(STAGES="11"), dict(STAGES="six"), dict(STAGE_KT="6"),
                                 dict(STAGE_KT="8", STAGES="6"), dict(STAGES="7", GATE_UP="1")])
def test_moe_ring_settings_outside_their_range_are_refused(launches, monkeypatch, env):
    from exl3moe.errors import ContractError

    monkeypatch.setattr(moe_planning, "uses_ws", lambda block_m, device: block_m == 128)
    for key, value in env.items():
        monkeypatch.setenv(f"EXL3MOE_MOE_WS_{key}", value)
    experts = random_experts(8, 256, 384, K=4, codebook="mcg", generator=torch.Generator().manual_seed(5))
    with pytest.raises(ContractError, match="EXL3MOE_MOE_WS_STAGE"):
        moe_plan(experts, 70, 2, block_m=128)
    assert not launches


@pytest.mark.parametrize("hidden, inter, stages, refused", [(4096, 1408, 4, True), (4096, 1408, 5, False),
                                                             (2048, 768, 4, False), (2048, 768, 3, True)])
def test_ring_too_shallow_for_the_producer_turns_is_refused(launches, monkeypatch, hidden, inter, stages, refused):
    """Paired producers take a range's ring stages in three turns; over ranges whose stage count three does not
    divide, a turn's next stage can lie up to five stages on, further than a shallower ring's slots, where a barrier's
    parity would let it overwrite a slot still in use. GLM's ranges (32 and 11 stages) need 5, Qwen3's (16, 6) 4."""
    from exl3moe.errors import ContractError

    assert [moe_planning.ring_turn_step(n, 3) for n in (32, 11, 16, 6, 1)] == [5, 5, 4, 3, 1]
    assert [moe_planning.ring_turn_step(n, 2) for n in (32, 11, 1)] == [2, 3, 1]
    monkeypatch.setenv("EXL3MOE_MOE_WS_STAGE_KT", "8")
    monkeypatch.setenv("EXL3MOE_MOE_WS_STAGES", str(stages))
    monkeypatch.setattr(moe_planning, "TARGET_WARPS", 1)   # one split: ranges of the whole hidden / intermediate size
    experts = random_experts(2, hidden, inter, K=2, codebook="mcg", generator=torch.Generator().manual_seed(7))
    if refused:
        with pytest.raises(ContractError, match="EXL3MOE_MOE_WS_STAGES.*need at least"):
            moe_plan(experts, 600, 2, block_m=128)
        assert not launches
    else:
        moe_plan(experts, 600, 2, block_m=128)
    monkeypatch.setenv("EXL3MOE_MOE_WS_PAIRED", "0")
    moe_plan(experts, 600, 2, block_m=128)   # 16 producers take two turns: any ring of 3 or more stages


@pytest.mark.parametrize("env, ring", [({}, (8, 5)), (dict(GATE_UP="1"), (8, 3)), (dict(STAGES="5"), (4, 5)),
                                       (dict(STAGE_KT="4"), (4, 10)), (dict(STAGE_KT="4", GATE_UP="1"), (4, 6))])
def test_moe_ring_stages_follow_the_settings(monkeypatch, env, ring):
    """Stages of a whole x chunk, 40 k-tiles of them, 24 beside the persistent gate/up; the settings override."""
    for key, value in env.items():
        monkeypatch.setenv(f"EXL3MOE_MOE_WS_{key}", value)
    assert moe_planning.ws_ring() == ring


def test_linear_launches_match_the_kernel_signatures(launches):
    from exl3moe.kernels.trellis_dense import DENSE_KTILES, decode_dense, dense_epilogue
    from exl3moe.ops.linear_cuda import rotate_input, trellis_mma
    from exl3moe.ops.linear_planning import plan_mma

    w = random_weight(256, 384, 3, "mul1", bias=True)
    tiles = plan_mma(256, 384)
    for rows in (1, 20):
        x = torch.randn(rows, 256).half()
        if rows > 16:
            rotate_input(x, w.suh, torch.empty(rows, 256).half())
        trellis_mma(x, w, torch.empty(tiles.splits, rows, 384), torch.zeros(64, dtype=torch.int32),
                    torch.empty(rows, 384).half(), tiles)
    decode_dense(w, torch.empty(256, 384).half())
    dense_epilogue(torch.empty(300, 384), w, torch.empty(300, 384).half())
    check(launches)
    assert [func[1] for func, *_ in launches] == ["trellis_mma", "rotate_input", "trellis_mma", "reduce_splits",
                                                  "trellis_dense", "dense_epilogue"]
    assert launches[3][1:3] == ((384 // 128, -(-20 // 8), 1), 128), "reduce_splits: every (128 columns, 8 rows)"
    assert launches[-2][1] == (384 // 16 // 4, -(-256 // 16 // DENSE_KTILES), 1), "every (n16 tile, k range)"
    assert launches[-1][1] == (300, 1, 1), "one warp per (row, 128 columns)"


@pytest.mark.parametrize("splits", [2, 11])
def test_cluster_launch_groups_whole_splits_and_allows_non_portable_sizes(launches, monkeypatch, splits):
    from exl3moe.kernels import trellis_mma as tm
    from exl3moe.ops import linear_cuda as lc, linear_planning as lp

    defines, allowed = [], []
    monkeypatch.setattr(lp, "clusters_on", lambda device: True)
    monkeypatch.setattr(nvrtc, "kernel", lambda file, name, d, index, prelude="", arch_suffix="": (
        defines.append(dict(d)) or (file, name, prelude)))
    monkeypatch.setattr(nvrtc, "allow_non_portable_clusters", allowed.append)
    k, n = 128 * splits, 384
    w = random_weight(k, n, 2, "mcg")
    tiles = lp.plan_mma(k, n)
    assert tiles.splits == splits
    lc.trellis_mma(torch.randn(1, k).half(), w, torch.empty(splits, 1, n), torch.zeros(64, dtype=torch.int32),
                   torch.empty(1, n).half(), tiles)
    check(launches)
    assert defines[-1]["CLUSTER_SPLITS"] == splits and launches[-1][1] == (n // 128, splits, 1)
    assert len(allowed) == (splits > tm.PORTABLE_CLUSTER), "only sizes above 8 need the non-portable opt-in"


@pytest.mark.parametrize("x_tma", ["1", "0"])
@pytest.mark.parametrize("spb_env, expected_spb", [("", 1), ("3", 3)])
def test_warp_specialized_launch_matches_its_signature(launches, monkeypatch, spb_env, expected_spb, x_tma):
    """The linear's trellis_ws launch, with x by TMA (a tensor map over the call's rows, X_TMA) or by cp.async."""
    from exl3moe.ops import linear_cuda as lc, linear_planning as lp

    monkeypatch.setenv("EXL3MOE_WS_SPB", spb_env)
    monkeypatch.setenv("EXL3MOE_WS_X_TMA", x_tma)
    monkeypatch.setattr(nvrtc, "sm_count", lambda device: 132)
    shared_bytes = []
    monkeypatch.setattr(nvrtc, "launch", lambda func, grid, block, args, shared=0, early=False: (
        launches.append((func, grid, block, args, early)), shared_bytes.append(shared)))
    monkeypatch.setattr(nvrtc, "kernel", lambda file, name, defines, index, prelude="", arch_suffix="": (
        file, name, dict(defines).get("X_TMA", 0), dict(defines).get("DEFER_REDUCE", 0)))
    w = random_weight(4096, 14336 // 8, 4, "mcg")  # 14 column blocks: 9 split groups fit in one wave
    tiles = lp.MmaTiles(8, 32)
    x = torch.randn(100, 4096).half()
    lc._launch_ws(x, w, torch.empty(8, 100, 1792), torch.zeros(64, dtype=torch.int32), torch.empty(100, 1792).half(),
                  tiles)
    check(launches)
    (func, grid, block, args, early), reduce = launches
    assert func[3] == 1 and reduce[0][1] == "reduce_splits" and reduce[1:3] == ((1792 // 128, -(-100 // 8), 1), 128)
    assert shared_bytes.pop() == 0, "blocks of split groups leave the reduction to reduce_splits"
    ring = 3 * 16384 + 1024 + 65536 + 48 + 128 * 136 * 4   # stages of 4 k-tiles, x chunks, barriers, running sum
    if x_tma == "1":
        assert func[2] == 1 and args[-1] == ("map", x.data_ptr(), 100, 4096, 4096, 128)
        assert shared_bytes == [ring + 16], "two more barriers"
        args = args[:-1]
    else:
        assert func[2] == 0 and shared_bytes == [ring]
    assert func[1] == "trellis_ws" and block == 768 and args[-1] == expected_spb
    assert not early, "the linear has no programmatic dependent launch"
    assert grid == (1792 // 128, -(-8 // expected_spb), 1), "every (128 columns, split group, 128 rows)"


@pytest.mark.parametrize("env,expected", [(None, True), ("0", False)])
def test_warp_specialized_linear_launches_early_after_its_rotation(launches, monkeypatch, env, expected):
    """trellis_ws right after rotate_input is its programmatic dependent (EXL3MOE_LINEAR_EARLY=0: not), and only
    there: a call handed a rotated x by anyone else launches after the stream's last kernel."""
    from exl3moe.ops import linear_cuda as lc, linear_planning as lp

    if env:
        monkeypatch.setenv("EXL3MOE_LINEAR_EARLY", env)
    assert lp.ws_launches_early(torch.device("cuda")) == expected
    assert not lp.ws_launches_early(torch.device("cpu"))
    monkeypatch.setattr(lp, "ws_launches_early", lambda device: os.environ.get("EXL3MOE_LINEAR_EARLY") != "0")
    w = random_weight(4096, 1792, 4, "mcg")
    tiles = lp.plan_mma(4096, 1792)
    x = torch.randn(100, 4096).half()
    for after_rotate in (True, False):
        lc._launch_ws(x, w, torch.empty(tiles.splits, 100, 1792), torch.zeros(64, dtype=torch.int32),
                      torch.empty(100, 1792).half(), tiles, after_rotate)
    check(launches)
    ws = [early for (_, name, *_), _, _, _, early in launches if name == "trellis_ws"]
    assert ws == [expected, False]
    assert not any(early for (_, name, *_), _, _, _, early in launches if name != "trellis_ws")


@pytest.mark.parametrize("env", [None, "0"])
def test_linear_calls_launch_after_the_previous_kernel(launches, monkeypatch, env):
    """trellis_mma calls go out as programmatic dependents of the stream's previous kernel, compiled with CHAIN and
    their L2 prefetch depth: 8 k-tiles on grids of at most one block per SM, none above; grids of more than one and at
    most 6 blocks per SM that rotate x themselves let their dependents launch only as their blocks exit (CHAIN_LATE).
    A 20-row call's split reduction follows its matmul the same way (EXL3MOE_LINEAR_CHAIN=0: nothing chains)."""
    from exl3moe.ops import linear_cuda as lc, linear_planning as lp

    if env:
        monkeypatch.setenv("EXL3MOE_LINEAR_CHAIN", env)
    assert not lp.chain_capable(torch.device("cpu"))
    monkeypatch.setattr(lp, "chain_capable", lambda device: True)
    monkeypatch.setattr(nvrtc, "sm_count", lambda device: 32)
    compiled = []
    monkeypatch.setattr(nvrtc, "kernel", lambda file, name, defines, index, prelude="", arch_suffix="":
                        compiled.append((name, dict(defines))) or (file, name, prelude))
    small, mid, large = (random_weight(k, n, 2, "mcg") for k, n in ((256, 384), (1024, 1024), (2048, 2048)))
    for w, rows in ((small, 1), (small, 20), (mid, 1), (large, 1)):
        tiles = lp.plan_mma(w.in_features, w.out_features)
        x = torch.randn(rows, w.in_features).half()
        lc.trellis_mma(x, w, torch.empty(tiles.splits, rows, w.out_features), torch.zeros(64, dtype=torch.int32),
                       torch.empty(rows, w.out_features).half(), tiles)
    check(launches)
    mma = [(grid[0] * grid[1], early) for (_, name, *_), grid, _, _, early in launches if name == "trellis_mma"]
    assert [early for _, early in mma] == [env is None] * 4
    assert mma[0][0] <= 32 < mma[2][0] <= 6 * 32 < mma[3][0]
    defines = [d for name, d in compiled if name == "trellis_mma"]
    chains = [d.get("CHAIN_KT") if d.get("CHAIN") == 1 else None for d in defines]
    assert chains == ([None] * 4 if env else [8, 8, 0, 0])
    assert [d.get("CHAIN_LATE", 0) for d in defines] == [0, 0, int(env is None), 0]
    reduces = [early for (_, name, *_), *_, early in launches if name == "reduce_splits"]
    assert reduces == [env is None], "the 20-row call's split reduction follows its matmul"


@pytest.mark.parametrize("env", [None, "0"])
def test_rotated_calls_chain_their_launches(launches, monkeypatch, env):
    """A call that rotates x in rotate_input launches it, the trellis_mma after it and reduce_splits as programmatic
    dependents of the kernel before each (rotate_input and reduce_splits compiled with CHAIN); at 5..16 rows (one m16
    tile, a weight of 16M entries) rotate_input and trellis_mma let their dependents launch only as their blocks exit
    (CHAIN_LATE). EXL3MOE_LINEAR_CHAIN=0: nothing chains."""
    from exl3moe.ops import linear_planning as lp
    from exl3moe.ops import linear as linear_ops

    if env:
        monkeypatch.setenv("EXL3MOE_LINEAR_CHAIN", env)
    monkeypatch.setattr(lp, "chain_capable", lambda device: True)
    monkeypatch.setattr(linear_ops, "use_triton", lambda x: True)
    compiled = []
    monkeypatch.setattr(nvrtc, "kernel", lambda file, name, defines, index, prelude="", arch_suffix="":
                        compiled.append((name, dict(defines))) or (file, name, prelude))
    for w, rows in ((random_weight(256, 384, 4, "mcg"), 20), (random_weight(4096, 4096, 2, "mcg"), 5)):
        plan = linear_ops.LinearPlan(w, rows)
        del launches[:], compiled[:]
        x, out = torch.randn(rows, w.in_features).half(), torch.empty(rows, w.out_features).half()
        plan.bind(plan.allocate()).run(x, out)
        check(launches)
        names = [func[1] for func, *_ in launches]
        assert names == (["rotate_input", "trellis_mma", "reduce_splits"] if rows == 20 else
                         ["rotate_input", "trellis_mma"])
        assert [early for *_, early in launches] == [env is None] * len(names)
        ran = {name: d for name, d in compiled if name in names}   # the variants the run looked up
        assert {name for name, d in ran.items() if d.get("CHAIN") == 1} == (set() if env else set(names))
        late = {name for name, d in ran.items() if d.get("CHAIN_LATE") == 1}
        assert late == ({"rotate_input", "trellis_mma"} if rows == 5 and env is None else set())


def test_linear_call_tells_trellis_mma_whether_it_rotated_x(launches, monkeypatch):
    """LinearPlan.run passes after_rotate=True exactly when it launched rotate_input just before."""
    from exl3moe.ops import linear as linear_ops

    seen = []
    monkeypatch.setattr(linear_ops, "use_triton", lambda x: True)
    monkeypatch.setattr(linear_ops, "rotate_input", lambda x, suh, xh, chain=False: xh)
    monkeypatch.setattr(linear_ops, "trellis_mma", lambda *a, after_rotate=False, **kw: seen.append(after_rotate))
    w = random_weight(2048, 768, 4, "mcg")
    plan = linear_ops.LinearPlan(w, 128)
    runner = plan.bind(plan.allocate())
    for rows in (1, 64):
        runner.run(torch.randn(rows, 2048).half(), torch.empty(rows, 768).half())
    assert seen == [not linear_ops.fuses_rotation(r, 2048, 768) for r in (1, 64)] == [False, True]


def test_prompt_calls_of_whole_split_weights_run_trellis_ws_that_the_plan_compiled(launches, monkeypatch):
    """129-512-row calls of a weight whose trellis_ws blocks run every split go to trellis_ws after rotate_input;
    the plan compiles it even where no 1-128-row call would run it."""
    from exl3moe.ops import linear as linear_ops
    from exl3moe.ops import linear_planning

    monkeypatch.setattr(linear_planning, "uses_ws", lambda rows, k, n, device: True)
    monkeypatch.setattr(linear_ops, "uses_ws", lambda rows, k, n, device: False)
    monkeypatch.setattr(linear_ops, "use_triton", lambda x: True)
    monkeypatch.setattr(linear_ops, "warm_split_gemm", lambda *args: None)
    compiled, seen = [], []
    monkeypatch.setattr(linear_ops, "ws_kernel", lambda *args: compiled.append(args))
    monkeypatch.setattr(linear_ops, "rotate_input", lambda x, suh, xh, chain=False: xh)
    monkeypatch.setattr(linear_ops, "trellis_mma",
                        lambda x, *args, after_rotate=False, **kw: seen.append((x.shape[0], after_rotate)))
    w = random_weight(256, 8704, 4, "mcg")   # 68 column blocks: more than half the SMs, so blocks run every split
    plan = linear_ops.LinearPlan(w, 512)
    assert len(compiled) == 1
    runner = plan.bind(plan.allocate())
    runner.run(torch.randn(300, 256).half(), torch.empty(300, 8704).half())
    assert seen == [(300, True)]


@pytest.mark.parametrize("env", [None, "1"])
def test_linear_paired_producers_launch(launches, monkeypatch, env):
    """Paired producers: 640 threads, WS_PRODUCERS 12 and a ring of 5 stages, where each block runs every split
    (4096 x 14336: 112 column blocks on 132 SMs) or where EXL3MOE_WS_PAIRED=1 asks; not on 14336 x 4096."""
    from exl3moe.kernels import trellis_mma as tm
    from exl3moe.kernels import trellis_ws as tws
    from exl3moe.ops import linear_cuda as lc, linear_planning as lp

    if env:
        monkeypatch.setenv("EXL3MOE_WS_PAIRED", env)
    defines = []
    monkeypatch.setattr(nvrtc, "kernel", lambda file, name, d, index, prelude="", arch_suffix="": (
        defines.append(dict(d)), (file, name, ""))[1])
    shared_bytes = []
    monkeypatch.setattr(nvrtc, "launch", lambda func, grid, block, args, shared=0, early=False: (
        launches.append((func, grid, block, args, early)), shared_bytes.append(shared)))
    for k, n in ((4096, 14336), (14336, 4096)):
        w = random_weight(k, n, 4, "mcg")
        x = torch.randn(100, k).half()
        tiles = lp.plan_mma(k, n)
        lc._launch_ws(x, w, torch.empty(tiles.splits, 100, n), torch.zeros(tm.counter_count(n, 128), dtype=torch.int32),
                      torch.empty(100, n).half(), tiles)
    check(launches)
    for (k, n), (_, grid, block, _, _), d, shared in zip(((4096, 14336), (14336, 4096)), launches, defines,
                                                         shared_bytes):
        paired = env == "1" or n == 14336
        assert (block, d.get("WS_PRODUCERS"), d["STAGES"]) == ((640, 12, 5) if paired else (768, None, 3)), (k, n)
        assert shared == tws.ws_shared_bytes(d.get("X_TMA", 0) == 1, paired) <= 227 * 1024
        assert lp.ws_paired(k, n, lp.plan_mma(k, n).splits, 132) == paired


@pytest.mark.parametrize("k, n, K, codebook, env, expected", [
    (4096, 14336, 4, "mcg", None, True), (14336, 4096, 2, "3inst", None, True), (4096, 4096, 8, "mcg", None, True),
    (4096, 14336, 3, "mul1", None, True), (4096, 14336, 6, "mul1", None, True), (4096, 14336, 3, "mcg", None, False),
    (4096, 14336, 5, "3inst", None, False), (4096, 14336, 6, "mcg", None, False), (4096, 14336, 7, "mcg", None, False),
    (2048, 768, 4, "mcg", None, False), (4096, 1408, 4, "mul1", None, False), (4096, 14336, 3, "mcg", "1", True),
    (2048, 768, 4, "mcg", "1", True), (4096, 14336, 4, "mul1", "0", False)])
def test_linear_x_by_tma_where_it_measured_faster(monkeypatch, k, n, K, codebook, env, expected):
    """trellis_ws takes x by TMA for weights of 16M entries or more, in MUL1 and at K 1 / 2 / 4 / 8;
    EXL3MOE_WS_X_TMA forces either way."""
    from exl3moe.ops.linear_planning import ws_x_tma

    if env is not None:
        monkeypatch.setenv("EXL3MOE_WS_X_TMA", env)
    assert ws_x_tma(k, n, K, codebook) == expected
    assert not ws_x_tma(k, n, K, codebook, torch.empty(4, 257).half()[:, 1:]), "rows off 16-byte alignment: cp.async"


def test_splits_per_block_keep_one_wave():
    from exl3moe.ops.linear_planning import ws_splits_per_block

    assert ws_splits_per_block(8, 112, 132) == 8, "112 column blocks: one split group"
    assert ws_splits_per_block(28, 32, 132) == 7, "32 column blocks: 4 groups of 7 splits"
    assert ws_splits_per_block(16, 6, 132) == 1
    assert ws_splits_per_block(8, 300, 132) == 8, "more column blocks than SMs: every split in one block"


def test_moe_plans_of_more_route_blocks_than_grid_rows_take_the_triton_experts(launches):
    experts = random_experts(8, 256, 384, K=4, codebook="mcg", generator=torch.Generator().manual_seed(1))
    assert moe_plan(experts, 64, 2).mma is not None
    slots = 128 * 70000   # 128-row route blocks: more than 65535 of them
    plan = moe_plan(experts, slots // 2, 2, slot_capacity=slots)
    assert plan.block_m > 0 and plan.mma is None


@pytest.mark.parametrize("slots, mixed, expected", [(8, True, (2, 2)), (32, True, (2, 2)), (33, True, (4, 4)),
                                                    (8, False, (4, 8)), (256, True, (4, 4))])
def test_mixed_kernels_of_small_calls_compile_the_smallest_mainloops(slots, mixed, expected):
    from exl3moe.kernels.moe_mma_source import kernel_source
    from exl3moe.ops.moe_planning import moe_mma_layout
    experts = random_experts(8, 256, 384, K=[2, 3, 4, 5, 6, 7, 8, 4] if mixed else 4, codebook="mcg",
                             generator=torch.Generator().manual_seed(2))
    plan = moe_mma_layout(experts, slots, 16)
    for name in ("moe_gate_up_mma", "moe_down_mma"):
        defines = dict(kernel_source(plan, name)[0])
        assert (defines["PF"], defines["KTILE_UNROLL"]) == expected, name
        assert defines["KTILE_UNROLL"] % defines["PF"] == 0


def test_sm_count_is_zero_off_cuda():
    assert nvrtc.sm_count(torch.device("cpu")) == 0


@pytest.mark.parametrize("T", [3, 20])
def test_down_launches_as_a_dependent_of_its_gate_up_on_sm90(launches, monkeypatch, T):
    """Routed and shared down go out as programmatic dependents of the gate/up just before them, both kernels built
    with EARLY_LAUNCH (gate/up lets them start, down waits before reading h_rot), and so does a gate/up right after
    the other expert set's down (EARLY_GATE_UP: its block 0 waits for that down before it leaves)."""
    from exl3moe.kernels.moe_mma_source import kernel_source

    assert not moe_planning.early_launch(torch.device("cpu"))
    monkeypatch.setattr(moe_planning, "early_launch", lambda device: True)
    g = torch.Generator().manual_seed(5)
    experts = random_experts(8, 256, 384, K=[4, 3] * 4, codebook="mcg", generator=g)
    shared = random_experts(1, 256, 256, K=3, codebook="mcg", generator=g, name="shared")
    plan = moe_plan(experts, T, 2, shared=shared)
    assert plan.mma.early_down and plan.shared_mma.early_down
    assert all(dict(kernel_source(plan.mma, n)[0])["EARLY_LAUNCH"] == 1 for n in ("moe_gate_up_mma", "moe_down_mma"))
    runner = plan.bind(plan.allocate())
    calls = runner.chunk_launches(torch.randn(T, 256).half(), torch.randint(0, 8, (T, 2), generator=g,
                                                                            dtype=torch.int32),
                                  torch.rand(T, 2, generator=g), torch.empty(T, 256).half())
    for name, call in calls.items():
        if name not in ("route_pack", "combine"):
            call()
    order = [(func[1], early) for func, *_, early in launches]
    rotate = ["moe_rotate_input"] if plan.mma.pre_rotate else []
    assert plan.mma.pre_rotate == (not plan.mma.direct), "packed plans of more than 32 slots pre-rotate"
    assert [name for name, _ in order] == rotate + ["moe_gate_up_mma", "moe_down_mma"] * 2
    early = [False] * len(rotate) + [False, True, True, True]
    assert [early for _, early in order] == early, "the first gate/up follows no down"
    follower, leader = (plan.mma, plan.shared_mma) if plan.mma.direct else (plan.shared_mma, plan.mma)
    assert follower.early_gate_up and not leader.early_gate_up
    assert dict(kernel_source(follower, "moe_gate_up_mma")[0])["EARLY_GATE_UP"] == 1
    assert "EARLY_GATE_UP" not in dict(kernel_source(leader, "moe_gate_up_mma")[0])
    monkeypatch.setenv("EXL3MOE_MOE_EARLY_GATE_UP", "0")
    again = moe_plan(experts, T, 2, shared=shared)
    assert not again.mma.early_gate_up and not again.shared_mma.early_gate_up
    assert again.mma.early_down and again.shared_mma.early_down, "the knob keeps the early downs"


@pytest.mark.parametrize("block_m, slots, direct, formats, env, expected", [
    (16, 32, False, 3, None, False), (16, 33, False, 1, None, True), (16, 9, False, 4, None, True),
    (16, 32, False, 7, "0", False), (32, 2048, False, 1, "0", False), (64, 64, False, 1, "0", True),
    (16, 8, True, 7, None, False)])
def test_packed_plans_of_many_slots_or_formats_pre_rotate(monkeypatch, block_m, slots, direct, formats, env, expected):
    """A rotate launch from 64-row blocks on, and in packed plans of more than 32 slots or of 4+ formats, never in
    direct calls."""
    if env is not None:
        monkeypatch.setenv("EXL3MOE_MOE_PRE_ROTATE_PACKED", env)
    assert moe_planning.pre_rotates(block_m, slots, direct, formats) == expected


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_few_column_groups_leave_their_split_reduction_to_reduce_splits(monkeypatch, env):
    """trellis_ws blocks of split groups hand their reduction to reduce_splits; trellis_mma does from 2 m16 tiles where
    its column groups would occupy under half the SMs, never in a cluster; the variables force it off / on."""
    from exl3moe.ops import linear_planning as lp

    for name in ("EXL3MOE_WS_SPLIT_REDUCE", "EXL3MOE_MMA_SPLIT_REDUCE"):
        if env is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, env)
    assert not lp.ws_defers_reduce(8, 14336, 132), "whole-split blocks keep their sum in shared memory"
    assert lp.ws_defers_reduce(8, 1792, 132) == (env != "0")   # 14 column blocks: split groups
    planned = {(2, 0, 32): True, (8, 0, 65): True, (2, 0, 66): False, (1, 0, 11): False, (4, 6, 11): False}
    for (mt, cluster, groups), expected in planned.items():
        wanted = {None: expected, "0": False, "1": not cluster}[env]
        assert lp.mma_defers_reduce(mt, cluster, groups, 132) == wanted, (mt, cluster, groups)


def test_stage_plans_keep_their_doubled_grid_rows_within_the_limit(launches):
    """Stage blocks double a packed plan's grid rows (route blocks along z): a stage plan whose route blocks pass half
    the grid limit takes the Triton experts, the same plan without stages keeps the CUDA ones."""
    from exl3moe.kernels.moe_mma import MAX_GRID_ROWS
    from exl3moe.kernels.route_pack import route_pack_max_blocks

    g = torch.Generator().manual_seed(5)
    experts = random_experts(8, 256, 256, K=4, codebook="mcg", generator=g)
    stage = random_stage(experts, torch.rand(8, 3, generator=g), K=2, codebook="mcg", generator=g)
    staged = type(experts)(experts.gate, experts.up, experts.down, "silu", None, [stage], "experts")
    slots = 16 * 40000
    assert MAX_GRID_ROWS // 2 < route_pack_max_blocks(slots, 8, 16) <= MAX_GRID_ROWS
    assert moe_plan(experts, slots // 2, 2, slot_capacity=slots, block_m=16).mma is not None
    assert moe_plan(staged, slots // 2, 2, slot_capacity=slots, block_m=16).mma is None


def test_stage_plans_order_route_blocks_with_active_stages_first(launches, monkeypatch):
    """A route-packed mma.sync plan of stages lists the experts that have a nonzero stage scale first in its
    route-block order (stably), and rewrites that order in place when its stages are swapped."""
    g = torch.Generator().manual_seed(6)
    experts = random_experts(8, 256, 256, K=4, codebook="mcg", generator=g)
    scales = torch.zeros(8, 3)
    scales[[2, 5], 1] = 0.5
    staged = type(experts)(experts.gate, experts.up, experts.down, "silu", None,
                           [random_stage(experts, scales, K=2, codebook="mcg", generator=g)], "experts")
    plan = moe_plan(staged, 20, 2, block_m=16)
    assert plan.mma.stage_blocks
    order = plan.expert_order
    assert order.tolist() == [2, 5, 0, 1, 3, 4, 6, 7]
    other = scales.clone()
    other[:] = 0
    other[7, 2] = 0.25
    plan.load_stages([random_stage(experts, other, K=2, codebook="mcg", generator=g)])
    assert plan.expert_order is order and order.tolist() == [7, 0, 1, 2, 3, 4, 5, 6]
    plan.load_stages([])
    assert order.tolist() == list(range(8))
    assert moe_plan(experts, 20, 2, block_m=16).expert_order is None, "a uniform layer without stages keeps none"
    one_accumulator = moe_plan(staged, 20, 2, block_m=32)   # long blocks (base then stage) start first
    assert not one_accumulator.mma.stage_blocks and one_accumulator.expert_order.tolist()[:2] == [2, 5]
    assert moe_plan(staged, 1, 2).mma.direct and moe_plan(staged, 1, 2).expert_order is None, "no route pack"
    monkeypatch.setattr(moe_planning, "uses_ws", lambda block_m, device: block_m == 128)
    ws = moe_plan(staged, 200, 2, block_m=128)
    assert ws.mma.ws and ws.expert_order is None, "warp-specialized plans keep their order"
