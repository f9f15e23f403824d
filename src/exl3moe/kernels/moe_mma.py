"""Routed experts on the CUDA C++ decode core (cuda/moe_mma.cu) for route blocks of 16 to 192 rows: the launches.

Same contract as the Triton gate/up and down kernels (h_rot [pos, I] fp16, y [slot, H] fp32), but each
projection's hidden (gate/up) or intermediate (down) range is split so that enough warps are in flight at small
batches; the last block of each (route block, 128 columns) sums the splits in order and applies the epilogue.
Each launcher runs the kernels a compiled MoeMmaPlan holds (moe_mma_source.compile_kernels); validates nothing.
"""

from __future__ import annotations

import torch

from . import nvrtc
from .moe_mma_config import MoeMmaPlan, ws_shared_bytes
from .trellis_ws import ws_threads

MAX_GRID_ROWS = 65535  # gridDim.y (z with split_inner): gate/up and down launch one grid row per route block
ACTIVATIONS = {"silu": 0, "gelu": 1}  # the kernel's ids (gated activations only)
ROTATE_ROWS = 8  # rows per moe_rotate_input block (the kernel's constant)
DTYPE_ID = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


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
