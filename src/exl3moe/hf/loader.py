"""exl3moe.hf.from_pretrained: a transformers model of an EXL3 checkpoint running on exl3moe's modules.

The model is built from config.json on the meta device (no weights initialised), checked against the
checkpoint's headers (plan.py), then its quantized linears become EXL3Linear and its routed-expert blocks
EXL3MoE (a decode plan and a large-call plan over one set of weights: moe_dispatch.py), and every other tensor
is read from the safetensors into the model's own parameters.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import ContractError
from ..format.checkpoint import CheckpointReader, open_checkpoint
from ..ops.modules import EXL3Linear
from .architectures import check_supported
from .moe_dispatch import EXL3MoEByTokens
from .plan import LoadPlan, plan_load

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_DECODE_TOKENS = 64   # decode steps of batch 1 to 64 share one MoE plan


def check_load_args(dtype, max_batch_tokens, decode_tokens) -> None:
    if dtype not in ACTIVATION_DTYPES:
        raise ContractError("dtype", f"must be torch.float16 or torch.bfloat16 (EXL3 activations), got {dtype}")
    for name, value in (("max_batch_tokens", max_batch_tokens), ("decode_tokens", decode_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ContractError(name, f"must be a positive int, got {value!r}")


def meta_model(path: str, dtype: torch.dtype, attn_implementation: str = "sdpa") -> nn.Module:
    """The transformers causal LM of config.json in `path`, every tensor on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    model.get_submodule(parent)._modules[leaf] = module


def _owner(model: nn.Module, name: str) -> tuple:
    parent, _, leaf = name.rpartition(".")
    return model.get_submodule(parent), leaf


def load_plain_tensors(model: nn.Module, plan: LoadPlan, device: torch.device) -> None:
    """Read every planned plain tensor in the dtype the model gave it; tied names get one shared parameter."""
    for key, names in plan.tensors:
        owner, leaf = _owner(model, names[0])
        is_parameter = leaf in owner._parameters
        like = owner._parameters[leaf] if is_parameter else owner._buffers[leaf]
        value = plan.reader.tensor(key).to(device=device, dtype=like.dtype)
        if is_parameter:
            value = nn.Parameter(value, requires_grad=False)
        for name in names:
            owner, leaf = _owner(model, name)
            (owner._parameters if is_parameter else owner._buffers)[leaf] = value


def rebuild_computed_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers left on meta (rotary inverse frequencies) computed again from the module's config."""
    for name, module in model.named_modules():
        stale = [b for b, t in module._buffers.items() if t is not None and t.is_meta]
        if not stale:
            continue
        if getattr(module, "config", None) is None:
            raise RuntimeError(f"{name}: buffers {stale} are not in the checkpoint and cannot be computed")
        fresh = type(module)(module.config).to(device)
        for b in stale:
            module._buffers[b] = fresh._buffers[b]


def replace_quantized(model: nn.Module, plan: LoadPlan, device: torch.device, max_batch_tokens: int,
                      decode_tokens: int = DEFAULT_DECODE_TOKENS) -> None:
    for name, key in plan.linears.items():
        set_module(model, name, EXL3Linear.from_checkpoint(plan.reader, key, device, max_rows=max_batch_tokens))
    for name, prefix in plan.moe_blocks.items():
        block = EXL3MoEByTokens.from_checkpoint(plan.reader, prefix, device, decode_tokens, max_batch_tokens)
        set_module(model, name, block)


def check_materialised(model: nn.Module) -> None:
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device after loading: {left[:5]}")


def open_supported(path) -> CheckpointReader:
    reader = open_checkpoint(path)
    check_supported(reader.config)
    return reader


def from_pretrained(path, device=None, dtype: torch.dtype = torch.float16,
                    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, attn_implementation: str = "sdpa",
                    cuda_graphs: bool = True, decode_tokens: int = DEFAULT_DECODE_TOKENS, tp: int = 1, ep: int = 1,
                    group=None) -> nn.Module:
    """The transformers PreTrainedModel of the EXL3 checkpoint in `path` on exl3moe's kernels.

    device: default cuda when available, else cpu. dtype: activations, float16 or bfloat16. max_batch_tokens:
    rows the EXL3 modules plan for (larger calls re-plan and allocate). decode_tokens: MoE calls of up to this many
    tokens use a plan of their own (moe_dispatch.py). cuda_graphs: on CUDA, generate() with a static cache replays
    the decode step from captured CUDA graphs (graphs.py). tp, ep: under an initialized process group (`group`, default
    torch.distributed's) of tp x ep ranks, this rank's shard, reading only its slices (exl3moe/parallel/model.py; no
    CUDA graphs).
    """
    path = os.fspath(path)
    check_load_args(dtype, max_batch_tokens, decode_tokens)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    layout = None
    if (tp, ep) != (1, 1):
        from ..parallel.layout import make_layout

        layout = make_layout(tp, ep, group)
    reader = open_supported(path)
    model = meta_model(path, dtype, attn_implementation)
    plan = plan_load(model, reader, reader.config["model_type"])
    load_plain_tensors(model, plan, device)
    if layout is None:
        replace_quantized(model, plan, device, max_batch_tokens, decode_tokens)
    else:
        from ..parallel.model import load_sharded

        load_sharded(model, plan, device, max_batch_tokens, decode_tokens, layout)
    rebuild_computed_buffers(model, device)
    check_materialised(model)
    finish(model, path, device, cuda_graphs and layout is None)
    return model


def finish(model: nn.Module, path: str, device: torch.device, cuda_graphs: bool) -> None:
    """Eval mode, the checkpoint's generation config, CUDA-graph decode on CUDA."""
    from transformers import GenerationConfig

    model.eval()
    model.requires_grad_(False)
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    if cuda_graphs and device.type == "cuda":
        from .graphs import install_decode_graphs

        install_decode_graphs(model)
    else:
        model.generation_config.disable_compile = True   # torch.compile cannot trace the kernels' launchers
