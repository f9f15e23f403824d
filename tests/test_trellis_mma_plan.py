"""CPU checks of the CUDA C++ linear's planning: splits from (k, n) only, whole chunks, no empty split."""

from dataclasses import replace
from importlib import resources

import pytest
import torch

from exl3moe.kernels import nvrtc
from exl3moe.kernels.trellis_mma import CHUNK_K, counter_count
from exl3moe.ops.linear_planning import m_tiles, plan_mma


@pytest.mark.parametrize("k,n", [(128, 128), (768, 2048), (2048, 768), (4096, 14336), (14336, 4096), (1408, 4096)])
@pytest.mark.parametrize("target", [1, 1024, 4096, 1 << 20])
def test_splits_cover_k_in_whole_chunks(k, n, target):
    m = plan_mma(k, n, target)
    ktiles = k // 16
    assert m.ktiles_per_split % (CHUNK_K // 16) == 0
    assert (m.splits - 1) * m.ktiles_per_split < ktiles <= m.splits * m.ktiles_per_split


def test_m_tiles_cover_rows_up_to_128():
    for rows in range(1, 129):
        mt = m_tiles(rows)
        assert mt in (1, 2, 4, 8) and mt * 16 >= rows and (mt == 1 or mt * 8 < rows)


def test_counters_cover_every_row_block():
    assert counter_count(14336, 1) == 112
    assert counter_count(2048, 128) == 16 * 8
    assert counter_count(2048, 4096) == 16 * 8


def test_cuda_source_is_packaged_and_cpu_tensors_do_not_use_it():
    source = resources.files("exl3moe.kernels").joinpath("cuda", "trellis_mma.cu").read_text()
    assert "extern \"C\" __global__" in source and "trellis_mma(" in source and "rotate_input(" in source
    assert not nvrtc.available(torch.device("cpu"))


def test_rotation_fusion_depends_on_rows_and_shape_only():
    from exl3moe.ops.linear_planning import fuses_rotation
    assert fuses_rotation(16, 2048, 768) and not fuses_rotation(17, 2048, 768)
    assert fuses_rotation(4, 4096, 14336) and not fuses_rotation(5, 4096, 14336)


def test_moe_mma_layout_covers_every_projection_and_stage_format():
    from helpers import random_experts

    from exl3moe.kernels.moe_mma_config import warps_for
    from exl3moe.kernels.moe_mma_source import _dispatch
    from exl3moe.ops.moe_planning import formats_up_to, moe_mma_layout

    experts = random_experts(6, 256, 384, K=[4, 2.5, 4, 3, 4, 2.5],
                             codebook=["mcg", "mul1", "3inst", "mul1", "mcg", "mul1"])
    ids = {"3inst": 0, "mcg": 1, "mul1": 2}
    for block_m, stage_k2 in ((16, 0), (32, 4), (128, 8)):
        plan = moe_mma_layout(experts, max_slots=8, block_m=block_m, stage_formats=formats_up_to(stage_k2))
        assert plan.warps == warps_for(block_m) and plan.warps * (8 // plan.warps) == 8
        for proj in ("gate", "up", "down"):
            formats = plan.down_formats if proj == "down" else plan.gate_up_formats
            assert all((int(w.K * 2), ids[w.codebook]) in formats for w in getattr(experts, proj))
        assert plan.stage_formats == formats_up_to(stage_k2)
        assert plan.gate_up_ktiles % 8 == 0 and (plan.gate_up_splits - 1) * plan.gate_up_ktiles < 256 // 16
        assert plan.down_ktiles % 8 == 0 and (plan.down_splits - 1) * plan.down_ktiles < 384 // 16
        text = _dispatch("DISPATCH_DOWN", plan.down_formats, block_m // 16, 8 // plan.warps)
        assert all(f"case {4 * k2 + cb}: mma_mainloop<{k2}, {cb}, {block_m // 16}," in text
                   for k2, cb in plan.down_formats)
    assert len(formats_up_to(8)) == 15 and (3, 0) not in formats_up_to(8) and (3, 2) in formats_up_to(8)
    assert formats_up_to(0) == ()
    assert formats_up_to(4, ("mcg",)) == ((2, 1), (4, 1))
    assert formats_up_to(3, ("mul1", "mcg")) == ((2, 1), (2, 2), (3, 2))

def test_packed_plans_split_for_more_warps_with_gate_up_splits_of_three_chunks_or_more():
    from types import SimpleNamespace

    from exl3moe.ops.moe_planning import PACKED_MIN_SPLIT_CHUNKS, moe_mma_layout

    def shape(H, I):
        w = SimpleNamespace(K=4, codebook="mcg")
        return SimpleNamespace(num_experts=128, planned_experts=128, hidden_size=H, intermediate_size=I,
                               planned_intermediate=I, gate=[w], up=[w], down=[w])

    qwen3, glm = shape(2048, 768), shape(4096, 1408)
    splits = lambda e, slots, **kw: (lambda p: (p.gate_up_splits, p.down_splits))(  # noqa: E731
        moe_mma_layout(e, slots, 16, **kw))
    assert [splits(qwen3, 8 * T) for T in (4, 8, 16)] == [(6, 3), (4, 2), (2, 1)]
    assert [splits(glm, 8 * T) for T in (4, 8, 16)] == [(5, 2), (3, 1), (2, 1)]
    assert splits(qwen3, 8, direct=True) == (8, 6), "one-row direct blocks keep TARGET_WARPS"
    plan = moe_mma_layout(qwen3, 32, 16)
    assert plan.gate_up_ktiles == PACKED_MIN_SPLIT_CHUNKS * 8, "not 8 splits of 2 chunks"
    assert moe_mma_layout(qwen3, 8192, 128).gate_up_splits == 1, "warp-specialized plans keep one split"


def test_few_format_stage_plans_take_one_switch_at_16_rows_and_five_blocks_per_sm_at_32(monkeypatch):
    from exl3moe.kernels.moe_mma_config import MoeMmaPlan
    from exl3moe.kernels.moe_mma_source import kernel_source, union_stages

    plan = MoeMmaPlan(16, 4, ((8, 1),), ((8, 1),), ((2, 1), (4, 1)), 2, 64, 1, 48, False)
    assert union_stages(plan)
    for name, macro in (("moe_gate_up_mma", "DISPATCH_GATE_UP"), ("moe_down_mma", "DISPATCH_DOWN")):
        defines, prelude = kernel_source(plan, name)
        assert dict(defines)["UNION_STAGES"] == 1
        line = next(t for t in prelude.splitlines() if t.startswith(f"#define {macro}("))
        assert all(f"mma_mainloop<{k2}, 1," in line for k2 in (2, 4, 8))
        assert prelude.count("mma_mainloop") == 3, "each format once, no separate stage switch"
    assert not union_stages(MoeMmaPlan(16, 4, ((8, 1),), ((8, 1),), (), 2, 64, 1, 48, False)), "no stages"
    many = MoeMmaPlan(16, 4, ((6, 1), (8, 1)), ((6, 1), (8, 1)), ((2, 1), (4, 1)), 2, 64, 1, 48, False)
    assert not union_stages(many), "four formats: a switch each"
    assert not union_stages(MoeMmaPlan(32, 4, ((8, 1),), ((8, 1),), ((2, 1), (4, 1)), 2, 64, 1, 48, False))
    assert not union_stages(MoeMmaPlan(16, 4, ((8, 1),), ((8, 1),), ((2, 1), (4, 1)), 8, 16, 6, 8, False, True))
    rows32 = MoeMmaPlan(32, 4, ((8, 1),), ((8, 1),), ((2, 1), (4, 1)), 2, 64, 1, 48, False)
    assert all(dict(kernel_source(rows32, n)[0]).get("MIN_BLOCKS") == 5 for n in ("moe_gate_up_mma", "moe_down_mma"))
    assert "MIN_BLOCKS" not in dict(kernel_source(MoeMmaPlan(32, 4, ((8, 1),), ((8, 1),), (), 2, 64, 1, 48, False),
                                                  "moe_gate_up_mma")[0]), "the base keeps ptxas's choice"
    monkeypatch.setenv("EXL3MOE_MOE_UNION_STAGES", "0")
    assert not union_stages(plan) and "UNION_STAGES" not in dict(kernel_source(plan, "moe_down_mma")[0])
    assert "MIN_BLOCKS" not in dict(kernel_source(rows32, "moe_gate_up_mma")[0])


@pytest.mark.parametrize("K, bound", [(2, True), (4, True), (3, False), (6, False)])
def test_one_format_direct_kernels_of_one_wave_take_the_bound_formats_registers(K, bound):
    """A one-row call of one K2 / K4 MCG format whose gate/up (or down) blocks fit one wave at
    DIRECT_GATE_UP_MIN_BLOCKS per SM gets registers for that many (ONE_WAVE_BOUND_FORMATS); other formats, calls of
    two waves and stage plans keep their bounds."""
    from helpers import random_experts

    from exl3moe.kernels.moe_mma_source import (DIRECT_DOWN_MIN_BLOCKS, DIRECT_DOWN_MIN_BLOCKS_MIXED,
                                                DIRECT_GATE_UP_MIN_BLOCKS, kernel_source)
    from exl3moe.ops.moe_planning import moe_mma_layout

    direct = moe_mma_layout(random_experts(4, 256, 256, K=K, codebook="mcg"), max_slots=8, block_m=16, direct=True)
    gate_up = lambda plan: dict(kernel_source(plan, "moe_gate_up_mma")[0]).get("MIN_BLOCKS")  # noqa: E731
    down = lambda plan: dict(kernel_source(plan, "moe_down_mma")[0])["MIN_BLOCKS"]  # noqa: E731
    both = replace(direct, one_wave=True, down_one_wave=True)
    assert gate_up(both) == (DIRECT_GATE_UP_MIN_BLOCKS if bound else None)
    assert down(both) == (DIRECT_DOWN_MIN_BLOCKS_MIXED if bound else DIRECT_DOWN_MIN_BLOCKS)
    down_only = replace(direct, down_one_wave=True)   # gate/up of two waves: ptxas's own count
    assert gate_up(down_only) is None and down(down_only) == down(both)
    assert gate_up(direct) is None and down(direct) == DIRECT_DOWN_MIN_BLOCKS   # two waves of each
    staged = replace(moe_mma_layout(random_experts(4, 256, 256, K=K, codebook="mcg"), max_slots=8, block_m=16,
                                    stage_formats=((4, 1),), direct=True), one_wave=True, down_one_wave=True)
    assert gate_up(staged) == DIRECT_GATE_UP_MIN_BLOCKS and down(staged) == DIRECT_DOWN_MIN_BLOCKS_MIXED


def test_decode_variants_follow_block_rows_and_format_count():
    from helpers import random_experts

    from exl3moe.kernels.moe_mma_source import (DIRECT_DOWN_MIN_BLOCKS, DIRECT_DOWN_MIN_BLOCKS_MIXED,
                                                DIRECT_GATE_UP_MIN_BLOCKS, kernel_source)
    from exl3moe.kernels.trellis_mma import pair_scalar
    from exl3moe.ops.moe_planning import moe_mma_layout

    assert [pair_scalar(mt) for mt in (1, 2, 4, 8)] == [3, 3, 0, 0]
    uniform = random_experts(4, 256, 256, K=4, codebook="mcg")
    two = random_experts(4, 256, 256, K=[3, 4, 3, 4], codebook="mcg")
    many = random_experts(4, 256, 256, K=[2, 3, 4, 5], codebook="mcg")
    # Packed blocks of few rows: the PRMT pack (1), or the FMA-pipe pack (2) with many formats; many rows: PRMT + HADD2.
    cases = ((uniform, 16, 8, 1), (two, 16, 8, 1), (many, 16, 4, 2), (many, 32, 4, 2), (many, 64, 8, 0))
    for experts, block_m, unroll, pair_sums in cases:
        plan = moe_mma_layout(experts, max_slots=64, block_m=block_m)   # not a small call (SMALL_CALL_SLOTS)
        for name in ("moe_gate_up_mma", "moe_down_mma"):
            defines = dict(kernel_source(plan, name)[0])
            assert defines["KTILE_UNROLL"] == unroll and defines["PAIR_SCALAR"] == pair_sums
    direct = moe_mma_layout(uniform, max_slots=8, block_m=16, direct=True)
    assert direct.direct and dict(kernel_source(direct, "moe_gate_up_mma")[0])["PAIR_SCALAR"] == pair_scalar(1)
    # One-row gate/up of more than one mainloop is held to DIRECT_GATE_UP_MIN_BLOCKS blocks per SM; one-row down
    # to DIRECT_DOWN_MIN_BLOCKS (one mainloop) or DIRECT_DOWN_MIN_BLOCKS_MIXED; nothing else is.
    staged = replace(moe_mma_layout(uniform, max_slots=8, block_m=16, stage_formats=((4, 1),), direct=True),
                     one_wave=True)
    assert dict(kernel_source(staged, "moe_gate_up_mma")[0])["MIN_BLOCKS"] == DIRECT_GATE_UP_MIN_BLOCKS
    two = replace(moe_mma_layout(two, max_slots=8, block_m=16, direct=True), one_wave=True)
    assert dict(kernel_source(two, "moe_gate_up_mma")[0])["MIN_BLOCKS"] == DIRECT_GATE_UP_MIN_BLOCKS
    waves = replace(two, one_wave=False)   # blocks in more than one wave anyway: ptxas's own register count
    unbounded = ((direct, "moe_gate_up_mma"), (waves, "moe_gate_up_mma"))
    assert all("MIN_BLOCKS" not in dict(kernel_source(p, n)[0]) for p, n in unbounded)
    downs = ((direct, DIRECT_DOWN_MIN_BLOCKS), (staged, DIRECT_DOWN_MIN_BLOCKS_MIXED),
             (two, DIRECT_DOWN_MIN_BLOCKS_MIXED))
    assert all(dict(kernel_source(p, "moe_down_mma")[0])["MIN_BLOCKS"] == bound for p, bound in downs)
    packed = moe_mma_layout(uniform, max_slots=64, block_m=16)
    assert not {"MIN_BLOCKS", "COMBINE_AHEAD"} & set(dict(kernel_source(packed, "moe_down_mma")[0]))
    # Packed kernels of four or more formats read their epilogue vectors once per block.
    spread = moe_mma_layout(many, max_slots=64, block_m=16)
    assert all(dict(kernel_source(spread, n)[0]).get("PACKED_EPILOGUE_AHEAD") == 1
               for n in ("moe_gate_up_mma", "moe_down_mma"))
    assert all("PACKED_EPILOGUE_AHEAD" not in dict(kernel_source(p, n)[0]) for p in (packed, direct)
               for n in ("moe_gate_up_mma", "moe_down_mma"))
    # Packed 16-row gate/up without stages asks L2 for its suh first; down, direct, 32-row and stage kernels do not.
    assert dict(kernel_source(packed, "moe_gate_up_mma")[0]).get("SUH_PREFETCH") == 1
    rows32 = moe_mma_layout(uniform, max_slots=64, block_m=32)
    with_stage = moe_mma_layout(uniform, max_slots=64, block_m=16, stage_formats=((4, 1),))
    assert all("SUH_PREFETCH" not in dict(kernel_source(p, n)[0])
               for p, n in ((packed, "moe_down_mma"), (direct, "moe_gate_up_mma"), (rows32, "moe_gate_up_mma"),
                            (with_stage, "moe_gate_up_mma")))


def test_direct_route_limit_depends_on_slots_and_formats():
    from helpers import random_experts

    from exl3moe.ops.moe_planning import direct_route, format_count

    uniform = random_experts(4, 256, 256, K=4, codebook="mcg")
    many = random_experts(4, 256, 256, K=[2, 3, 4, 4], codebook=["mcg", "mcg", "mcg", "mul1"])
    assert format_count(uniform) == 1 and format_count(many) == 4
    assert direct_route(16, 16, 1) and not direct_route(24, 16, 1) and not direct_route(16, 32, 1)
    assert direct_route(8, 16, 4) and not direct_route(16, 16, 4)


def test_warp_specialized_kernel_takes_every_weight_from_the_row_threshold(monkeypatch):
    from exl3moe.ops import linear_planning as lp

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    rows, mid, large = lp.WS_MIN_ROWS, lp.WS_MIN_ROWS_MID, lp.WS_MIN_ROWS_LARGE
    assert lp.uses_ws(rows, 768, 2048, cuda) and lp.uses_ws(mid, 4096, 1408, cuda)
    assert lp.uses_ws(large, 4096, 14336, cuda)
    assert not lp.uses_ws(rows - 1, 768, 2048, cuda), "fewer rows stay on trellis_mma"
    assert not lp.uses_ws(mid - 1, 1408, 4096, cuda), "mid-size weights from more rows"
    assert not lp.uses_ws(large - 1, 14336, 4096, cuda), "large weights from more rows still"
    assert not lp.uses_ws(128, 2048, 768, torch.device("cpu"))
    monkeypatch.setenv("EXL3MOE_WS", "0")
    assert not lp.uses_ws(128, 2048, 768, cuda)
    monkeypatch.setenv("EXL3MOE_WS", "1")
    for capability in ((8, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert not lp.uses_ws(128, 2048, 768, cuda), "wgmma is sm_90a only"


@pytest.mark.parametrize("K", [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8])
def test_words_per_lane_cover_every_lane_window(K):
    from exl3moe.kernels.trellis_mma import words_per_lane

    k2 = int(K * 2)
    span = 4 * k2 - k2 // 2 + 16  # a lane's windows: bits [first, first + span) of the tile's ring
    touched = [(first + span - 1) // 32 - first // 32 + 1
               for first in (4 * lane * k2 + k2 // 2 - 16 + 128 * k2 for lane in range(32))]
    assert max(touched) <= words_per_lane(K)
    if k2 % 8 == 0:  # every lane starts at the same bit offset: no word to spare
        assert max(touched) == words_per_lane(K)


def test_whole_split_prefetch_only_on_small_grids_of_two_word_formats():
    from exl3moe.kernels.trellis_mma import PREFETCH
    from exl3moe.ops.linear_planning import WHOLE_SPLIT_PREFETCH, prefetch_for

    assert [prefetch_for(1, 768, 2048, K) for K in (1, 1.5, 2, 3, 4, 6, 8)] == \
        [WHOLE_SPLIT_PREFETCH] * 3 + [PREFETCH, WHOLE_SPLIT_PREFETCH, PREFETCH, PREFETCH]
    assert prefetch_for(16, 1408, 4096, 4) == WHOLE_SPLIT_PREFETCH and prefetch_for(17, 1408, 4096, 4) == PREFETCH
    assert prefetch_for(1, 4096, 14336, 4) == PREFETCH  # splits of four chunks
    assert prefetch_for(1, 4096, 4096, 4) == PREFETCH  # one-chunk splits, but 1024 blocks


def test_benchmark_copies_cycle_past_the_l2():
    from exl3moe.timing import L2_ROTATION_BYTES, copies_for

    for size in (393216, 786432, 29360128):
        assert copies_for(size) * size >= L2_ROTATION_BYTES
    assert copies_for(1 << 30) == 2


def test_clusters_take_small_grids_of_two_to_sixteen_splits_in_128_column_blocks(monkeypatch):
    from exl3moe.kernels.trellis_mma import MAX_CLUSTER
    from exl3moe.ops.linear_planning import CLUSTER_MAX_BLOCKS, cluster_splits

    monkeypatch.delenv("EXL3MOE_LINEAR_CLUSTER", raising=False)
    assert [cluster_splits(2, s, 16) for s in (1, 2, 6, 11, MAX_CLUSTER, MAX_CLUSTER + 1)] == [0, 2, 6, 11, 16, 0]
    assert cluster_splits(1, 8, 16) == 0, "64-column blocks: a group is two blocks per split"
    assert cluster_splits(2, 8, CLUSTER_MAX_BLOCKS // 8) == 8
    assert cluster_splits(2, 8, CLUSTER_MAX_BLOCKS // 8 + 1) == 0, "large grids keep the L2 reduction"
    monkeypatch.setenv("EXL3MOE_LINEAR_CLUSTER", "1")
    assert cluster_splits(2, 8, 4096) == 8 and cluster_splits(2, MAX_CLUSTER + 1, 1) == 0
    monkeypatch.setenv("EXL3MOE_LINEAR_CLUSTER", "0")
    assert cluster_splits(2, 6, 16) == 0


def test_one_row_calls_that_fit_one_wave_at_seven_blocks_per_sm_get_registers_for_seven():
    from exl3moe.kernels.trellis_mma import PREFETCH
    from exl3moe.ops.linear_planning import ONE_WAVE_MIN_BLOCKS, one_wave_min_blocks

    sms = 132
    tiles = plan_mma(4096, 14336)
    blocks = 14336 // 128 * tiles.splits
    assert one_wave_min_blocks(True, PREFETCH, blocks, sms) == ONE_WAVE_MIN_BLOCKS, "896 blocks: 6.8 per SM"
    assert one_wave_min_blocks(False, PREFETCH, blocks, sms) == 0, "pre-rotated rows keep ptxas's choice"
    assert one_wave_min_blocks(True, 8, blocks, sms) == 0, "the whole-split prefetch needs its registers"
    assert one_wave_min_blocks(True, PREFETCH, 6 * sms, sms) == 0, "fits one wave at 6 per SM already"
    assert one_wave_min_blocks(True, PREFETCH, 7 * sms + 1, sms) == 0, "two waves either way"


def test_packed_calls_past_small_ones_launch_a_route_blocks_splits_together(monkeypatch):
    from helpers import random_experts

    from exl3moe.kernels.moe_mma import _grid
    from exl3moe.kernels.moe_mma_source import kernel_source
    from exl3moe.ops.moe_planning import moe_mma_layout, split_inner_grid

    layer = random_experts(8, 256, 256, K=4, codebook="mcg")
    packed = moe_mma_layout(layer, max_slots=64, block_m=16)
    assert split_inner_grid(packed)
    inner = replace(packed, split_inner=True)
    assert all(dict(kernel_source(inner, n)[0])["SPLIT_INNER"] == 1 for n in ("moe_gate_up_mma", "moe_down_mma"))
    assert _grid(inner, 10, 4, 3) == (4, 3, 10) and _grid(packed, 10, 4, 3) == (4, 10, 3)
    assert "SPLIT_INNER" not in dict(kernel_source(packed, "moe_gate_up_mma")[0])
    small = moe_mma_layout(layer, max_slots=32, block_m=16)
    direct = moe_mma_layout(layer, max_slots=8, block_m=16, direct=True)
    assert small.small_call and not split_inner_grid(small) and not split_inner_grid(direct)
    assert not split_inner_grid(replace(packed, ws=True)) and not split_inner_grid(replace(packed, route_major=False))
    monkeypatch.setenv("EXL3MOE_MOE_SPLIT_INNER", "0")
    assert not split_inner_grid(packed)


def test_stage_plans_on_mma_sync_run_their_stages_in_blocks_of_their_own(monkeypatch):
    from exl3moe.kernels.moe_mma import _grid
    from exl3moe.kernels.moe_mma_config import MoeMmaPlan, partial_splits
    from exl3moe.kernels.moe_mma_source import kernel_source
    from exl3moe.ops.moe_planning import stage_blocks

    staged = MoeMmaPlan(16, 4, ((8, 1),), ((8, 1),), ((4, 1),), 2, 64, 3, 16, False)
    assert stage_blocks(staged)
    assert not stage_blocks(replace(staged, small_call=True)), "every block of a small call is in flight at once"
    assert not stage_blocks(replace(staged, direct=True)) and not stage_blocks(replace(staged, block_m=32))
    blocks = replace(staged, stage_blocks=True)
    assert partial_splits(blocks, 3) == 6 and partial_splits(staged, 3) == 3
    assert _grid(blocks, 10, 4, 3) == (4, 10, 6) and _grid(replace(blocks, split_inner=True), 10, 4, 3) == (4, 3, 20)
    assert ("STAGE_BLOCKS", 1) in kernel_source(blocks, "moe_down_mma")[0]
    assert "STAGE_BLOCKS" not in dict(kernel_source(staged, "moe_down_mma")[0])
    assert not stage_blocks(replace(staged, stage_formats=())), "no stages"
    assert not stage_blocks(replace(staged, block_m=128, ws=True)), "a warp-specialized block runs its own stages"
    monkeypatch.setenv("EXL3MOE_MOE_STAGE_BLOCKS", "0")
    assert not stage_blocks(staged)


def test_direct_stage_plans_read_the_first_stage_scale_ahead(monkeypatch):
    from exl3moe.kernels.moe_mma_config import MoeMmaPlan
    from exl3moe.kernels.moe_mma_source import kernel_source, scale_ahead

    direct = MoeMmaPlan(16, 4, ((8, 1),), ((8, 1),), ((4, 1),), 8, 16, 6, 8, False, True)
    assert scale_ahead(direct) and ("SCALE_AHEAD", 1) in kernel_source(direct, "moe_gate_up_mma")[0]
    assert not scale_ahead(replace(direct, stage_formats=())), "no stages"
    assert not scale_ahead(replace(direct, direct=False)), "packed plans read it after the base"
    monkeypatch.setenv("EXL3MOE_MOE_SCALE_AHEAD", "0")
    assert not scale_ahead(direct)


def test_direct_stage_plans_ask_l2_for_the_stage_words_ahead(monkeypatch):
    from exl3moe.kernels.moe_mma_config import MoeMmaPlan
    from exl3moe.kernels.moe_mma_source import kernel_source, stage_words_ahead

    direct = MoeMmaPlan(16, 4, ((8, 1),), ((8, 1),), ((4, 1),), 8, 16, 6, 8, False, True)
    for name in ("moe_gate_up_mma", "moe_down_mma"):
        assert ("STAGE_WORDS_AHEAD", 1) in kernel_source(direct, name)[0]
    assert not stage_words_ahead(replace(direct, stage_formats=())), "no stages"
    assert not stage_words_ahead(replace(direct, direct=False)), "packed plans leave them to the stage's mainloop"
    assert "STAGE_WORDS_AHEAD" not in dict(kernel_source(replace(direct, direct=False), "moe_down_mma")[0])
    monkeypatch.setenv("EXL3MOE_MOE_STAGE_WORDS_AHEAD", "0")
    assert not stage_words_ahead(direct)
    assert "STAGE_WORDS_AHEAD" not in dict(kernel_source(direct, "moe_gate_up_mma")[0])
