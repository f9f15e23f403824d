"""The planning of a fused MoE call, in one place: plan_moe_call takes the validated layer and the call limits and
returns a MoECallPlan holding every decision (backend, route-block rows, splits, direct route, wide and split route
blocks, ring depth, pre-rotation, format order, chunking), with the CUDA experts' kernels it picks compiled.

Decisions depend on the plan's shape (max slots, E, H, I, formats), the device and the EXL3MOE_MOE_* settings, never
on the data, so outputs stay batch invariant for a plan. check_call_limits refuses, before anything reaches the
device, the limits no plan can meet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton

from ..errors import ContractError
from ..format.experts import ExpertSet
from ..kernels import nvrtc
from ..kernels.moe_mma import ACTIVATIONS, MAX_GRID_ROWS
from ..kernels.moe_mma_config import (MOE_WS_RING_KTILES, WIDE_BLOCK_M, WIDE_RING_KTILES, WS_GATE_UP_RING_KTILES,
                                      MoeMmaPlan, warps_for)
from ..kernels.moe_mma_source import CHUNK_KTILES, DIRECT_GATE_UP_MIN_BLOCKS, MIXED_MIN_FORMATS, compile_kernels
from ..kernels.route_pack import route_pack_max_blocks
from ..kernels.trellis_decode import CODEBOOK_ID, interpreting
from ..kernels.trellis_mma import CHUNK_K
from ..kernels.trellis_ws import WS_STAGE_KTILES, WS_STAGES
from .linear_planning import chunk_splits
from .stage_limits import DEFAULT_STAGE_CODEBOOKS, stage_k2_limit

# Slots per chunk by default: 4096 top-8 tokens, ~256 rows per expert at E = 128 (each expert's tiles decoded
# for more rows at a time); the workspace is then ~750 MB for Qwen3-30B-A3B, ~1.5 GB for GLM-4.5-Air.
DEFAULT_SLOT_CAPACITY = 32768
# Route-block rows: 16 is the smallest MMA tile; above 32 the sm_90 build of the Triton gate/up spills (cuobjdump).
# The CUDA kernels take up to 128 and skip m16 tiles past a block's rows, so they get headroom over the average.
MIN_BLOCK_M, MAX_BLOCK_M, CUDA_MAX_BLOCK_M = 16, 32, 128
# Decode sub-block (k rows) on the GPU: [32, 128] keeps the word gather's registers near the linear kernel's.
GPU_DECODE_K = 32
# Decode sub-block under the interpreter: one 128-row block per k-chunk means fewest interpreted steps.
INTERPRET_DECODE_K = 128
# gate/up programs wanted in flight: below this the hidden size is split (partials summed in a fixed order).
SPLIT_TARGET_PROGRAMS = 768
STAGE_MAX_K2 = 8
PRE_ROTATE_BLOCK_M = 64
DIRECT_MAX_SLOTS, DIRECT_MAX_SLOTS_MIXED = 16, 8
SMALL_CALL_SLOTS = 32  # calls of so few slots run every block at once: smallest mainloops (MoeMmaPlan.small_call)
# Warps wanted in flight at the plan's largest call: below this the k range of gate/up and down is split.
TARGET_WARPS = 4096
# Packed 16- and 32-row route blocks want more (finer waves), with gate/up splits of at least 3 chunks.
PACKED_GATE_UP_TARGET_WARPS, PACKED_DOWN_TARGET_WARPS, PACKED_MIN_SPLIT_CHUNKS = 12288, 8192, 3
WIDE_MIN_ROWS, WIDE_MAX_ROWS = 128, 176  # average rows per expert where 192-row blocks run (wide_route_blocks)
SPLIT_MIN_ROWS = 128  # average rows per expert from which a chunk's experts split their rows (split_route_blocks)


@dataclass(frozen=True)
class MoECallPlan:
    """Every decision of a MoEPlan's calls; MoEPlan exposes each field under the same name."""

    backend: str  # "cuda" (CUDA C++ experts), "triton", or "torch" (CPU tensors outside the Triton interpreter)
    chunk_tokens: int  # tokens per chunk: calls of more are processed chunk by chunk
    slot_capacity: int  # slots per chunk (chunk_tokens x top_k)
    block_m: int  # route-block rows of the routed experts
    shared_block_m: int  # rows per block of the shared expert
    decode_k: int  # the Triton experts' decode sub-block (k rows)
    gate_up_splits: int  # the Triton gate/up's hidden splits (gate_up_splits)
    stage_max_k2: int  # widest residual 2K the plan accepts (0 without stages)
    stage_formats: tuple  # ((2K, codebook id), ...) of residual stages compiled in
    base_order: tuple | None  # route-block order of the experts by format (format_order); None: 0..E-1
    staged_order: bool  # route-packed mma.sync plans of stages put experts with an active stage first (staged_first)
    split_min_slots: int  # chunks of at least this many slots run the split route blocks (when wide_mma is set)
    mma: MoeMmaPlan | None = None  # the routed CUDA experts (None: Triton or torch)
    wide_mma: MoeMmaPlan | None = None  # the 192-row kernels of split route blocks (split_route_blocks)
    shared_mma: MoeMmaPlan | None = None  # the shared expert's CUDA kernels

    @property
    def direct(self) -> bool:
        """Each slot its own one-row block, read from topk_ids (direct_route): no route pack, down combines."""
        return self.mma is not None and self.mma.direct


def plan_moe_call(experts: ExpertSet, max_tokens: int, top_k: int, shared: ExpertSet | None = None,
                  slot_capacity: int = DEFAULT_SLOT_CAPACITY, block_m: int | None = None, decode_k: int | None = None,
                  stage_capacity: int = 0, max_stage_bits: float = 0,
                  stage_codebooks: tuple = DEFAULT_STAGE_CODEBOOKS) -> MoECallPlan:
    """The decisions of calls of up to `max_tokens` tokens routed to `top_k` experts each, in chunks of at most
    `slot_capacity` slots, over validated experts (MoEPlan validates, check_call_limits included); block_m and
    decode_k: the caller's, else chosen; stage_*: the residual stages to accept (stage_limits). The CUDA experts'
    kernels are compiled here (CUDA C++ where they can run, before any capture; the Triton kernels otherwise)."""
    E, H = experts.planned_experts, experts.hidden_size   # a shard plans as its layer
    device, max_slots = experts.device, max_tokens * top_k
    chunk_tokens = min(max_tokens, slot_capacity // top_k)
    slots = chunk_tokens * top_k
    stage_max_k2 = stage_k2_limit(experts, stage_capacity, max_stage_bits)
    stage_formats = formats_up_to(stage_max_k2, stage_codebooks)
    cuda = nvrtc.available(device) and supported(experts, stage_max_k2)
    cuda_block_m = block_m or route_block_rows(slots, E, CUDA_MAX_BLOCK_M, 1.5)
    split = cuda and block_m is None and cuda_block_m == 128 and split_route_blocks(experts, slots, max_slots)
    if cuda and block_m is None and not split and wide_route_blocks(experts, slots, max_slots):
        cuda_block_m = WIDE_BLOCK_M
    # The CUDA experts' route blocks are grid rows (at most 65535; half that beside stage blocks, stage_blocks).
    rows = MAX_GRID_ROWS // 2 if stage_formats else MAX_GRID_ROWS
    cuda = cuda and route_pack_max_blocks(slots, experts.num_experts, cuda_block_m) <= rows
    routed_block_m = cuda_block_m if cuda else block_m or route_block_rows(slots, E)
    direct = direct_route(slots, routed_block_m, format_count(experts))
    shared_cuda = shared is not None and nvrtc.available(device) and supported(shared, 0)
    # A direct plan runs the shared expert first, so its gate/up follows the shared down.
    mma = plan_moe_mma(experts, max_slots, routed_block_m, stage_formats, direct, after_down=direct and shared_cuda,
                       split_peer=int(split)) if cuda else None
    # Chunks of split_min_slots or more also run 192-row blocks (split_route_blocks).
    split = split and mma is not None and mma.ws and mma.ws_down and mma.pre_rotate
    wide_mma = plan_moe_mma(experts, max_slots, WIDE_BLOCK_M, stage_formats, split_peer=2) if split else None
    shared_block_m, shared_mma = route_block_rows(chunk_tokens, 1), None
    if shared_cuda:
        shared_block_m = route_block_rows(chunk_tokens, 1, CUDA_MAX_BLOCK_M)
        # A packed plan runs the shared expert after the routed down.
        after_down = mma is not None and not mma.direct and not mma.ws_down
        shared_mma = plan_moe_mma(shared, chunk_tokens, shared_block_m, after_down=after_down)
    order = format_order(experts)
    return MoECallPlan(
        backend="cuda" if mma is not None else "triton" if device.type == "cuda" or interpreting() else "torch",
        chunk_tokens=chunk_tokens, slot_capacity=slots, block_m=routed_block_m, shared_block_m=shared_block_m,
        decode_k=decode_k or (INTERPRET_DECODE_K if interpreting() else GPU_DECODE_K),
        gate_up_splits=gate_up_splits(E, H, experts.planned_intermediate), stage_max_k2=stage_max_k2, stage_formats=stage_formats,
        base_order=tuple(order) if order else None,
        staged_order=mma is not None and not mma.direct and not mma.ws and bool(stage_formats),
        split_min_slots=split_min_slots(E), mma=mma, wide_mma=wide_mma, shared_mma=shared_mma)


def check_call_limits(experts: ExpertSet, max_tokens: int, top_k: int, slot_capacity: int, block_m: int | None,
                      stage_capacity: int, max_stage_bits: float) -> None:
    """ContractError where the MoE ring's settings are too shallow (check_ring_turns) or an asked-for block_m of 192
    cannot run (check_wide_block_m); reads ints, formats and the device only."""
    check_ring_turns(experts, max_tokens * top_k)
    if block_m == WIDE_BLOCK_M:
        check_wide_block_m(experts, max_tokens, top_k, min(max_tokens, slot_capacity // top_k) * top_k,
                           stage_k2_limit(experts, stage_capacity, max_stage_bits))


def gate_up_splits(num_experts: int, hidden: int, inter: int) -> int:
    """Hidden-size splits of gate/up, from the layer's shape alone (never from the plan's size, the data or the
    chunking), so that a token's bytes do not depend on the call it is in."""
    busy = num_experts * (inter // 128)
    splits = 1
    while splits * 2 <= hidden // 128 and busy * splits * 2 <= SPLIT_TARGET_PROGRAMS:
        splits *= 2
    return splits


def route_block_rows(slots: int, num_experts: int, largest: int = MAX_BLOCK_M, headroom: float = 1.0) -> int:
    """Route-block size from the average rows per expert (times headroom): a power of two in [16, largest]."""
    rows = max(1, int(-(-slots * headroom // num_experts)))
    return max(MIN_BLOCK_M, min(largest, triton.next_power_of_2(rows)))


def check_wide_block_m(experts: ExpertSet, max_tokens: int, top_k: int, slots: int, stage_k2: int) -> None:
    """ContractError unless an asked-for block_m of 192 can run: the H200's warp-specialized CUDA experts (gated,
    stages up to K = 4, down in one k split) over a chunk of `slots` within the grid's rows."""
    if not (nvrtc.available(experts.device) and supported(experts, stage_k2)
            and wide_blocks_run(experts, max_tokens * top_k)
            and route_pack_max_blocks(slots, experts.num_experts, WIDE_BLOCK_M) <= MAX_GRID_ROWS // 2):
        raise ContractError("block_m", "192 needs the H200's warp-specialized CUDA experts (gated, stages up to "
                            "K = 4, down in one k split)")


def format_order(experts: ExpertSet) -> list | None:
    """Experts sorted (stably) by their gate, up and down formats; None when they all share one: route blocks
    in this order keep the experts of one format, and so one compiled mainloop, together on the GPU."""
    formats = [f for f in projection_formats(experts) if f]
    keys = [tuple(f[e] for f in formats) for e in range(experts.num_experts)]
    return sorted(range(experts.num_experts), key=keys.__getitem__) if len(set(keys)) > 1 else None


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


def moe_mma_layout(experts, max_slots: int, block_m: int, stage_formats: tuple = (),
                   direct: bool = False) -> MoeMmaPlan:
    """Formats and splits for an ExpertSet (no compilation); stage_formats ((2K, codebook id), ...) are the
    residual formats compiled in (each one more mainloop, and more registers); direct routes each slot on its
    own (direct_route)."""
    E, H, I = experts.planned_experts, experts.hidden_size, experts.intermediate_size
    fmt = projection_formats(experts)
    warps = warps_for(block_m)
    busy = max(min(E, max_slots), -(-max_slots // block_m))  # route blocks of a full call
    packed = not direct and block_m <= 32
    gu_splits, gu_ktiles = chunk_splits(H, busy * (experts.planned_intermediate // 128) * 2 * warps,
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
    return (WIDE_MIN_ROWS * experts.planned_experts <= slots <= WIDE_MAX_ROWS * experts.planned_experts
            and os.environ.get("EXL3MOE_MOE_WS_192", "1") != "0" and wide_blocks_run(experts, max_slots))


def split_route_blocks(experts, slots: int, max_slots: int) -> bool:
    """Chunks of `slots` whose experts average SPLIT_MIN_ROWS rows or more split each expert's rows between 192- and
    128-row blocks (route_split) and run a kernel of each size over its own table: an expert of 129-192 rows is
    decoded once, one of up to 128 (or 193-256) rows pays for no 192-row block, one of 257-320 takes one of each.
    Only where wide_blocks_run and 128-row blocks are warp-specialized; EXL3MOE_MOE_SPLIT_ROUTE=0 keeps one size
    (wide_route_blocks)."""
    return (slots >= split_min_slots(experts.planned_experts) and os.environ.get("EXL3MOE_MOE_SPLIT_ROUTE", "1") != "0"
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
    return compile_kernels(plan, experts.device)


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


def stage_blocks(plan: MoeMmaPlan) -> bool:
    """Packed 16-row stage plans of more than SMALL_CALL_SLOTS slots run the stages' passes in blocks of their own,
    after all the base's (z doubles), so that an expert with an active stage does not make the tail: the base's bytes
    where no stage is active, base then stage partials summed in order where one is. Elsewhere the blocks that exit
    for want of an active stage cost more than the balance gains (every block of a small call is in flight at once;
    32-row grids). EXL3MOE_MOE_STAGE_BLOCKS=0 runs every block's base and stages in one accumulator."""
    return (bool(plan.stage_formats) and plan.block_m == 16 and not plan.direct and not plan.small_call
            and not plan.ws and os.environ.get("EXL3MOE_MOE_STAGE_BLOCKS", "1") != "0")


def split_inner_grid(plan: MoeMmaPlan) -> bool:
    """Packed mma.sync plans of more than SMALL_CALL_SLOTS slots launch a route block's splits together (SPLIT_INNER):
    the blocks in flight then span fewer route blocks, so fewer experts' formats share the instruction cache. Direct
    and small calls keep the splits outermost (there the inner order measured slower); EXL3MOE_MOE_SPLIT_INNER=0
    keeps it everywhere."""
    return (plan.route_major and not plan.direct and not plan.ws and not plan.small_call
            and os.environ.get("EXL3MOE_MOE_SPLIT_INNER", "1") != "0")
