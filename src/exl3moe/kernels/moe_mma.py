"""Routed experts on the CUDA C++ decode core (cuda/moe_mma.cu) for plans with 16-row route blocks.

Same contract as the Triton gate/up and down kernels (h_rot [pos, I] fp16, y [slot, H] fp32), but each
projection's hidden (gate/up) or intermediate (down) range is split so that enough warps are in flight at small
batches; the last block of each (route block, 128 columns) sums the splits in order and applies the epilogue.
Splits come from the plan's shape (max slots, E, H, I), never from the data, so outputs stay batch invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import nvrtc
from .trellis_decode import CODEBOOK_ID
from .trellis_mma import chunk_splits

WARPS = 4
PREFETCH = 4
ACTIVATIONS = {"silu": 0, "gelu": 1}  # the kernel's ids; plans take the CUDA path for silu only (see supported)


@dataclass(frozen=True)
class MoeMmaPlan:
    gate_up_variants: tuple  # ((2K, codebook id), ...) present in gate and up
    down_variants: tuple
    variant: torch.Tensor  # int32 [3, E]: index of each projection's variant in its launch's list
    gate_up_splits: int
    gate_up_ktiles: int
    down_splits: int
    down_ktiles: int
    gate_up_kernel: object = None  # CUfunctions, set by plan_moe_mma
    down_kernel: object = None


def supported(experts, tables, block_m: int) -> bool:
    """The CUDA path covers gated silu experts without clamp, biases or residual stages in 16-row route blocks
    (the configuration checked on the H200; the kernel's gelu and clamp code is not enabled until it is too)."""
    return (block_m == 16 and tables.num_stages == 0 and experts.gated and experts.activation == "silu"
            and experts.limit is None and tables.bias_gate_up is None and tables.bias_down is None)


def moe_mma_layout(experts, max_slots: int) -> MoeMmaPlan:
    """Variants, variant table and splits for an ExpertSet (no compilation)."""
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    fmt = [[(int(w.K * 2), CODEBOOK_ID[w.codebook]) for w in getattr(experts, p)] for p in ("gate", "up", "down")]
    gate_up = tuple(sorted(set(fmt[0] + fmt[1])))
    down = tuple(sorted(set(fmt[2])))
    variant = torch.tensor([[gate_up.index(f) for f in fmt[0]], [gate_up.index(f) for f in fmt[1]],
                            [down.index(f) for f in fmt[2]]], dtype=torch.int32, device=experts.device)
    busy = min(E, max_slots)
    gu_splits, gu_ktiles = chunk_splits(H, busy * (I // 128) * 2 * WARPS)
    d_splits, d_ktiles = chunk_splits(I, busy * (H // 128) * WARPS)
    return MoeMmaPlan(gate_up, down, variant, gu_splits, gu_ktiles, d_splits, d_ktiles)


def plan_moe_mma(experts, max_slots: int) -> MoeMmaPlan:
    """moe_mma_layout, with both kernels compiled for the layer's variants."""
    plan = moe_mma_layout(experts, max_slots)
    return replace(plan, gate_up_kernel=_gate_up_kernel(plan, experts.device),
                   down_kernel=_down_kernel(plan, experts.device))


def _dispatch(name: str, variants: tuple) -> str:
    cases = " ".join(f"case {i}: mma_mainloop<{k2}, {cb}, 1, 2, PF>(acc, words, tiles_n, jt0, kt0, kt1, xs, stage); "
                     "break;" for i, (k2, cb) in enumerate(variants))
    return f"#define {name} switch (variant[index]) {{ {cases} }}\n"


def _gate_up_kernel(plan: MoeMmaPlan, device: torch.device):
    prelude = _dispatch("DISPATCH_GATE_UP", plan.gate_up_variants) + "#define DISPATCH_DOWN\n"
    return nvrtc.kernel("moe_mma.cu", "moe_gate_up_mma", (("PF", PREFETCH),), device.index or 0, prelude)


def _down_kernel(plan: MoeMmaPlan, device: torch.device):
    prelude = "#define DISPATCH_GATE_UP\n" + _dispatch("DISPATCH_DOWN", plan.down_variants)
    return nvrtc.kernel("moe_mma.cu", "moe_down_mma", (("PF", PREFETCH),), device.index or 0, prelude)


def workspace_numels(plan: MoeMmaPlan, capacity: int, max_blocks: int, hidden: int, inter: int) -> dict:
    """fp32 partials of gate/up and down, and int32 arrival counters (zeroed once; kernels reset them)."""
    return {"gate_up_partial": plan.gate_up_splits * 2 * capacity * inter,
            "down_partial": plan.down_splits * capacity * hidden,
            "counters": max_blocks * (inter // 128 + hidden // 128)}


def moe_gate_up_mma(hidden, h_rot, route, top_k, tables, experts, plan: MoeMmaPlan, partial, counters, grid_blocks,
                    capacity):
    """h_rot[pos] = down's rotated input of act(gate(x), up(x)) for every routed position (CUDA path)."""
    block_expert, block_start, offsets, sorted_slots = route
    E, H, I = tables.num_experts, tables.hidden_size, tables.intermediate_size
    limit = float(tables.limit) if tables.limit is not None else 0.0
    nvrtc.launch(plan.gate_up_kernel, (grid_blocks, 2 * I // 128, plan.gate_up_splits), WARPS * 32,
                 [hidden, int(hidden.dtype == torch.bfloat16), hidden.stride(0), block_expert, block_start, offsets,
                  sorted_slots, top_k, tables.trellis_addr, tables.suh_addr, tables.svh_addr, plan.variant, E, H, I,
                  partial, capacity, h_rot, counters, plan.gate_up_ktiles, plan.gate_up_splits,
                  ACTIVATIONS[experts.activation], int(tables.limit is not None), limit])


def moe_down_mma(h_rot, y, route, tables, plan: MoeMmaPlan, partial, counters, grid_blocks, capacity):
    """y[slot] = down(h) (fp32, unweighted) for every routed position (CUDA path)."""
    block_expert, block_start, offsets, sorted_slots = route
    E, H, I = tables.num_experts, tables.hidden_size, tables.intermediate_size
    nvrtc.launch(plan.down_kernel, (grid_blocks, H // 128, plan.down_splits), WARPS * 32,
                 [h_rot, y, block_expert, block_start, offsets, sorted_slots, tables.trellis_addr, tables.svh_addr,
                  plan.variant, E, H, I, partial, capacity, counters, plan.down_ktiles, plan.down_splits])
