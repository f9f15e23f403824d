"""`exl3moe verify PATH --tp N --ep M`: every quantized linear and MoE layer of a checkpoint sharded over N x M
processes (gloo; one GPU per rank, shared round-robin, when GPUs exist), each rank reading only its slice; the
all-reduced fp32 output of each layer against the single-process fp32 output and float64, in one table.

Linears split over the TP ranks: o_proj / down_proj / w2 by rows, the others by columns (the other way where the
preferred one has fewer 128-wide blocks than ranks); EP ranks repeat them. MoE layers: whole experts over the EP
ranks, every expert's intermediate over the TP ranks, the shared expert by TP on the first EP rank.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass

import torch
from rich.table import Table

from .. import reference
from ..errors import ContractError, FormatError
from ..format.checkpoint import open_checkpoint
from ..format.hadamard import HAD
from ..format.shards import shard_range
from ..ops.linear import linear
from ..ops.moe_module import SHARED_GATE_NAME, EXL3MoE, activation_from_config
from ..ops.router import Router
from ..rows import LIMIT, rel_l2
from ..verify import LINEAR_ROWS, MOE_TOKENS, hidden_size, work_items
from .experts import expert_range
from .layout import check_degrees
from .modules import ExpertShardRouter

SHARDED_LIMIT = 1e-5   # relative L2 of the all-reduced output against one process, both fp32
ROW_PARALLEL = ("o_proj", "down_proj", "w2")


@dataclass
class ParallelRow:
    name: str
    split: str
    vs_single: float = float("nan")
    vs_float64: float = float("nan")
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error and self.vs_single < SHARDED_LIMIT and self.vs_float64 < LIMIT


def linear_split(info, tp: int) -> tuple:
    """("columns" | "rows", features) of the split of a linear over tp ranks; ContractError if neither axis splits."""
    sizes = {"columns": info.out_features, "rows": info.in_features}
    axes = ["rows", "columns"] if info.key.rsplit(".", 1)[-1] in ROW_PARALLEL else ["columns", "rows"]
    for axis in axes:
        if sizes[axis] // HAD >= tp:
            return axis, sizes[axis]
    raise ContractError(info.key, f"{info.in_features}x{info.out_features}: neither its rows nor its columns hold "
                        f"{tp} blocks of {HAD}, one per TP rank")


def _random_input(index: int, rows: int, width: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(index)
    return (torch.randn(rows, width, generator=g) * scale).half()


def run_linear(reader, info, index: int, layout, device) -> tuple:
    """(this rank's fp32 contribution to the whole output, x, split label)."""
    axis, size = linear_split(info, layout.tp)
    first, stop = shard_range(size // HAD, layout.tp_rank, layout.tp, f"{info.key} ({axis})", f"blocks of {HAD}")
    span = (first * HAD, stop * HAD)
    x = _random_input(index, LINEAR_ROWS, info.in_features)
    out = torch.zeros(LINEAR_ROWS, info.out_features, dtype=torch.float32)
    if layout.ep_rank == 0:
        w = reader.linear(info.key, device, **{axis: span})
        xs = x[:, span[0]:span[1]].contiguous() if axis == "rows" else x
        y = linear(xs.to(device), w, out_dtype=torch.float32)
        if axis == "rows":
            out += y.cpu()
        else:
            out[:, span[0]:span[1]] = y.cpu()
    return out, x, f"{axis} / {layout.tp}" if layout.tp > 1 else "whole"


def _moe_parts(reader, prefix: str, device, ep_shard, tp_shard, with_shared: bool) -> tuple:
    activation = activation_from_config(reader.config) if "hidden_act" in reader.config else "silu"
    experts = reader.experts(prefix, activation, device=device, shard=ep_shard, tensor_shard=tp_shard)
    shared = reader.shared_expert(prefix, activation, device=device, tensor_shard=tp_shard) if with_shared else None
    gate_key = f"{prefix}.{SHARED_GATE_NAME}"
    gate = reader.tensor(gate_key, device) if shared is not None and gate_key in reader else None
    return experts, shared, gate


def run_moe(reader, prefix: str, index: int, layout, device) -> tuple:
    """(this rank's fp32 partial output of MoE layer `prefix`, x, split label)."""
    if f"{prefix}.gate.weight" not in reader:
        raise ContractError(prefix, "has no router (gate.weight): the sharded check routes by the layer's router")
    router = Router.from_config(reader.config, reader, prefix, device)
    ep_shard = (layout.ep_rank, layout.ep) if layout.ep > 1 else None
    tp_shard = (layout.tp_rank, layout.tp) if layout.tp > 1 else None
    experts, shared, gate = _moe_parts(reader, prefix, device, ep_shard, tp_shard, layout.ep_rank == 0)
    first, _ = expert_range(router.num_experts, layout.ep_rank, layout.ep)
    x = _random_input(index, MOE_TOKENS, hidden_size(reader, prefix), 0.5)
    local = ExpertShardRouter(router, first, experts.num_experts)
    out = EXL3MoE(experts, local, shared, gate, MOE_TOKENS, torch.float32)(x.to(device)).cpu()
    return out, x, f"experts / {layout.ep} x tensor / {layout.tp}"


def single_and_float64(reader, check: str, name: str, x: torch.Tensor, device) -> tuple:
    """(one process's fp32 output, float64 reference) of the same layer on the same input."""
    if check == "linear":
        w = reader.linear(name, device)
        return linear(x.to(device), w, out_dtype=torch.float32).cpu(), reference.linear(x, w.to("cpu"))
    module = EXL3MoE.from_checkpoint(reader, name, device, max_tokens=x.shape[0], out_dtype=torch.float32)
    xd = x.to(device)
    ids, weights = module.router(xd)
    gated = module.shared_gate is not None
    cpu = lambda s: None if s is None else s.to("cpu")  # noqa: E731
    ref = reference.moe(x, cpu(module.experts), ids.cpu(), weights.cpu(), shared=None if gated else cpu(module.shared))
    if gated:
        gate = torch.sigmoid(x.double() @ module.shared_gate.cpu().double())
        ref = ref + reference.moe(x, cpu(module.shared), torch.zeros_like(ids[:, :1]).cpu(), gate)
    return module(xd).cpu(), ref


def rank_device(rank: int, force_cpu: bool) -> torch.device:
    count = 0 if force_cpu else torch.cuda.device_count()
    return torch.device("cuda", rank % count) if count else torch.device("cpu")


def worker(rank: int, world: int, port: int, path: str, tp: int, ep: int, force_cpu: bool, out: str) -> None:
    import torch.distributed as dist

    from .layout import ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = rank_device(rank, force_cpu)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        reader = open_checkpoint(path)
        layout = ParallelLayout(tp, ep, rank)
        infos = {info.key: info for info in reader.linears()}
        rows = []
        for index, (check, name) in enumerate(work_items(reader)):
            rows.append(_check_one(reader, check, name, infos, index, layout, device, dist))
        if rank == 0:
            torch.save(rows, os.path.join(out, "rows.pt"))
    finally:
        dist.destroy_process_group()


def _check_one(reader, check: str, name: str, infos: dict, index: int, layout, device, dist) -> ParallelRow:
    """One layer on every rank; rank 0 compares (every rank takes part in the one all-reduce, or all refuse alike)."""
    try:
        run = run_linear if check == "linear" else run_moe
        partial, x, split = run(reader, infos[name] if check == "linear" else name, index, layout, device)
    except (ContractError, FormatError) as err:
        return ParallelRow(name, "", error=str(err))
    dist.all_reduce(partial)
    if layout.rank != 0:
        return ParallelRow(name, split)
    single, ref = single_and_float64(reader, check, name, x, device)
    return ParallelRow(name, split, rel_l2(partial, single), rel_l2(partial, ref))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(rows: list, console, tp: int, ep: int) -> None:
    table = Table(title=f"sharded over tp {tp} x ep {ep} = {tp * ep} processes", title_justify="left")
    for column, justify in (("layer", "left"), ("split", "left"), ("vs 1 process", "right"),
                            ("vs float64", "right"), ("check", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for row in rows:
        verdict = "[green]ok[/green]" if row.passed else "[red]ERROR[/red]" if row.error else "[red]FAIL[/red]"
        cells = ("", "") if row.error else (f"{row.vs_single:.1e}", f"{row.vs_float64:.1e}")
        table.add_row(row.name, row.split or row.error, *cells, verdict)
    console.print(table)


def verify_parallel(path: str, tp: int, ep: int, console, force_cpu: bool = False) -> int:
    """Run the sharded check over tp x ep spawned processes; print one table; 0 pass, 1 a number over its limit,
    2 a layer that could not be checked."""
    import torch.multiprocessing as mp

    check_degrees(tp, ep)
    reader = open_checkpoint(path)   # refusals of the checkpoint come before any process starts
    where = "CPU" if rank_device(0, force_cpu).type == "cpu" else f"{torch.cuda.device_count()} GPU(s)"
    console.print(f"exl3moe verify {reader.path} --tp {tp} --ep {ep}: {tp * ep} gloo processes on {where}")
    console.print(f"compares: each layer's all-reduced fp32 output with one process's (limit {SHARDED_LIMIT:g}) and "
                  f"with float64 (limit {LIMIT:g}), relative L2")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(tp * ep, free_port(), reader.path, tp, ep, force_cpu, out), nprocs=tp * ep, join=True)
        rows = torch.load(os.path.join(out, "rows.pt"), weights_only=False)
    print_table(rows, console, tp, ep)
    if any(row.error for row in rows) or not rows:
        return 2
    return 0 if all(row.passed for row in rows) else 1
