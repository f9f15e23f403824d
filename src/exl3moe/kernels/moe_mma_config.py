"""MoeMmaPlan, the CUDA experts' kernel configuration (ops/moe_planning.py decides its fields; moe_mma_source
compiles it; moe_mma launches it), and what follows from it alone: warps, dynamic shared memory and scratch."""

from __future__ import annotations

from dataclasses import dataclass

from .trellis_ws import WS_STAGE_KTILES, WS_STAGES, ws_ring_shared_bytes

WS_CONSUMER_THREADS = 256  # trellis_ws.cuh's CONSUMERS warps
MOE_WS_RING_KTILES = 40  # the MoE ring (160 KB): its blocks keep no running sum, so more than the linear's fit
WS_GATE_UP_RING_KTILES = 24  # the persistent gate/up's ring, beside its 64 KB of gate values
WIDE_BLOCK_M, WIDE_RING_KTILES = 192, 32  # three consumer warpgroups; their ring beside 96 KB of x chunks


@dataclass(frozen=True)
class MoeMmaPlan:
    """One expert set's CUDA kernels for route blocks of block_m rows: splits, formats, variants, compiled kernels."""

    block_m: int  # route-block rows: 16 x m16 tiles of the kernels
    warps: int  # warps per block, each with 8 / warps n16 tiles (128 columns per block)
    gate_up_formats: tuple  # ((2K, codebook id), ...) of gate and up
    down_formats: tuple
    stage_formats: tuple  # every format a residual stage may have in this plan (empty without stages)
    gate_up_splits: int
    gate_up_ktiles: int
    down_splits: int
    down_ktiles: int
    pre_rotate: bool  # gate/up inputs rotated once per position by moe_rotate_input, not in every column block
    direct: bool = False  # one block per slot, read from topk_ids (no route pack); down also combines
    ws: bool = False  # gate/up's 128-row blocks warp-specialized (trellis_ws.cuh): ws_threads, dynamic smem
    ws_gate_up: bool = False  # gate/up persistent on ws (moe_gate_up_ws; single-split plans; opt-in): no partials
    ws_down: bool = False  # down persistent and warp-specialized (moe_down_ws; single-split plans): no partials
    ws_stages: int = WS_STAGES  # ring stages of the warp-specialized kernels
    ws_stage_ktiles: int = WS_STAGE_KTILES  # k-tiles per ring stage
    x_tma: bool = False  # ws gate/up and down stage x by TMA (X_TMA; not the persistent gate/up)
    ws_paired: bool = False  # ws gate/up and down on 12 paired producers (WS_PRODUCERS; not the persistent gate/up)
    small_call: bool = False  # a call of at most SMALL_CALL_SLOTS slots (moe_planning)
    one_wave: bool = False  # direct, and a full call's gate/up blocks fit at DIRECT_GATE_UP_MIN_BLOCKS per SM
    down_one_wave: bool = False  # the same of down's blocks
    route_major: bool = True  # gate/up and down grids: column blocks along x, route blocks along y (not the reverse)
    split_inner: bool = False  # route-major grids with splits along y and route blocks along z (split_inner_grid)
    early_down: bool = False  # down launched while gate/up finishes (EARLY_LAUNCH; early_launch)
    early_gate_up: bool = False  # gate/up launched while the previous expert set's down finishes (EARLY_GATE_UP)
    stage_blocks: bool = False  # the stages' passes in blocks of their own (STAGE_BLOCKS; stage_blocks)
    split_peer: int = 0  # split route blocks (split_route_blocks): 1 the 128-row kernels, 2 the 192-row ones
    gate_up_kernel: object = None  # CUfunctions, set by compile_kernels
    down_kernel: object = None
    rotate_kernel: object = None


def warps_for(block_m: int) -> int:
    """4 warps of two n16 tiles up to 32 rows; 8 warps of one n16 tile above, so the accumulators fit registers."""
    return 4 if block_m <= 32 else 8


def ws_shared_bytes(plan: MoeMmaPlan, name: str) -> int:
    """Dynamic shared memory of a warp-specialized kernel: trellis_ws.cuh's, plus each consumer thread's 64 gate
    values for moe_gate_up_ws."""
    gate_values = WS_CONSUMER_THREADS * 64 * 4 if name == "moe_gate_up_ws" else 0
    x_barriers = 2 * 8 if plan.x_tma else 0
    return ws_ring_shared_bytes(plan.ws_stages, plan.ws_stage_ktiles, plan.block_m) + gate_values + x_barriers


def partial_splits(plan: MoeMmaPlan, splits: int) -> int:
    """Partials per row of gate/up or down: the base's k splits, and as many again for the stages with stage_blocks."""
    return 2 * splits if plan.stage_blocks else splits


def workspace_numels(plan: MoeMmaPlan, capacity: int, max_blocks: int, hidden: int, inter: int) -> dict:
    """Elements of the fp32 partials of gate/up and down, the int32 arrival counters (zeroed once; kernels reset
    them) and the pre-rotated fp16 inputs."""
    gate_up_partial = partial_splits(plan, plan.gate_up_splits) * 2 * capacity * inter
    return {"gate_up_partial": 0 if plan.ws_gate_up else gate_up_partial,
            "down_partial": 0 if plan.ws_down else partial_splits(plan, plan.down_splits) * capacity * hidden,
            "gate_up_counters": 0 if plan.ws_gate_up else max_blocks * (inter // 128),
            "down_counters": 0 if plan.ws_down else max_blocks * (hidden // 128),
            "x_rot": 2 * capacity * hidden if plan.pre_rotate else 0}
