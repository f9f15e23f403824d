"""Fused routed MoE over EXL3 experts: validate -> plan -> bind -> run. `run` allocates nothing and never syncs.

Per chunk of tokens (chunk size fixed by the plan, so the launch sequence depends on T alone):

    route_pack   (1 or 3 launches)  expert histogram, offsets, stable sort of slots, route-block tables
    route_split  (H200, chunks of 128+ rows per expert) a 192-row and a 128-row block table (ops/moe_split.py);
                                    gate/up and down then launch once per table
    token_scale  (Triton experts)   each token's power of two 2^-e (kernels/row_scale.py; 1 for ordinary tokens)
    rotate       (CUDA experts: 64+ row route blocks, packed plans of 33+ slots) gate and up inputs rotated once
    gate/up      (1 launch)         h_rot[pos] = rotated down input of act(gate(x), up(x)), fp16 (Triton: fp32
                                    h32 from x 2^-e, gate and up times 2^e before the activation)
    intermediate (Triton experts)   h_rot[pos] = fp16 h32[pos] times the row's power of two, kept in h_scale[pos]
    down         (1 launch)         y[slot] = down(h), fp32, unweighted (sm_90: starts early, waits for gate/up)
    shared       (2-3 launches, optional) the shared expert's (rotate,) gate/up and down over the chunk's tokens
                                    (sm_90, no rotate: gate/up starts early after the routed down)
    combine      (1 launch)         out[t] = sum_j w[t, j] y[t*top_k + j] (+ shared[t]) in slot order

A plan of at most 16 slots (8 for layers of four or more formats) on the CUDA experts routes directly: the shared
expert first, then gate/up and down over one block per slot read from topk_ids (no route pack), down's last block of
each token combining it (sm_90: the routed gate/up starts early after the shared down).

Workspace: h_rot [capacity, I] fp16, y [capacity, H] fp32, the route tables, and the shared expert's
[chunk tokens, I_s] fp16 and [chunk tokens, H] fp32, with capacity = chunk tokens x top_k slots (Triton experts
also: the token scales [chunk tokens], h32 [capacity, I] and h_scale [capacity] fp32, and the shared expert's
likewise): calls with more tokens are processed chunk by chunk, so scratch never grows with T.

Bytes are deterministic and batch invariant for a plan: every row is computed independently of the
others in its route block, and the combine sums a token's slots in order. The route-block size is part
of the plan (chosen from max_tokens), so two plans for different max_tokens may choose different block
sizes.
"""

from __future__ import annotations

from functools import partial

import torch
import triton

from ..errors import ContractError
from ..format.experts import ExpertSet, check_shared
from ..kernels.moe_combine import moe_combine
from ..kernels.moe_experts import moe_down, moe_gate_up
from ..kernels.moe_intermediate import moe_intermediate
from ..kernels.moe_mma import moe_down_mma, moe_gate_up_mma, moe_rotate_input
from ..kernels.moe_mma_config import WIDE_BLOCK_M, workspace_numels
from ..kernels.route_pack import route_pack, route_pack_max_blocks, route_pack_workspace_numel
from ..kernels.row_scale import row_scales
from ..kernels.trellis_decode import interpreting
from .contracts import check_matrix, check_weights_unchanged, check_workspace, weights_key
from .tables import MoETables, build_tables, check_expert_set
from .moe_planning import DEFAULT_SLOT_CAPACITY, MoECallPlan, check_call_limits, plan_moe_call
from .moe_split import split_layout, split_launches
from .moe_torch import moe_torch
from .stage_limits import stage_codebook_set
from .stage_tables import caller_stage_tables, stage_set_tables, staged_first, write_stage_tables

INPUT_DTYPES = (torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ALIGN = 256


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ContractError(name, f"must be an int >= {minimum}, got {value!r}")
    return value


class MoEPlan:
    """Validated experts, device tables, tile choices and workspace layout for calls of up to max_tokens."""

    def __init__(self, experts: ExpertSet, max_tokens: int, top_k: int, shared: ExpertSet | None = None,
                 out_dtype: torch.dtype | None = None, slot_capacity: int | None = None,
                 block_m: int | None = None, decode_k: int | None = None, stage_capacity: int = 0,
                 max_stage_bits: float = 0, stage_codebooks=None):
        _check_int(max_tokens, "max_tokens", 1)
        _check_int(top_k, "top_k", 1)
        if out_dtype is not None and out_dtype not in OUTPUT_DTYPES:
            raise ContractError("out_dtype", f"must be float16, bfloat16 or float32, got {out_dtype}")
        capacity = DEFAULT_SLOT_CAPACITY if slot_capacity is None else _check_int(slot_capacity, "slot_capacity", 1)
        if capacity < top_k:
            raise ContractError("slot_capacity", f"must hold one token's {top_k} slots, got {capacity}")
        if block_m is not None and block_m not in (16, 32, 64, 128, WIDE_BLOCK_M):
            raise ContractError("block_m", f"must be 16, 32, 64, 128 or 192, got {block_m!r}")
        if decode_k is not None and decode_k not in (16, 32, 64, 128):
            raise ContractError("decode_k", f"must be 16, 32, 64 or 128, got {decode_k!r}")
        _check_int(stage_capacity, "stage_capacity", 0)
        if max_stage_bits and max_stage_bits * 2 not in range(2, 17):
            raise ContractError("max_stage_bits", f"must be 0 or a valid K (1..8, 1.5, 2.5, 3.5), got {max_stage_bits}")
        check_expert_set(experts)
        # The MoE ring's settings and an asked-for 192-row block_m, before anything reaches the device.
        check_call_limits(experts, max_tokens, top_k, capacity, block_m, stage_capacity, max_stage_bits)
        self.stage_codebooks = stage_codebook_set(experts, stage_codebooks)
        if shared is not None:
            check_shared(shared, experts)
            check_expert_set(shared, "shared")
        self.weights_key = weights_key(experts, shared)   # bind refuses weights changed after this
        # Everything is validated: only now do tables reach the device.
        self.tables: MoETables = build_tables(experts, stage_capacity=stage_capacity)
        self.shared_tables = build_tables(shared, "shared") if shared is not None else None
        # Every decision of the plan's calls; the CUDA experts' kernels compiled here, before any capture.
        call = self.call_plan = plan_moe_call(experts, max_tokens, top_k, shared, capacity, block_m, decode_k,
                                              stage_capacity, max_stage_bits, self.stage_codebooks)
        self.stage_max_k2, self.stage_formats = call.stage_max_k2, call.stage_formats
        self.tables.max_k2_gate_up = max(self.tables.max_k2_gate_up, self.stage_max_k2)
        self.tables.max_k2_down = max(self.tables.max_k2_down, self.stage_max_k2)
        E = experts.num_experts
        self.experts, self.shared = experts, shared
        self.device = experts.device
        self.max_tokens, self.top_k, self.out_dtype = max_tokens, top_k, out_dtype
        self.chunk_tokens, self.slot_capacity = call.chunk_tokens, call.slot_capacity
        self.block_m, self.shared_block_m, self.decode_k = call.block_m, call.shared_block_m, call.decode_k
        self.gate_up_splits, self.split_min_slots = call.gate_up_splits, call.split_min_slots
        self.mma, self.wide_mma, self.shared_mma = call.mma, call.wide_mma, call.shared_mma
        self.base_order = list(call.base_order) if call.base_order else None   # the order staged_first starts from
        self.staged_order = call.staged_order   # an order to rewrite when the stages change
        order = staged_first(self.tables.stage_scale, self.base_order) if self.staged_order else self.base_order
        self.expert_order = torch.tensor(order, dtype=torch.int32).to(self.device) if order else None
        self.scales_tokens = self.mma is None or (shared is not None and self.shared_mma is None)
        # The largest |suh| of every gate and up at each hidden column: a token's scale bounds all its rotations.
        self.token_scale_bound = suh_bound(experts, shared) if self.scales_tokens else None
        self._layout = self._workspace_layout(call, E, experts.hidden_size, experts.intermediate_size)
        self.workspace_bytes = sum(_padded_bytes(n, dt) for _, n, dt in self._layout)
        if call.direct:   # slot b is position b; the last of a token's slot blocks combines its 128 columns
            self.direct_slots = torch.arange(self.slot_capacity, dtype=torch.int32).to(self.device)
        if self.shared_mma is not None:
            # The shared expert's fixed route: token t is slot t, blocks of shared_block_m rows in order.
            blocks = triton.cdiv(self.chunk_tokens, self.shared_block_m)
            rows = torch.arange(self.chunk_tokens + 1, dtype=torch.int32)
            self.shared_route = (torch.zeros(blocks, dtype=torch.int32, device=self.device),
                                 (rows[:blocks] * self.shared_block_m).to(self.device), rows.to(self.device))

    def _workspace_layout(self, call: MoECallPlan, E: int, H: int, I: int) -> list:
        """(name, elements, dtype) of every workspace entry, in order."""
        S, shared = self.slot_capacity, self.shared
        max_blocks = route_pack_max_blocks(S, E, self.block_m)
        layout = [
            ("h_rot", S * I, torch.float16), ("y", S * H, torch.float32),
            ("sorted_slots", S, torch.int32), ("block_expert", max_blocks, torch.int32),
            ("block_start", max_blocks, torch.int32), ("counts", E + 1, torch.int32),
            ("offsets", E + 2, torch.int32), ("num_blocks", 1, torch.int32),
            ("route_workspace", route_pack_workspace_numel(S, E), torch.int32),
        ]
        if self.mma is not None:
            # A direct plan's blocks are its slots (more than max_blocks when E < S).
            layout += _mma_layout("mma_", self.mma, S, max(S, max_blocks) if call.direct else max_blocks, H, I)
            if self.wide_mma is not None:
                layout = split_layout(layout, self.wide_mma, S, E, H, I)
            if call.direct:
                layout.append(("mma_token_counters", self.chunk_tokens * (H // 128), torch.int32))
        else:
            layout += [("h32", S * I, torch.float32), ("h_scale", S, torch.float32)]
            if self.gate_up_splits > 1:
                layout.append(("gate_up_partial", self.gate_up_splits * 2 * S * I, torch.float32))
        if self.scales_tokens:
            layout.append(("token_scale", self.chunk_tokens, torch.float32))
        if shared is not None:
            layout += [("shared_h_rot", self.chunk_tokens * shared.intermediate_size, torch.float16),
                       ("shared_y", self.chunk_tokens * H, torch.float32)]
            if self.shared_mma is None:
                layout += [("shared_h32", self.chunk_tokens * shared.intermediate_size, torch.float32),
                           ("shared_h_scale", self.chunk_tokens, torch.float32)]
            if self.shared_mma is not None:
                blocks = triton.cdiv(self.chunk_tokens, self.shared_block_m)
                layout += _mma_layout("shared_mma_", self.shared_mma, self.chunk_tokens, blocks, H,
                                      shared.intermediate_size)
        return layout

    def bind(self, workspace: torch.Tensor) -> "MoERunner":
        """A runner whose scratch is views into `workspace` (1-D uint8, >= workspace_bytes, on the experts' device)."""
        check_workspace(workspace, self.workspace_bytes, self.device, "the experts are")
        check_weights_unchanged(self.weights_key, self.experts, self.shared)
        views, offset = {}, 0
        for name, numel, dtype in self._layout:
            size = numel * _itemsize(dtype)
            views[name] = workspace[offset:offset + size].view(dtype)
            offset += _padded_bytes(numel, dtype)
        for name, view in views.items():
            if name.endswith("_counters"):
                view.zero_()
        return MoERunner(self, views)

    @property
    def workspace_layout(self) -> tuple:
        """(name, elements, dtype) of every workspace entry in order: plans with equal layouts can share one."""
        return tuple(self._layout)

    def allocate(self) -> torch.Tensor:
        return torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)

    def load_stages(self, stages: list) -> None:
        """Hot swap: replace the residual stages by rewriting this plan's stage tables in place.

        Captured graphs keep reading the same table tensors, so the next replay uses the new stages.
        `[]` restores the base. Refused with ContractError (nothing written) unless the stages fit the
        plan: at most `stage_capacity` stages (or as many as the plan was made with), residual K within
        the plan's widest (`max_stage_bits`, else its widest residual, else 2), residual codebooks among the
        plan's (`stage_codebooks`, else its stages', else mcg), and biases only where the plan has bias tables.
        Call between replays, not while one runs; the plan keeps the new stages alive.
        """
        swapped, new = stage_set_tables(self, stages)
        write_stage_tables(self, new)
        self.experts = swapped

    def load_stage_tables(self, tables: dict, abi_version: int) -> None:
        """Hot swap from caller-built stage tables (docs/moe-tables.md, version `abi_version`), copied in place.

        `tables` maps "stage_addr" (int64), "stage_k2", "stage_codebook" (int32) and "stage_scale" (float32), each
        contiguous on the plan's device with the shape of `self.tables.stage_scale` ([S, 3, E]), and optionally
        "bias_gate_up" / "bias_down" where the plan has bias tables (absent: left as they are). Refused with
        ContractError naming the field or entry (nothing written): an abi_version other than MOE_ADDITIVE_ABI_VERSION,
        a wrong dtype, shape, device or layout, a non-finite scale or one outside 2^-40..2^40, a nonzero scale on a
        non-positive or unaligned address, or a (2K, codebook) outside the plan's compiled `stage_formats`; entries of
        zero scale are ignored (written empty). Rewrites the route-block order as load_stages does. Validation reads the
        tables on the host (it syncs): call between replays, never inside a capture. The caller keeps every tensor
        the addresses point at alive; the plan stops holding the stages of an earlier load_stages.
        """
        new = caller_stage_tables(self, tables, abi_version)
        write_stage_tables(self, new)
        base = self.experts
        self.experts = ExpertSet(base.gate, base.up, base.down, base.activation, base.limit, [], base.name)


def suh_bound(experts: ExpertSet, shared: ExpertSet | None) -> torch.Tensor:
    """fp16 [H]: max |suh| over the gate and up of every expert of both sets, per hidden column."""
    sets = [experts] + ([shared] if shared is not None else [])
    suh = [w.suh.abs() for s in sets for proj in (s.gate, s.up) if proj is not None for w in proj]
    return torch.stack(suh).amax(dim=0).contiguous()


def _mma_layout(prefix: str, mma, capacity: int, max_blocks: int, hidden: int, inter: int) -> list:
    """Workspace entries of the CUDA experts: fp32 partials, arrival counters, pre-rotated inputs."""
    dtypes = {"gate_up_partial": torch.float32, "down_partial": torch.float32, "gate_up_counters": torch.int32,
              "down_counters": torch.int32, "x_rot": torch.float16}
    sizes = workspace_numels(mma, capacity, max_blocks, hidden, inter)
    return [(prefix + key, numel, dtypes[key]) for key, numel in sizes.items() if numel]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _padded_bytes(numel: int, dtype: torch.dtype) -> int:
    return -(-numel * _itemsize(dtype) // _ALIGN) * _ALIGN


class MoERunner:
    """A plan bound to a workspace. `run` launches kernels only: no allocation, no host sync."""

    def __init__(self, plan: MoEPlan, views: dict):
        self.plan = plan
        self._ws = views

    def _check(self, hidden, topk_ids, topk_weights, out) -> int:
        plan = self.plan
        H = plan.tables.hidden_size
        for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("out", out)):
            if not isinstance(t, torch.Tensor):
                raise ContractError(name, f"must be a tensor, got {type(t).__name__}")
            if t.device != plan.device:
                raise ContractError(name, f"is on {t.device}, the experts are on {plan.device}")
        if hidden.dtype not in INPUT_DTYPES:
            raise ContractError("hidden", f"dtype must be float16 or bfloat16, got {hidden.dtype}")
        check_matrix(hidden, "hidden", None, H, "", "the hidden size", "rows")
        T = hidden.shape[0]
        if T > plan.max_tokens:
            raise ContractError("hidden", f"has {T} tokens, the plan was made for at most {plan.max_tokens}")
        if topk_ids.dtype not in ID_DTYPES:
            raise ContractError("topk_ids", f"dtype must be int32 or int64, got {topk_ids.dtype}")
        check_matrix(topk_ids, "topk_ids", T, plan.top_k, "hidden's tokens", "the plan's top_k", "contiguous")
        if topk_weights.dtype not in WEIGHT_DTYPES:
            raise ContractError("topk_weights", f"dtype must be float16, bfloat16 or float32, got {topk_weights.dtype}")
        check_matrix(topk_weights, "topk_weights", T, plan.top_k, "hidden's tokens", "the plan's top_k", "contiguous")
        allowed = OUTPUT_DTYPES if plan.out_dtype is None else (plan.out_dtype,)
        if out.dtype not in allowed:
            raise ContractError("out", f"dtype must be one of {allowed}, got {out.dtype}")
        check_matrix(out, "out", T, H, "hidden's tokens", "the hidden size", "disjoint")
        return T

    def run(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            out: torch.Tensor) -> torch.Tensor:
        """out [T, H] <- sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) (+ shared(hidden[t]))."""
        T = self._check(hidden, topk_ids, topk_weights, out)
        if T == 0:
            return out
        plan = self.plan
        if not use_triton(hidden):
            out.copy_(moe_torch(hidden, plan, topk_ids, topk_weights))
            return out
        for t0 in range(0, T, plan.chunk_tokens):
            t1 = min(T, t0 + plan.chunk_tokens)
            self._run_chunk(hidden[t0:t1], topk_ids[t0:t1], topk_weights[t0:t1], out[t0:t1])
        return out

    def _run_chunk(self, hidden, topk_ids, topk_weights, out) -> None:
        for launch in self.chunk_launches(hidden, topk_ids, topk_weights, out).values():
            launch()

    def chunk_launches(self, hidden, topk_ids, topk_weights, out) -> dict:
        """The launches of one chunk, in call order, as named callables (run calls them all; probes time each)."""
        plan, ws = self.plan, self._ws
        tokens = topk_ids.shape[0]
        if tokens > plan.chunk_tokens:
            raise ContractError("topk_ids", f"one chunk holds at most {plan.chunk_tokens} tokens, got {tokens}")
        scale = {}
        if plan.scales_tokens:
            scale["token_scale"] = partial(row_scales, hidden, plan.token_scale_bound, ws["token_scale"][:tokens])
        shared = self._shared_launches(hidden, topk_ids.shape[0])
        shared_y = ws["shared_y"] if shared else None
        if plan.mma is not None and plan.mma.direct:
            return {**scale, **shared, **self._direct_launches(hidden, topk_ids, topk_weights, out, shared_y)}
        tables = plan.tables
        rows, top_k = topk_ids.shape
        E, slots = tables.num_experts, rows * top_k
        max_blocks = route_pack_max_blocks(slots, E, plan.block_m)
        block_expert, block_start = ws["block_expert"][:max_blocks], ws["block_start"][:max_blocks]
        sorted_slots = ws["sorted_slots"][:slots]
        route = (block_expert, block_start, ws["offsets"], sorted_slots)
        launches = {
            **scale,
            "route_pack": partial(route_pack, topk_ids, E, ws["counts"], ws["offsets"], sorted_slots, block_expert,
                                  block_start, ws["num_blocks"],
                                  ws["route_workspace"][:route_pack_workspace_numel(slots, E)], block_m=plan.block_m,
                                  expert_order=plan.expert_order),
        }
        if plan.wide_mma is not None and slots >= plan.split_min_slots:
            launches.update(split_launches(hidden, ws, route, max_blocks, top_k, tables, plan.mma, plan.wide_mma,
                                           slots, plan.slot_capacity, plan.expert_order))
        elif plan.mma is not None:
            launches.update(_mma_launches("", hidden, ws, ws["h_rot"], ws["y"], route, top_k, tables, plan.mma,
                                          max_blocks, plan.slot_capacity))
        else:
            launches["gate_up"] = partial(moe_gate_up, hidden, ws["token_scale"], ws["h32"], route, slots, top_k,
                                          tables, max_blocks, True, plan.block_m, plan.decode_k,
                                          partial=ws.get("gate_up_partial"), splits=plan.gate_up_splits)
            launches["intermediate"] = partial(moe_intermediate, ws["h32"], ws["h_rot"], ws["h_scale"], route, slots,
                                               max_blocks, True, plan.block_m, tables.intermediate_size)
            launches["down"] = partial(moe_down, ws["h_rot"], ws["h_scale"], ws["y"], route, slots, tables,
                                       max_blocks, True, plan.block_m, plan.decode_k)
        launches.update(shared)
        launches["combine"] = partial(moe_combine, topk_ids, topk_weights, ws["y"], shared_y, out, E)
        return launches

    def _direct_launches(self, hidden, topk_ids, topk_weights, out, shared_y) -> dict:
        """A direct plan: gate/up and down over one block per slot, down combining each token when it is done."""
        plan, ws, tables = self.plan, self._ws, self.plan.tables
        slots = topk_ids.numel()
        route = (topk_ids, plan.direct_slots, plan.direct_slots, plan.direct_slots)
        ids_64 = int(topk_ids.dtype == torch.int64)
        combine = (topk_ids, topk_weights, shared_y, out, ws["mma_token_counters"])
        return {
            "gate_up": partial(moe_gate_up_mma, hidden, ws["h_rot"], route, topk_ids.shape[1], tables, plan.mma,
                               ws["mma_gate_up_partial"], ws["mma_gate_up_counters"], slots, plan.slot_capacity,
                               None, ids_64),
            "down": partial(moe_down_mma, ws["h_rot"], ws["y"], route, tables, plan.mma, ws["mma_down_partial"],
                            ws["mma_down_counters"], slots, plan.slot_capacity, combine),
        }

    def _shared_launches(self, hidden, rows: int) -> dict:
        """The shared expert's launches over the chunk's `rows` tokens (empty without a shared expert)."""
        plan, ws = self.plan, self._ws
        if plan.shared_mma is not None:
            shared_blocks = triton.cdiv(rows, plan.shared_block_m)
            only_expert, starts, row_counts = plan.shared_route
            # offsets[1] (all route_block reads of expert 0) is row_counts[rows]: the chunk's row count.
            shared_route = (only_expert[:shared_blocks], starts[:shared_blocks], row_counts[rows - 1:], row_counts)
            return _mma_launches("shared_", hidden, ws, ws["shared_h_rot"], ws["shared_y"], shared_route, 1,
                                 plan.shared_tables, plan.shared_mma, shared_blocks, plan.chunk_tokens)
        if plan.shared_tables is None:
            return {}
        unused = (ws["counts"],) * 4
        blocks, block_m, tables = triton.cdiv(rows, plan.shared_block_m), plan.shared_block_m, plan.shared_tables
        h32, h_rot, h_scale = ws["shared_h32"], ws["shared_h_rot"], ws["shared_h_scale"]
        return {"shared_gate_up": partial(moe_gate_up, hidden, ws["token_scale"], h32, unused, rows, 1, tables,
                                          blocks, False, block_m, plan.decode_k),
                "shared_intermediate": partial(moe_intermediate, h32, h_rot, h_scale, unused, rows, blocks, False,
                                               block_m, tables.intermediate_size),
                "shared_down": partial(moe_down, h_rot, h_scale, ws["shared_y"], unused, rows, tables, blocks, False,
                                       block_m, plan.decode_k)}


def _mma_launches(name: str, hidden, ws: dict, h_rot, y, route, top_k: int, tables, mma, blocks: int,
                  capacity: int) -> dict:
    """The CUDA experts' launches (rotate, gate/up, down) over workspace entries with prefix name + "mma_"."""
    prefix = name + "mma_"
    x_rot = ws.get(prefix + "x_rot")
    launches = {}
    if x_rot is not None:
        launches[name + "rotate"] = partial(moe_rotate_input, hidden, x_rot, route, top_k, tables, mma, blocks,
                                            capacity)
    launches[name + "gate_up"] = partial(moe_gate_up_mma, hidden, h_rot, route, top_k, tables, mma,
                                         ws.get(prefix + "gate_up_partial"), ws.get(prefix + "gate_up_counters"),
                                         blocks, capacity, x_rot)
    launches[name + "down"] = partial(moe_down_mma, h_rot, y, route, tables, mma, ws.get(prefix + "down_partial"),
                                      ws.get(prefix + "down_counters"), blocks, capacity)
    return launches


def moe_plan(experts: ExpertSet, max_tokens: int, top_k: int, shared: ExpertSet | None = None,
             out_dtype: torch.dtype | None = None, slot_capacity: int | None = None,
             block_m: int | None = None, decode_k: int | None = None, stage_capacity: int = 0,
             max_stage_bits: float = 0, stage_codebooks=None) -> MoEPlan:
    """Validate everything and plan calls of up to `max_tokens` tokens routed to `top_k` experts each.

    For residual-stage hot swaps (`MoEPlan.load_stages`), reserve `stage_capacity` stage slots, the widest
    residual K (`max_stage_bits`) and the residual codebooks (`stage_codebooks`, e.g. ["mcg", "mul1"]) the
    plan must accept. The CUDA experts compile one mainloop per accepted residual format, and each costs
    registers, so accept no more than a deployment swaps in.
    """
    return MoEPlan(experts, max_tokens, top_k, shared, out_dtype, slot_capacity, block_m, decode_k,
                   stage_capacity, max_stage_bits, stage_codebooks)


def fused_experts(hidden: torch.Tensor, experts: ExpertSet, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  shared: ExpertSet | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plan, bind a fresh workspace and run once; the output has hidden's dtype unless out_dtype says."""
    for name, t in (("hidden", hidden), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ContractError(name, f"must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    dtype = out_dtype or hidden.dtype
    plan = moe_plan(experts, max(1, hidden.shape[0]), max(1, topk_ids.shape[1]), shared, dtype)
    out = torch.empty(hidden.shape[0], experts.hidden_size, dtype=dtype, device=hidden.device)
    return plan.bind(plan.allocate()).run(hidden, topk_ids, topk_weights, out)
