"""Tensor and expert parallel transformers models of exl3moe.hf: which slice of every quantized linear a rank holds,
and the two ways to get there, sharding a loaded model in place or reading only the rank's slices from the checkpoint.

Attention: q / k / v by columns along whole key-value head groups (a rank's query heads are those of its key-value
heads, so transformers' grouping is unchanged), o by the matching rows. Dense MLP: gate / up by columns, down by rows.
Routed experts: whole experts over the EP ranks, every expert's intermediate width over the TP ranks; the shared
expert by TP on the first EP rank alone. Embeddings, norms, routers and lm_head are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import ContractError
from ..format.hadamard import HAD
from ..format.shards import shard_range, shard_ranges
from ..hf.architectures import is_moe_block
from ..hf.moe_dispatch import EXL3MoEByTokens
from ..ops.modules import EXL3Linear
from ..ops.moe_module import SHARED_GATE_NAME, activation_from_config
from ..ops.router import Router
from .experts import expert_range, expert_shard, tensor_shard
from .layout import ParallelLayout
from .modules import ReducedMoE, RowParallelLinear, reduced_moe
from .split import column_slice, row_slice

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Slice:
    """Output columns or input rows start..stop of a linear (whole 128-wide blocks)."""

    axis: str   # "columns" or "rows"
    start: int
    stop: int


def _aligned(ranges: list, width: int, name: str, what: str) -> None:
    for first, stop in ranges:
        if (first * width) % HAD or (stop * width) % HAD:
            raise ContractError(name, f"{what}: a rank's columns {first * width}:{stop * width} are not whole "
                                f"{HAD}-wide blocks")


def attention_slices(name: str, attention: nn.Module, rank: int, world: int) -> dict:
    """{module path: Slice} of rank `rank` for an attention module with q/k/v/o_proj and head_dim."""
    head_dim = getattr(attention, "head_dim", None)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ContractError(f"{name}.head_dim", f"must be a positive int attribute of the attention, got {head_dim!r}")
    heads = attention.q_proj.out_features // head_dim
    kv_heads = attention.k_proj.out_features // head_dim
    if kv_heads < 1 or heads % kv_heads:
        raise ContractError(f"{name}.k_proj", f"{kv_heads} key-value heads do not group {heads} query heads")
    group = heads // kv_heads
    kv_name = f"{name}.k_proj"
    ranges = shard_ranges(kv_heads, world, kv_name, "key-value heads")
    split = f"{kv_heads} key-value heads ({heads} query heads) of {head_dim} over {world} ranks"
    _aligned(ranges, head_dim, kv_name, split)
    _aligned(ranges, head_dim * group, f"{name}.q_proj", split)
    first, stop = ranges[rank]
    q = (first * group * head_dim, stop * group * head_dim)
    kv = (first * head_dim, stop * head_dim)
    return {f"{name}.q_proj": Slice("columns", *q), f"{name}.k_proj": Slice("columns", *kv),
            f"{name}.v_proj": Slice("columns", *kv), f"{name}.o_proj": Slice("rows", *q)}


def mlp_slices(name: str, mlp: nn.Module, rank: int, world: int) -> dict:
    """{module path: Slice} of rank `rank` for a dense MLP: gate / up by columns, down by rows."""
    blocks = mlp.gate_proj.out_features // HAD
    first, stop = shard_range(blocks, rank, world, f"{name}.gate_proj (columns)", f"blocks of {HAD}")
    span = (first * HAD, stop * HAD)
    return {f"{name}.gate_proj": Slice("columns", *span), f"{name}.up_proj": Slice("columns", *span),
            f"{name}.down_proj": Slice("rows", *span)}


def _has(module: nn.Module, children: tuple) -> bool:
    return all(isinstance(getattr(module, c, None), nn.Module) for c in children)


def linear_slices(model: nn.Module, layout: ParallelLayout) -> dict:
    """{module path: Slice} of every tensor-parallel linear of this rank (attention and dense MLPs outside routed-expert
    blocks); every other linear stays whole. Refusals name the module whose heads or blocks the TP degree cannot split."""
    if layout.tp == 1:
        return {}
    slices, moe = {}, []
    for name, module in model.named_modules():
        if any(name.startswith(root + ".") for root in moe):
            continue
        if is_moe_block(module) or isinstance(module, (EXL3MoEByTokens, ReducedMoE)):
            moe.append(name)
        elif _has(module, ATTENTION):
            slices.update(attention_slices(name, module, layout.tp_rank, layout.tp))
        elif _has(module, MLP):
            slices.update(mlp_slices(name, module, layout.tp_rank, layout.tp))
    return slices


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    model.get_submodule(parent)._modules[leaf] = module


def sliced_module(weight, piece: Slice, max_rows: int, layout: ParallelLayout) -> nn.Module:
    """EXL3Linear of a sliced weight; a row slice sums its partial output over the TP group."""
    linear = EXL3Linear(weight, max_rows)
    return RowParallelLinear(linear, layout.tp_group) if piece.axis == "rows" else linear


def _moe_limits(block: EXL3MoEByTokens) -> tuple:
    return block.decode.max_tokens, (block.prefill or block.decode).max_tokens


def shard_moe_block(block: EXL3MoEByTokens, layout: ParallelLayout) -> ReducedMoE:
    """This rank's part of a loaded routed-expert block."""
    moe = block.decode
    experts, shared, gate = moe.experts, moe.shared, moe.shared_gate
    first, _ = expert_range(experts.num_experts, layout.ep_rank, layout.ep)
    if layout.ep > 1:
        experts = expert_shard(experts, layout.ep_rank, layout.ep)
    if layout.tp > 1:
        experts = tensor_shard(experts, layout.tp_rank, layout.tp)
        shared = None if shared is None else tensor_shard(shared, layout.tp_rank, layout.tp)
    if layout.ep_rank > 0:
        shared, gate = None, None
    return reduced_moe(experts, moe.router, shared, gate, first, *_moe_limits(block), layout.group)


def shard_model(model: nn.Module, layout: ParallelLayout) -> nn.Module:
    """Shard a model of exl3moe.hf.from_pretrained in place for this rank (every rank calls it with its layout)."""
    if layout.world == 1:
        return model
    for name, piece in linear_slices(model, layout).items():
        linear = model.get_submodule(name)
        if not isinstance(linear, EXL3Linear):
            raise ContractError(name, f"must be an EXL3Linear to be sharded, got {type(linear).__name__}")
        cut = column_slice if piece.axis == "columns" else row_slice
        weight = cut(linear.weight, piece.start // HAD, piece.stop // HAD)
        set_module(model, name, sliced_module(weight, piece, linear.max_rows, layout))
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, EXL3MoEByTokens)]
    for name, block in blocks:
        set_module(model, name, shard_moe_block(block, layout))
    return model


def load_moe_block(reader, prefix: str, device, decode_tokens: int, max_tokens: int,
                   layout: ParallelLayout) -> ReducedMoE:
    """This rank's part of routed-expert block `prefix`, reading only its experts and slices."""
    config = reader.config
    activation = activation_from_config(config)
    ep_shard = (layout.ep_rank, layout.ep) if layout.ep > 1 else None
    tp_shard = (layout.tp_rank, layout.tp) if layout.tp > 1 else None
    experts = reader.experts(prefix, activation, device=device, shard=ep_shard, tensor_shard=tp_shard)
    router = Router.from_config(config, reader, prefix, device)
    first, _ = expert_range(router.num_experts, layout.ep_rank, layout.ep)
    shared, gate = None, None
    if layout.ep_rank == 0:
        shared = reader.shared_expert(prefix, activation, device=device, tensor_shard=tp_shard)
        gate_key = f"{prefix}.{SHARED_GATE_NAME}"
        gate = reader.tensor(gate_key, device) if shared is not None and gate_key in reader else None
    return reduced_moe(experts, router, shared, gate, first, decode_tokens, max_tokens, layout.group)


def load_sharded(model: nn.Module, plan, device, max_batch_tokens: int, decode_tokens: int,
                 layout: ParallelLayout) -> None:
    """exl3moe.hf's module swap for one rank: every planned linear and routed-expert block read as this rank's slice."""
    slices = linear_slices(model, layout)
    for name, key in plan.linears.items():
        piece = slices.get(name)
        if piece is None:
            set_module(model, name, EXL3Linear(plan.reader.linear(key, device), max_batch_tokens))
            continue
        weight = plan.reader.linear(key, device, **{piece.axis: (piece.start, piece.stop)})
        set_module(model, name, sliced_module(weight, piece, max_batch_tokens, layout))
    for name, prefix in plan.moe_blocks.items():
        set_module(model, name, load_moe_block(plan.reader, prefix, device, decode_tokens, max_batch_tokens, layout))
