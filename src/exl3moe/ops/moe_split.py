"""A plan's split route blocks (split_route_blocks): workspace entries and the launches of one chunk.

The chunk's route pack writes 128-row blocks, which the rotation walks; route_split then writes a table of 192-row
and one of 128-row blocks from the same counts and offsets, and gate/up and down each run the 128-row kernel over
its table, then the 192-row kernel over the other (launched early after it). Both kernels give a row the same bytes,
and the tables cover each expert's rows once, so the partials, h_rot and y are those of a plan of one block size.
"""

from __future__ import annotations

from functools import partial

import torch

from ..kernels.moe_mma import moe_down_mma, moe_gate_up_mma, moe_rotate_input
from ..kernels.moe_mma_config import workspace_numels
from ..kernels.route_split import route_split, route_split_max_blocks

_PARTIALS = ("gate_up_partial", "down_partial")
_COUNTERS = ("gate_up_counters", "down_counters")


def split_layout(layout: list, wide_mma, capacity: int, num_experts: int, hidden: int, inter: int) -> list:
    """`layout` (with the 128-row plan's "mma_" entries) plus the two tables and the 192-row kernels' counters; the
    partials, shared by both kernels (rows by sorted position), fit either plan."""
    wide, narrow = route_split_max_blocks(capacity, num_experts)
    sizes = workspace_numels(wide_mma, capacity, wide, hidden, inter)
    names = {name for name, _, _ in layout}
    out = [(name, max(numel, sizes[name[4:]]) if name[4:] in _PARTIALS and name.startswith("mma_") else numel, dtype)
           for name, numel, dtype in layout]
    out += [("mma_" + key, sizes[key], torch.float32) for key in _PARTIALS if sizes[key] and "mma_" + key not in names]
    out += [("wide_block_expert", wide, torch.int32), ("wide_block_start", wide, torch.int32),
            ("narrow_block_expert", narrow, torch.int32), ("narrow_block_start", narrow, torch.int32)]
    return out + [("wide_mma_" + key, sizes[key], torch.int32) for key in _COUNTERS if sizes[key]]


def split_launches(hidden, ws: dict, route: tuple, route_blocks: int, top_k: int, tables, narrow_mma, wide_mma,
                   slots: int, capacity: int, expert_order) -> dict:
    """route_split, the rotation over route_pack's `route` (route_blocks 128-row blocks), then gate/up and down of
    the 128-row table, each followed by its kernel of the 192-row table (launched early: split_chain)."""
    wide_n, narrow_n = route_split_max_blocks(slots, tables.num_experts)
    offsets, sorted_slots = route[2], route[3]
    wide_route = (ws["wide_block_expert"][:wide_n], ws["wide_block_start"][:wide_n], offsets, sorted_slots)
    narrow_route = (ws["narrow_block_expert"][:narrow_n], ws["narrow_block_start"][:narrow_n], offsets, sorted_slots)
    x_rot = ws["mma_x_rot"]
    launches = {
        "route_split": partial(route_split, ws["counts"], offsets, slots, *wide_route[:2], *narrow_route[:2],
                               expert_order),
        "rotate": partial(moe_rotate_input, hidden, x_rot, route, top_k, tables, narrow_mma, route_blocks, capacity),
    }
    kinds = (("", narrow_mma, narrow_route, narrow_n, "mma_"), ("wide_", wide_mma, wide_route, wide_n, "wide_mma_"))
    for name, mma, blocks_route, blocks, counters in kinds:
        launches[name + "gate_up"] = partial(moe_gate_up_mma, hidden, ws["h_rot"], blocks_route, top_k, tables, mma,
                                             ws.get("mma_gate_up_partial"), ws.get(counters + "gate_up_counters"),
                                             blocks, capacity, x_rot)
    for name, mma, blocks_route, blocks, counters in kinds:
        launches[name + "down"] = partial(moe_down_mma, ws["h_rot"], ws["y"], blocks_route, tables, mma,
                                          ws.get("mma_down_partial"), ws.get(counters + "down_counters"), blocks,
                                          capacity)
    return launches
