"""Routed experts on the CUDA C++ decode core (cuda/moe_mma.cu) for route blocks of 16 to 128 rows.

Same contract as the Triton gate/up and down kernels (h_rot [pos, I] fp16, y [slot, H] fp32), but each
projection's hidden (gate/up) or intermediate (down) range is split so that enough warps are in flight at small
batches; the last block of each (route block, 128 columns) sums the splits in order and applies the epilogue.
Splits come from the plan's shape (max slots, E, H, I), never from the data, so outputs stay batch invariant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..errors import ContractError
from . import nvrtc
from .trellis_decode import CODEBOOK_ID
from ..ops.linear_planning import chunk_splits
from .trellis_mma import CHUNK_K, PAIR_SCALAR_MAX_MT, pair_scalar
from .trellis_ws import WS_STAGE_KTILES, WS_STAGES, ws_ring_shared_bytes, ws_threads

PREFETCH = 4
CHUNK_KTILES, MIXED_KTILE_UNROLL = CHUNK_K // 16, 4  # the mainloop's CHUNK; a multiple of PREFETCH dividing it
MIXED_MIN_FORMATS, MIXED_MAX_MT = 4, 2
# One-row gate/up of more than one mainloop (formats or stages) whose blocks fit one wave at this many per SM:
# registers for that many (ptxas would give such kernels 80-92, 5-6 per SM).
DIRECT_GATE_UP_MIN_BLOCKS = 7
STAGE_32_ROW_MIN_BLOCKS = 5  # a stage plan's 32-row kernels (stage_min_blocks)
# A direct plan's down reads its combine's first slots ahead of the arrival, with registers for this many blocks
# per SM: one mainloop (where ptxas fits it without a spill), more mainloops (direct_down_defines, _kernel).
DIRECT_COMBINE_AHEAD, DIRECT_DOWN_MIN_BLOCKS, DIRECT_DOWN_MIN_BLOCKS_MIXED = 8, 8, 7
# One-format (2K, codebook) of direct kernels that run faster with registers for DIRECT_GATE_UP_MIN_BLOCKS blocks per
# SM where a call's blocks fit one wave at that many (K2 / K4 MCG; K3 / K5 ran slower, K6 the same).
ONE_WAVE_BOUND_FORMATS = ((4, 1), (8, 1))
SMALL_CALL_SLOTS, SMALL_CALL_UNROLL = 32, 2  # calls of so few slots run every block at once: smallest mainloops
MAX_GRID_ROWS = 65535  # gridDim.y (z with split_inner): gate/up and down launch one grid row per route block
ACTIVATIONS = {"silu": 0, "gelu": 1}  # the kernel's ids (gated activations only)
STAGE_MAX_K2 = 8
PRE_ROTATE_BLOCK_M = 64
DIRECT_MAX_SLOTS, DIRECT_MAX_SLOTS_MIXED = 16, 8
ROTATE_ROWS = 8  # rows per moe_rotate_input block (the kernel's constant)
# Warps wanted in flight at the plan's largest call: below this the k range of gate/up and down is split.
TARGET_WARPS = 4096
# Packed 16- and 32-row route blocks want more (finer waves), with gate/up splits of at least 3 chunks.
PACKED_GATE_UP_TARGET_WARPS, PACKED_DOWN_TARGET_WARPS, PACKED_MIN_SPLIT_CHUNKS = 12288, 8192, 3


@dataclass(frozen=True)
class MoeMmaPlan:
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
    small_call: bool = False  # at most SMALL_CALL_SLOTS slots per call
    one_wave: bool = False  # direct, and a full call's gate/up blocks fit at DIRECT_GATE_UP_MIN_BLOCKS per SM
    down_one_wave: bool = False  # the same of down's blocks
    route_major: bool = True  # gate/up and down grids: column blocks along x, route blocks along y (not the reverse)
    split_inner: bool = False  # route-major grids with splits along y and route blocks along z (split_inner_grid)
    early_down: bool = False  # down launched while gate/up finishes (EARLY_LAUNCH; early_launch)
    early_gate_up: bool = False  # gate/up launched while the previous expert set's down finishes (EARLY_GATE_UP)
    stage_blocks: bool = False  # the stages' passes in blocks of their own (STAGE_BLOCKS; stage_blocks)
    split_peer: int = 0  # split route blocks (split_route_blocks): 1 the 128-row kernels, 2 the 192-row ones
    gate_up_kernel: object = None  # CUfunctions, set by plan_moe_mma
    down_kernel: object = None
    rotate_kernel: object = None


def supported(experts, stage_max_k2: int) -> bool:
    """The CUDA path covers gated experts (silu or gelu, optional clamp, biases) and residual stages of K <= 4
    (each stage format is one more compiled mainloop; up to 2K = 8 that is 15 of them)."""
    return experts.gated and experts.activation in ACTIVATIONS and stage_max_k2 <= STAGE_MAX_K2


def formats_up_to(max_k2: int, codebooks: tuple = tuple(CODEBOOK_ID)) -> tuple:
    """Every valid (2K, codebook id) with 2K <= max_k2 and a codebook named in `codebooks`: half-integer K only
    with mul1."""
    mul1, ids = CODEBOOK_ID["mul1"], {CODEBOOK_ID[name] for name in codebooks}
    return tuple((k2, cb) for k2 in range(2, max_k2 + 1) for cb in sorted(ids) if k2 % 2 == 0 or cb == mul1)


def pre_rotates(block_m: int, max_slots: int = 0, direct: bool = False, formats: int = 1) -> bool:
    """Rotating each row in all 2 I / 128 column blocks costs more than a launch that rotates it once: from 64-row
    route blocks on, and in packed plans of more than SMALL_CALL_SLOTS slots or of MIXED_MIN_FORMATS formats
    (EXL3MOE_MOE_PRE_ROTATE_PACKED=0 keeps those rotating in the kernel); never in direct calls."""
    packed = max_slots > SMALL_CALL_SLOTS or formats >= MIXED_MIN_FORMATS
    packed = packed and os.environ.get("EXL3MOE_MOE_PRE_ROTATE_PACKED", "1") != "0"
    return not direct and (block_m >= PRE_ROTATE_BLOCK_M or packed)


def direct_route(max_slots: int, block_m: int, formats: int = 1) -> bool:
    """Up to DIRECT_MAX_SLOTS slots a call needs no route pack: each slot is a one-row block, and the last of a
    token's slot blocks combines it (two launches fewer). Repeated experts are decoded once per slot, and a layer of
    many formats runs them in slot order, so such layers take the pack sooner."""
    limit = DIRECT_MAX_SLOTS_MIXED if formats >= MIXED_MIN_FORMATS else DIRECT_MAX_SLOTS
    return block_m == 16 and max_slots <= limit


def projection_formats(experts) -> list:
    """[(2K, codebook id) of each expert] for gate, up and down (empty for a projection the layer lacks)."""
    return [[(int(w.K * 2), CODEBOOK_ID[w.codebook]) for w in getattr(experts, p) or ()]
            for p in ("gate", "up", "down")]


def format_count(experts) -> int:
    """Distinct (2K, codebook) pairs over every projection of an ExpertSet."""
    return len({f for formats in projection_formats(experts) for f in formats})


def warps_for(block_m: int) -> int:
    """4 warps of two n16 tiles up to 32 rows; 8 warps of one n16 tile above, so the accumulators fit registers."""
    return 4 if block_m <= 32 else 8


def moe_mma_layout(experts, max_slots: int, block_m: int, stage_formats: tuple = (),
                   direct: bool = False) -> MoeMmaPlan:
    """Formats and splits for an ExpertSet (no compilation); stage_formats ((2K, codebook id), ...) are the
    residual formats compiled in (each one more mainloop, and more registers); direct routes each slot on its
    own (direct_route)."""
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    fmt = projection_formats(experts)
    warps = warps_for(block_m)
    busy = max(min(E, max_slots), -(-max_slots // block_m))  # route blocks of a full call
    packed = not direct and block_m <= 32
    gu_splits, gu_ktiles = chunk_splits(H, busy * (I // 128) * 2 * warps,
                                        PACKED_GATE_UP_TARGET_WARPS if packed else TARGET_WARPS)
    if packed and gu_ktiles < PACKED_MIN_SPLIT_CHUNKS * CHUNK_KTILES:
        per_split = min(PACKED_MIN_SPLIT_CHUNKS, H // CHUNK_K)
        gu_splits, gu_ktiles = -(-(H // CHUNK_K) // per_split), per_split * CHUNK_KTILES
    d_splits, d_ktiles = chunk_splits(I, busy * (H // 128) * warps,
                                      PACKED_DOWN_TARGET_WARPS if packed else TARGET_WARPS)
    return MoeMmaPlan(block_m, warps, tuple(sorted(set(fmt[0] + fmt[1]))), tuple(sorted(set(fmt[2]))),
                      tuple(stage_formats), gu_splits, gu_ktiles, d_splits, d_ktiles,
                      pre_rotates(block_m, max_slots, direct, format_count(experts)),
                      direct, small_call=max_slots <= SMALL_CALL_SLOTS)


WS_CONSUMER_THREADS = 256  # trellis_ws.cuh's CONSUMERS warps
MOE_WS_RING_KTILES = 40  # the MoE ring (160 KB): its blocks keep no running sum, so more than the linear's fit
WS_GATE_UP_RING_KTILES = 24  # the persistent gate/up's ring, beside its 64 KB of gate values
WIDE_BLOCK_M, WIDE_RING_KTILES = 192, 32  # three consumer warpgroups; their ring beside 96 KB of x chunks
WIDE_MIN_ROWS, WIDE_MAX_ROWS = 128, 176  # average rows per expert where 192-row blocks run (wide_route_blocks)
SPLIT_MIN_ROWS = 128  # average rows per expert from which a chunk's experts split their rows (split_route_blocks)


def ws_ring(persistent_gate_up: bool | None = None) -> tuple:
    """(k-tiles per stage, stages) of the MoE ring: MOE_WS_RING_KTILES k-tiles, WS_GATE_UP_RING_KTILES beside the
    persistent gate/up's gate values (by default: where EXL3MOE_MOE_WS_GATE_UP asks for it), in stages of one x
    chunk (8 k-tiles) whose producers wait for their stage and then decode and store a k-tile at a time.
    EXL3MOE_MOE_WS_STAGE_KT (4 or 8) and EXL3MOE_MOE_WS_STAGES (3 or more stages, of 4 k-tiles unless
    EXL3MOE_MOE_WS_STAGE_KT says 8, that fit the ring) set them; anything else is a ContractError."""
    if persistent_gate_up is None:
        persistent_gate_up = os.environ.get("EXL3MOE_MOE_WS_GATE_UP") == "1"
    ring = WS_GATE_UP_RING_KTILES if persistent_gate_up else MOE_WS_RING_KTILES
    kt_env, stages_env = os.environ.get("EXL3MOE_MOE_WS_STAGE_KT"), os.environ.get("EXL3MOE_MOE_WS_STAGES")
    if kt_env not in (None, str(WS_STAGE_KTILES), str(CHUNK_KTILES)):
        raise ContractError("EXL3MOE_MOE_WS_STAGE_KT", f"must be {WS_STAGE_KTILES} or {CHUNK_KTILES}, got {kt_env!r}")
    stage_kt = int(kt_env) if kt_env else WS_STAGE_KTILES if stages_env else CHUNK_KTILES
    most = ring // stage_kt
    if stages_env is None:
        return stage_kt, most
    if not stages_env.isdigit() or not WS_STAGES <= int(stages_env) <= most:
        raise ContractError("EXL3MOE_MOE_WS_STAGES", f"must be an integer in {WS_STAGES}..{most} for stages of "
                            f"{stage_kt} k-tiles, got {stages_env!r}")
    return stage_kt, int(stages_env)


def ring_turn_step(stages_per_range: int, turns: int) -> int:
    """Largest step between one producer turn's consecutive ring stages over back-to-back ranges of stages_per_range
    stages taken in `turns` turns. A producer waits for its slot's previous use by barrier parity, which cannot tell
    that use from the one before it: a step longer than the ring's stage count could overwrite a slot still read."""
    n, k = stages_per_range, turns
    return max(t + k if (n - t) % k == 0 else t + (n - t) % k for t in range(min(k, n)))


def check_ring_turns(experts, max_slots: int) -> None:
    """ContractError where the ring settings (EXL3MOE_MOE_WS_STAGES, _STAGE_KT) are too shallow for the producer turns
    of a 128-row warp-specialized plan's ranges (ring_turn_step); the defaults never are. Only ints and formats are
    read, so moe_plan checks it before anything reaches the device."""
    ws_ring()   # the settings' own ranges
    layout = moe_mma_layout(experts, max_slots, 128)
    persistent = layout.gate_up_splits == 1 and os.environ.get("EXL3MOE_MOE_WS_GATE_UP") == "1"
    stage_kt, stages = ws_ring(persistent)
    turns = 2 if persistent or os.environ.get("EXL3MOE_MOE_WS_PAIRED", "1") == "0" else 3
    H, I = experts.hidden_size, experts.intermediate_size
    for ktiles, total in ((layout.gate_up_ktiles, H // 16), (layout.down_ktiles, I // 16)):
        for range_ktiles in {ktiles, total - (total - 1) // ktiles * ktiles}:   # a split, and the last one
            step = ring_turn_step(range_ktiles // stage_kt, turns)
            if step > stages:
                raise ContractError("EXL3MOE_MOE_WS_STAGES", f"{stages} stages of {stage_kt} k-tiles: ranges of "
                                    f"{range_ktiles} k-tiles in {turns} producer turns need at least {step}")


def ws_shared_bytes(plan: MoeMmaPlan, name: str) -> int:
    """Dynamic shared memory of a warp-specialized kernel: trellis_ws.cuh's, plus each consumer thread's 64 gate
    values for moe_gate_up_ws."""
    gate_values = WS_CONSUMER_THREADS * 64 * 4 if name == "moe_gate_up_ws" else 0
    x_barriers = 2 * 8 if plan.x_tma else 0
    return ws_ring_shared_bytes(plan.ws_stages, plan.ws_stage_ktiles, plan.block_m) + gate_values + x_barriers


def uses_ws(block_m: int, device: torch.device) -> bool:
    """128- and 192-row route blocks on the warp-specialized mainloop: sm_90 exactly (wgmma); EXL3MOE_MOE_WS=0 keeps
    mma.sync (128 rows). Both give the same bytes."""
    return (block_m in (128, WIDE_BLOCK_M) and os.environ.get("EXL3MOE_MOE_WS", "1") != "0"
            and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


def wide_route_blocks(experts, slots: int, max_slots: int) -> bool:
    """192-row route blocks where a chunk of `slots` gives the experts WIDE_MIN_ROWS to WIDE_MAX_ROWS rows on average
    (`max_slots`: the plan's largest call) and split_route_blocks does not run (EXL3MOE_MOE_SPLIT_ROUTE=0): most
    experts then hold 129-192 rows, which one block decodes once instead of two. A 192-row block costs ~1.2x a
    128-row one of the same rows (its 8 producers wait on their words), so fewer rows per expert, or more (two blocks
    either way), keep 128. Only where wide_blocks_run; EXL3MOE_MOE_WS_192=0 keeps 128."""
    return (WIDE_MIN_ROWS * experts.num_experts <= slots <= WIDE_MAX_ROWS * experts.num_experts
            and os.environ.get("EXL3MOE_MOE_WS_192", "1") != "0" and wide_blocks_run(experts, max_slots))


def split_route_blocks(experts, slots: int, max_slots: int) -> bool:
    """Chunks of `slots` whose experts average SPLIT_MIN_ROWS rows or more split each expert's rows between 192- and
    128-row blocks (route_split) and run a kernel of each size over its own table: an expert of 129-192 rows is
    decoded once, one of up to 128 (or 193-256) rows pays for no 192-row block, one of 257-320 takes one of each.
    Only where wide_blocks_run and 128-row blocks are warp-specialized; EXL3MOE_MOE_SPLIT_ROUTE=0 keeps one size
    (wide_route_blocks)."""
    return (slots >= split_min_slots(experts.num_experts) and os.environ.get("EXL3MOE_MOE_SPLIT_ROUTE", "1") != "0"
            and wide_blocks_run(experts, max_slots))


def split_min_slots(num_experts: int) -> int:
    """Fewest slots of a chunk whose experts split their rows (SPLIT_MIN_ROWS rows per expert on average)."""
    return SPLIT_MIN_ROWS * num_experts


def wide_blocks_run(experts, max_slots: int) -> bool:
    """Whether 192-row route blocks can run a plan of max_slots: sm_90, both kernels warp-specialized (down in one k
    split, its svh in pairs), the persistent gate/up not asked for."""
    return (uses_ws(WIDE_BLOCK_M, experts.device)
            and os.environ.get("EXL3MOE_MOE_WS_DOWN") != "0" and os.environ.get("EXL3MOE_MOE_WS_GATE_UP") != "1"
            and moe_mma_layout(experts, max_slots, WIDE_BLOCK_M).down_splits == 1 and down_svh_in_pairs(experts))


def down_svh_in_pairs(experts) -> bool:
    """Whether every down svh starts 4-byte aligned: moe_down_ws reads it two fp16 at a time (else the plan keeps
    moe_down_mma)."""
    return all(w.svh.data_ptr() % 4 == 0 for w in experts.down)


def plan_moe_mma(experts, max_slots: int, block_m: int, stage_formats: tuple = (), direct: bool = False,
                 after_down: bool = False, split_peer: int = 0) -> MoeMmaPlan:
    """moe_mma_layout, with both kernels compiled for the layer's formats; `after_down`: gate/up follows another
    expert set's moe_down_mma in the stream (early_gate_up); `split_peer`: the plan's kernels run one table of split
    route blocks (1 the 128-row table, launched first; 2 the 192-row one, launched early after it: split_chain)."""
    plan = moe_mma_layout(experts, max_slots, block_m, stage_formats, direct)
    wave_blocks = DIRECT_GATE_UP_MIN_BLOCKS * nvrtc.sm_count(experts.device)   # one wave at that many per SM
    blocks = max_slots * (2 * experts.intermediate_size // 128) * plan.gate_up_splits
    down_blocks = max_slots * (experts.hidden_size // 128) * plan.down_splits
    plan = replace(plan, route_major=os.environ.get("EXL3MOE_MOE_ROUTE_MAJOR", "1") != "0",
                   one_wave=direct and blocks <= wave_blocks, down_one_wave=direct and down_blocks <= wave_blocks)
    if uses_ws(block_m, experts.device) and plan.pre_rotate:   # pre_rotates excludes direct plans
        wide = block_m == WIDE_BLOCK_M
        persistent = plan.gate_up_splits == 1 and os.environ.get("EXL3MOE_MOE_WS_GATE_UP") == "1" and not wide
        stage_kt, stages = (CHUNK_KTILES, WIDE_RING_KTILES // CHUNK_KTILES) if wide else ws_ring(persistent)
        plan = replace(plan, ws=True, ws_gate_up=persistent,
                       ws_down=(plan.down_splits == 1 and os.environ.get("EXL3MOE_MOE_WS_DOWN") != "0"
                                and down_svh_in_pairs(experts)),
                       ws_stages=stages, ws_stage_ktiles=stage_kt,
                       x_tma=not persistent and os.environ.get("EXL3MOE_MOE_X_TMA", "1") != "0",
                       ws_paired=wide or (not persistent and os.environ.get("EXL3MOE_MOE_WS_PAIRED", "1") != "0"))
    early = early_launch(experts.device)
    plan = replace(plan, split_inner=split_inner_grid(plan), stage_blocks=stage_blocks(plan),
                   split_peer=split_peer if plan.ws and split_chain(experts.device) else 0,
                   early_down=not plan.ws_down and early,
                   early_gate_up=(early and after_down and not plan.pre_rotate and not plan.ws_gate_up
                                  and os.environ.get("EXL3MOE_MOE_EARLY_GATE_UP", "1") != "0"))
    gate_up = "moe_gate_up_ws" if plan.ws_gate_up else "moe_gate_up_mma"
    return replace(plan, gate_up_kernel=_kernel(plan, gate_up, experts.device),
                   down_kernel=_kernel(plan, "moe_down_ws" if plan.ws_down else "moe_down_mma", experts.device),
                   rotate_kernel=_kernel(plan, "moe_rotate_input", experts.device) if plan.pre_rotate else None)


def early_launch(device: torch.device) -> bool:
    """Down launches as a programmatic dependent of gate/up (sm_90+): its blocks start once every gate/up block has,
    ask for their first weight words, and wait for gate/up's completion before reading h_rot. A gate/up right after
    another expert set's down (the shared expert's, or the routed one's) launches early too: it reads nothing that
    down writes, and its block 0 waits for down before it leaves, so that the chain completes in order.
    EXL3MOE_MOE_EARLY_DOWN=0 launches every kernel after the previous one; EXL3MOE_MOE_EARLY_GATE_UP=0 keeps the
    early down only."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and os.environ.get("EXL3MOE_MOE_EARLY_DOWN", "1") != "0")


def split_chain(device: torch.device) -> bool:
    """Split route blocks chain their two kernels of each projection (sm_90): the 128-row kernel lets its dependents
    launch, and the 192-row kernel launches early after it (it reads nothing the other writes), so its blocks fill
    the other's last wave instead of running alone after it; its block 0 waits for the other's completion when it
    leaves, so the stream's next kernel still waits for both. EXL3MOE_MOE_SPLIT_CHAIN=0 launches them one after the
    other."""
    return early_launch(device) and os.environ.get("EXL3MOE_MOE_SPLIT_CHAIN", "1") != "0"


def stage_words_ahead(plan: MoeMmaPlan) -> bool:
    """Direct stage plans ask L2 for the first stage's words of a block before its base mainloop (STAGE_WORDS_AHEAD),
    where its scale is nonzero. Packed plans keep them for the stage's mainloop: there ptxas gives the kernels more
    registers or stack with it, which cost more than the wait; EXL3MOE_MOE_STAGE_WORDS_AHEAD=0 keeps them
    everywhere."""
    return (bool(plan.stage_formats) and plan.direct
            and os.environ.get("EXL3MOE_MOE_STAGE_WORDS_AHEAD", "1") != "0")


def stage_blocks(plan: MoeMmaPlan) -> bool:
    """Packed 16-row stage plans of more than SMALL_CALL_SLOTS slots run the stages' passes in blocks of their own,
    after all the base's (z doubles), so that an expert with an active stage does not make the tail: the base's bytes
    where no stage is active, base then stage partials summed in order where one is. Elsewhere the blocks that exit
    for want of an active stage cost more than the balance gains (every block of a small call is in flight at once;
    32-row grids). EXL3MOE_MOE_STAGE_BLOCKS=0 runs every block's base and stages in one accumulator."""
    return (bool(plan.stage_formats) and plan.block_m == 16 and not plan.direct and not plan.small_call
            and not plan.ws and os.environ.get("EXL3MOE_MOE_STAGE_BLOCKS", "1") != "0")


def scale_ahead(plan: MoeMmaPlan) -> bool:
    """Direct stage plans read the first stage's scale at each block's start (SCALE_AHEAD), not after the base's
    mainloop. In packed plans the extra register cost them more than the wait; EXL3MOE_MOE_SCALE_AHEAD=0 keeps the
    late read everywhere."""
    return bool(plan.stage_formats) and plan.direct and os.environ.get("EXL3MOE_MOE_SCALE_AHEAD", "1") != "0"


def partial_splits(plan: MoeMmaPlan, splits: int) -> int:
    """Partials per row of gate/up or down: the base's k splits, and as many again for the stages with stage_blocks."""
    return 2 * splits if plan.stage_blocks else splits


def split_inner_grid(plan: MoeMmaPlan) -> bool:
    """Packed mma.sync plans of more than SMALL_CALL_SLOTS slots launch a route block's splits together (SPLIT_INNER):
    the blocks in flight then span fewer route blocks, so fewer experts' formats share the instruction cache. Direct
    and small calls keep the splits outermost (there the inner order measured slower); EXL3MOE_MOE_SPLIT_INNER=0
    keeps it everywhere."""
    return (plan.route_major and not plan.direct and not plan.ws and not plan.small_call
            and os.environ.get("EXL3MOE_MOE_SPLIT_INNER", "1") != "0")


def mainloop_unroll(formats: int, mt: int, small_call: bool) -> tuple:
    """(k-tiles of words prefetched, k-tiles per unrolled mainloop body). A kernel of few rows holding many formats
    keeps its mainloops small so that they share the instruction cache: half a chunk per body, and in small calls
    (every block in flight at once, so the route-major order cannot keep the formats apart) a quarter of one
    behind a 2-deep prefetch. A whole chunk behind a 4-deep prefetch otherwise."""
    if formats >= MIXED_MIN_FORMATS and mt <= MIXED_MAX_MT:
        return (SMALL_CALL_UNROLL, SMALL_CALL_UNROLL) if small_call else (PREFETCH, MIXED_KTILE_UNROLL)
    return PREFETCH, CHUNK_KTILES


def moe_pair_scalar(formats: int, mt: int, direct: bool) -> int:
    """PAIR_SCALAR (trellis_core.cuh) of an mma.sync MoE kernel: the linear's choice for one-row direct blocks and
    blocks of many rows; packed route blocks of few rows pack their sums with a PRMT (1), or on the FMA pipe (2)
    when they hold many formats, which leaves ptxas room for the mainloops without a spill."""
    if direct or mt > PAIR_SCALAR_MAX_MT:
        return pair_scalar(mt)
    return 2 if formats >= MIXED_MIN_FORMATS else 1


def _dispatch(name: str, formats: tuple, mt: int, nt: int) -> str:
    cases = " ".join(f"case {4 * k2 + cb}: mma_mainloop<{k2}, {cb}, {mt}, {nt}, PF>(ACC, WORDS, tiles_n, jt0, kt0, "
                     "kt1, mtiles, xs, stage); break;" for k2, cb in formats)
    return f"#define {name}(ACC, WORDS, KEY) switch (KEY) {{ {cases} }}\n"


def _produce(name: str, formats: tuple) -> str:
    cases = " ".join(f"case {4 * k2 + cb}: produce<{k2}, {cb}>(sh.ring, sh.full, sh.empty, WORDS, tiles_n, jt, kt0, "
                     "kt1, warp, CURSOR); break;" for k2, cb in formats)
    return f"#define {name}(WORDS, KEY, CURSOR) switch (KEY) {{ {cases} }}\n"


def kernel_source(plan: MoeMmaPlan, name: str) -> tuple:
    """(defines, prelude) that compile kernel `name` of moe_mma.cu for `plan`."""
    gate_up = name in ("moe_gate_up_mma", "moe_gate_up_ws")
    if plan.ws and (gate_up or name == "moe_down_ws"):
        formats = plan.gate_up_formats if gate_up else plan.down_formats
        prelude = _produce("WS_PRODUCE_GATE_UP" if gate_up else "WS_PRODUCE_DOWN",
                           tuple(sorted(set(formats) | set(plan.stage_formats))))
        defines = (("PF", PREFETCH), ("MT", 8), ("NT", 1), ("WARPS", ws_threads(plan.ws_paired, plan.block_m) // 32),
                   ("PRE_ROTATED", 1), ("DIRECT_ROUTE", 0), ("PAIR_SCALAR", 2), ("KTILE_UNROLL", CHUNK_KTILES),
                   ("WS", 1), ("STAGES", plan.ws_stages), ("STAGE_KT", plan.ws_stage_ktiles),
                   ("ROUTE_MAJOR", int(plan.route_major)))
        defines += (("X_TMA", 1),) if plan.x_tma else ()
        defines += (("EARLY_LAUNCH", 1),) if plan.split_peer else ()
        defines += (("CHAIN_ON_EXIT", 1),) if plan.split_peer == 2 else ()
        if plan.block_m == WIDE_BLOCK_M:
            defines += (("WS_PRODUCERS", 8), ("WS_BLOCK_ROWS", WIDE_BLOCK_M), ("ROUTE_ROWS", WIDE_BLOCK_M))
        else:
            defines += (("WS_PRODUCERS", 12),) if plan.ws_paired else ()
        return defines, prelude
    mt, nt = min(plan.block_m, 128) // 16, 8 // plan.warps   # 192-row plans: moe_rotate_input alone (ROUTE_ROWS)
    empty = ()
    formats = plan.gate_up_formats if gate_up else plan.down_formats
    union = union_stages(plan)
    if union:
        formats, stage_formats = tuple(sorted(set(formats) | set(plan.stage_formats))), empty
    else:
        stage_formats = plan.stage_formats
    prelude = "".join([
        _dispatch("DISPATCH_GATE_UP", formats if gate_up else empty, mt, nt),
        _dispatch("STAGE_DISPATCH_GATE_UP", stage_formats if gate_up else empty, mt, nt),
        _dispatch("DISPATCH_DOWN", empty if gate_up else formats, mt, nt),
        _dispatch("STAGE_DISPATCH_DOWN", empty if gate_up else stage_formats, mt, nt)])
    prefetch, unroll = mainloop_unroll(len(formats), mt, plan.small_call)
    defines = (("PF", prefetch), ("MT", mt), ("NT", nt), ("WARPS", plan.warps), ("PRE_ROTATED", int(plan.pre_rotate)),
               ("DIRECT_ROUTE", int(plan.direct)),
               ("PAIR_SCALAR", moe_pair_scalar(len(formats), mt, plan.direct)),
               ("KTILE_UNROLL", unroll), ("ROUTE_MAJOR", int(plan.route_major)))
    defines += (("UNION_STAGES", 1),) if union else ()
    defines += (("ROUTE_ROWS", plan.block_m),) if plan.block_m > 128 else ()
    if plan.one_wave and gate_up and (len(formats) + len(stage_formats) > 1 or one_wave_bound(plan, formats)):
        defines += (("MIN_BLOCKS", DIRECT_GATE_UP_MIN_BLOCKS),)   # two or more mainloops, or a bound format
    defines += (("MIN_BLOCKS", stage_min_blocks(plan)),) if stage_min_blocks(plan) else ()
    defines += direct_down_defines(plan) if name == "moe_down_mma" else ()
    defines += (("SUH_PREFETCH", 1),) if suh_prefetch(plan) and gate_up else ()
    defines += (("SPLIT_INNER", 1),) if plan.split_inner else ()
    defines += (("STAGE_BLOCKS", 1),) if plan.stage_blocks else ()
    defines += (("SCALE_AHEAD", 1),) if scale_ahead(plan) else ()
    defines += (("STAGE_WORDS_AHEAD", 1),) if stage_words_ahead(plan) else ()
    early = plan.early_down or plan.early_gate_up
    defines += (("EARLY_LAUNCH", 1),) if early and name in ("moe_gate_up_mma", "moe_down_mma") else ()
    defines += (("EARLY_GATE_UP", 1),) if plan.early_gate_up and name == "moe_gate_up_mma" else ()
    # Packed kernels of many formats read their epilogue vectors once per block (ptxas then gives them fewer
    # registers); kernels of few formats keep the per-row reads (the hoisted vectors cost them a spill).
    defines += (("PACKED_EPILOGUE_AHEAD", 1),) if not plan.direct and len(formats) >= MIXED_MIN_FORMATS else ()
    return defines, prelude


def direct_down_defines(plan: MoeMmaPlan) -> tuple:
    """A direct plan's down reads its combine's ids and weights for the first DIRECT_COMBINE_AHEAD slots before
    the combine's arrival. ptxas would give the read-ahead 72-94 registers, so the kernel is bounded: a single
    mainloop (one format, no stages) to DIRECT_DOWN_MIN_BLOCKS per SM (GLM's 1024-block calls then fit one wave;
    _kernel drops the bound where ptxas spills under it), more mainloops, and the ONE_WAVE_BOUND_FORMATS of calls
    whose blocks fit one wave at that many, to DIRECT_DOWN_MIN_BLOCKS_MIXED (24-32 bytes of stack, faster than the
    plain combine)."""
    if not plan.direct:
        return ()
    single = len(plan.down_formats) == 1 and not plan.stage_formats
    bound = plan.down_one_wave and one_wave_bound(plan, plan.down_formats)
    return ("COMBINE_AHEAD", DIRECT_COMBINE_AHEAD), \
        ("MIN_BLOCKS", DIRECT_DOWN_MIN_BLOCKS if single and not bound else DIRECT_DOWN_MIN_BLOCKS_MIXED)


def one_wave_bound(plan: MoeMmaPlan, formats: tuple) -> bool:
    """Whether a direct kernel of one format without stages takes ONE_WAVE_BOUND_FORMATS' bound (where its blocks
    fit one wave at that many per SM, as the caller checks)."""
    return len(formats) == 1 and not plan.stage_formats and formats[0] in ONE_WAVE_BOUND_FORMATS


def suh_prefetch(plan: MoeMmaPlan) -> bool:
    """Packed 16-row gate/up blocks without stages ask L2 for their k range's suh before the mainloop
    (SUH_PREFETCH). Elsewhere it did not pay: ptxas gives some direct and stage kernels more registers with it
    (one-row K5 80 -> 86, the 16-row union stage kernel 80 -> 90), and 32-row blocks measured 1.01x slower."""
    return plan.block_m == 16 and not plan.direct and not plan.stage_formats


def stage_min_blocks(plan: MoeMmaPlan) -> int:
    """MIN_BLOCKS of a stage plan's 32-row kernels of fewer than MIXED_MIN_FORMATS formats: ptxas gives a K4 base
    with K1 / K2 stages 128 registers (3 blocks per SM) against the base's 96; bounded to STAGE_32_ROW_MIN_BLOCKS
    (96 registers, 24-32 bytes of stack). 0 elsewhere."""
    return STAGE_32_ROW_MIN_BLOCKS if plan.stage_formats and plan.block_m == 32 and _few_stage_formats(plan) else 0


def union_stages(plan: MoeMmaPlan) -> bool:
    """Packed 16-row kernels of a plan with stage formats run the base and the stages through one switch over the
    union of their formats (UNION_STAGES) when it has fewer than MIXED_MIN_FORMATS: ptxas then gives a K4 base with
    K1 / K2 stages 72 registers instead of 114 (7 blocks per SM, as the base). One-row direct and 32+-row blocks,
    and unions of more formats, keep a switch each (there the loop was slower or cost registers);
    EXL3MOE_MOE_UNION_STAGES=0 keeps a switch each everywhere."""
    return bool(plan.stage_formats) and plan.block_m == 16 and not plan.direct and _few_stage_formats(plan)


def _few_stage_formats(plan: MoeMmaPlan) -> bool:
    """Fewer than MIXED_MIN_FORMATS formats over base and stages, and EXL3MOE_MOE_UNION_STAGES not "0"."""
    union = set(plan.gate_up_formats) | set(plan.down_formats) | set(plan.stage_formats)
    return len(union) < MIXED_MIN_FORMATS and os.environ.get("EXL3MOE_MOE_UNION_STAGES", "1") != "0"


def _kernel(plan: MoeMmaPlan, name: str, device: torch.device):
    defines, prelude = kernel_source(plan, name)
    arch_suffix = "a" if plan.ws and name in ("moe_gate_up_mma", "moe_gate_up_ws", "moe_down_ws") else ""
    func = nvrtc.kernel("moe_mma.cu", name, defines, device.index or 0, prelude, arch_suffix)
    bound = ("MIN_BLOCKS", DIRECT_DOWN_MIN_BLOCKS)
    if name == "moe_down_mma" and bound in direct_down_defines(plan) and nvrtc.local_bytes(func):
        unbounded = tuple(d for d in defines if d != bound)   # the bound spilled: ptxas's own registers
        func = nvrtc.kernel("moe_mma.cu", name, unbounded, device.index or 0, prelude, arch_suffix)
    return func


def workspace_numels(plan: MoeMmaPlan, capacity: int, max_blocks: int, hidden: int, inter: int) -> dict:
    """Elements of the fp32 partials of gate/up and down, the int32 arrival counters (zeroed once; kernels reset
    them) and the pre-rotated fp16 inputs."""
    gate_up_partial = partial_splits(plan, plan.gate_up_splits) * 2 * capacity * inter
    return {"gate_up_partial": 0 if plan.ws_gate_up else gate_up_partial,
            "down_partial": 0 if plan.ws_down else partial_splits(plan, plan.down_splits) * capacity * hidden,
            "gate_up_counters": 0 if plan.ws_gate_up else max_blocks * (inter // 128),
            "down_counters": 0 if plan.ws_down else max_blocks * (hidden // 128),
            "x_rot": 2 * capacity * hidden if plan.pre_rotate else 0}


def _stage_args(tables) -> list:
    return [tables.num_stages, tables.stage_addr, tables.stage_k2, tables.stage_codebook, tables.stage_scale]


def moe_rotate_input(hidden, x_rot, route, top_k, tables, plan: MoeMmaPlan, grid_blocks, capacity):
    """x_rot[p, pos] = fp16(Hn(x[token] * suh)) of gate (p 0) and up (p 1) for every routed position."""
    block_expert, block_start, offsets, sorted_slots = route
    H = tables.hidden_size
    vector = tables.gate_up_suh_aligned and hidden.data_ptr() % 16 == 0 and hidden.stride(0) % 8 == 0
    nvrtc.launch(plan.rotate_kernel, (grid_blocks, 2, plan.block_m // ROTATE_ROWS), plan.warps * 32,
                 [hidden, int(hidden.dtype == torch.bfloat16) | int(vector) << 1, hidden.stride(0), block_expert,
                  block_start, offsets, sorted_slots, top_k, tables.suh_addr, tables.num_experts, H, capacity, x_rot])


def _grid(plan: MoeMmaPlan, route_blocks: int, column_blocks: int, splits: int) -> tuple:
    """Route-major: a route block's column blocks are consecutive blocks, so the GPU runs few formats at a time
    (and with split_inner its splits too). With stage_blocks z doubles: the stages' blocks follow all the base's."""
    passes = 2 if plan.stage_blocks else 1
    if plan.split_inner:
        return column_blocks, splits, passes * route_blocks
    return (column_blocks, route_blocks, passes * splits) if plan.route_major else \
        (route_blocks, column_blocks, passes * splits)


def moe_gate_up_mma(hidden, h_rot, route, top_k, tables, plan: MoeMmaPlan, partial, counters, grid_blocks, capacity,
                    x_rot=None, ids_64=0):
    """h_rot[pos] = down's rotated input of act(gate(x), up(x)) for every routed position (CUDA path); x_rot
    holds moe_rotate_input's rows when the plan pre-rotates; a direct plan's route starts with topk_ids."""
    block_expert, block_start, offsets, sorted_slots = route
    E, H, I = tables.num_experts, tables.hidden_size, tables.intermediate_size
    limit = float(tables.limit) if tables.limit is not None else 0.0
    if plan.ws_gate_up:
        nvrtc.launch(plan.gate_up_kernel, (min(grid_blocks * (I // 128), nvrtc.sm_count(hidden.device)), 1, 1),
                     ws_threads(plan.ws_paired, plan.block_m),
                     [block_expert, block_start, offsets, tables.trellis_addr, tables.suh_addr, tables.svh_addr,
                      tables.k2, tables.codebook, *_stage_args(tables), tables.bias_gate_up, E, H, I, capacity, h_rot,
                      ACTIVATIONS[tables.activation], int(tables.limit is not None), limit, x_rot, grid_blocks],
                     shared=ws_shared_bytes(plan, "moe_gate_up_ws"))
        return
    threads = ws_threads(plan.ws_paired, plan.block_m) if plan.ws else plan.warps * 32
    nvrtc.launch(plan.gate_up_kernel, _grid(plan, grid_blocks, 2 * I // 128, plan.gate_up_splits), threads,
                 [hidden, int(hidden.dtype == torch.bfloat16), hidden.stride(0), block_expert, block_start, offsets,
                  sorted_slots, top_k, tables.trellis_addr, tables.suh_addr, tables.svh_addr, tables.k2,
                  tables.codebook, *_stage_args(tables), tables.bias_gate_up, E, H, I, partial, capacity, h_rot,
                  counters, plan.gate_up_ktiles, plan.gate_up_splits, ACTIVATIONS[tables.activation],
                  int(tables.limit is not None), limit, x_rot, ids_64,
                  *([nvrtc.x_tensor_map(x_rot, 2 * capacity, H, box_rows=plan.block_m)] if plan.x_tma else [])],
                 shared=ws_shared_bytes(plan, "moe_gate_up_mma") if plan.ws else 0,
                 early=plan.early_gate_up or plan.split_peer == 2)


DTYPE_ID = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def moe_down_mma(h_rot, y, route, tables, plan: MoeMmaPlan, partial, counters, grid_blocks, capacity, combine=None):
    """y[slot] = down(h) (fp32, unweighted) for every routed position (CUDA path). A direct plan also combines:
    combine = (topk_ids, topk_weights, shared_y or None, out, token_counters)."""
    ids, weights, shared_y, out, token_counters = combine or (None, None, None, None, None)
    combine_args = [ids, int(ids is not None and ids.dtype == torch.int64), weights,
                    DTYPE_ID[weights.dtype] if weights is not None else 0, shared_y, out,
                    DTYPE_ID[out.dtype] if out is not None else 0, out.stride(0) if out is not None else 0,
                    token_counters, ids.shape[1] if ids is not None else 1]
    block_expert, block_start, offsets, sorted_slots = route
    E, H, I = tables.num_experts, tables.hidden_size, tables.intermediate_size
    if plan.ws_down:
        nvrtc.launch(plan.down_kernel, (min(grid_blocks * (H // 128), nvrtc.sm_count(h_rot.device)), 1, 1),
                     ws_threads(plan.ws_paired, plan.block_m),
                     [h_rot, y, block_expert, block_start, offsets, sorted_slots, tables.trellis_addr,
                      tables.svh_addr, tables.k2, tables.codebook, *_stage_args(tables), tables.bias_down, E, H, I,
                      grid_blocks,
                      *([nvrtc.x_tensor_map(h_rot, capacity, I, box_rows=plan.block_m)] if plan.x_tma else [])],
                     shared=ws_shared_bytes(plan, "moe_down_ws"), early=plan.split_peer == 2)
        return
    nvrtc.launch(plan.down_kernel, _grid(plan, grid_blocks, H // 128, plan.down_splits), plan.warps * 32,
                 [h_rot, y, block_expert, block_start, offsets, sorted_slots, tables.trellis_addr, tables.svh_addr,
                  tables.k2, tables.codebook, *_stage_args(tables), tables.bias_down, E, H, I, partial, capacity,
                  counters, plan.down_ktiles, plan.down_splits, *combine_args], early=plan.early_down)
