"""What a CUDA experts' configuration (MoeMmaPlan) compiles: the defines and the prelude of format switches of each
kernel of cuda/moe_mma.cu. The compile-time choices here follow from the configuration's fields alone (and the
EXL3MOE_MOE_* settings they name); ops/moe_planning.py decides those fields.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from . import nvrtc
from .moe_mma_config import WIDE_BLOCK_M, MoeMmaPlan
from .trellis_mma import CHUNK_K, PAIR_SCALAR_MAX_MT, pair_scalar
from .trellis_ws import ws_threads

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
SMALL_CALL_UNROLL = 2  # small calls (MoeMmaPlan.small_call) run every block at once: smallest mainloops


def stage_words_ahead(plan: MoeMmaPlan) -> bool:
    """Direct stage plans ask L2 for the first stage's words of a block before its base mainloop (STAGE_WORDS_AHEAD),
    where its scale is nonzero. Packed plans keep them for the stage's mainloop: there ptxas gives the kernels more
    registers or stack with it, which cost more than the wait; EXL3MOE_MOE_STAGE_WORDS_AHEAD=0 keeps them
    everywhere."""
    return (bool(plan.stage_formats) and plan.direct
            and os.environ.get("EXL3MOE_MOE_STAGE_WORDS_AHEAD", "1") != "0")


def scale_ahead(plan: MoeMmaPlan) -> bool:
    """Direct stage plans read the first stage's scale at each block's start (SCALE_AHEAD), not after the base's
    mainloop. In packed plans the extra register cost them more than the wait; EXL3MOE_MOE_SCALE_AHEAD=0 keeps the
    late read everywhere."""
    return bool(plan.stage_formats) and plan.direct and os.environ.get("EXL3MOE_MOE_SCALE_AHEAD", "1") != "0"


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


def compile_kernels(plan: MoeMmaPlan, device: torch.device) -> MoeMmaPlan:
    """`plan` with its gate/up, down and (where it pre-rotates) rotation kernels compiled for `device`."""
    gate_up = "moe_gate_up_ws" if plan.ws_gate_up else "moe_gate_up_mma"
    return replace(plan, gate_up_kernel=_kernel(plan, gate_up, device),
                   down_kernel=_kernel(plan, "moe_down_ws" if plan.ws_down else "moe_down_mma", device),
                   rotate_kernel=_kernel(plan, "moe_rotate_input", device) if plan.pre_rotate else None)
