"""Synthetic EXL3 checkpoints of any supported architecture: random trellises at the config's real shapes.

Every int16 bit pattern is a valid trellis, so random words with random-sign scales make valid EXL3 weights;
the output scales are set so that each linear keeps activations near unit size, norms are near 1 and router
logits well separated, so a model of many layers stays finite in fp16. For tests and benchmarks.
"""

from __future__ import annotations

import json
import math
import os

import torch
from torch import nn

from ..format.checkpoint import write_checkpoint
from ..format.codebook import codebook_table
from ..format.weight import EXL3Weight
from .architectures import SHARED_EXPERT_CHILDREN, candidate_keys, check_supported, is_moe_block

# Expert projection names a converter keeps: Mixtral's originals, transformers' elsewhere.
EXPERT_NAMES = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}
DEFAULT_EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


class _Writer:
    def __init__(self, model_type: str, K: float, codebook: str, head_K: float, generator: torch.Generator, device):
        self.model_type, self.K, self.codebook, self.head_K = model_type, K, codebook, head_K
        self.g, self.device = generator, torch.device(device)
        self.spread = float(codebook_table(codebook).float().std())
        self.linears, self.tensors = {}, {}

    def stored(self, name: str) -> str:
        return candidate_keys(self.model_type, name)[-1]

    def _scales(self, n: int, scale: float) -> torch.Tensor:
        sign = torch.randint(0, 2, (n,), generator=self.g, device=self.device) * 2 - 1
        magnitude = 0.5 + torch.rand(n, generator=self.g, device=self.device)
        return (sign * magnitude * scale).to(torch.float16)

    def linear(self, key: str, k: int, n: int, bias: bool, K: float | None = None) -> None:
        K = K or self.K
        words = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), generator=self.g, device=self.device,
                              dtype=torch.int32).to(torch.int16)
        b = (torch.randn(n, generator=self.g, device=self.device) * 0.1).to(torch.float16) if bias else None
        self.linears[key] = EXL3Weight(words, self._scales(k, 1.0), self._scales(n, 1.0 / (math.sqrt(k) * self.spread)),
                                       self.codebook, b, key)

    def plain(self, key: str, shape: tuple, name: str) -> None:
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:
            t = 1 + 0.1 * torch.randn(shape, generator=self.g, device=self.device)
        elif leaf == "bias" or leaf == "e_score_correction_bias":
            t = 0.1 * torch.randn(shape, generator=self.g, device=self.device)
        elif "embed" in name:
            t = torch.randn(shape, generator=self.g, device=self.device)
        else:
            t = torch.randn(shape, generator=self.g, device=self.device) * (2.0 / math.sqrt(shape[-1]))
        self.tensors[key] = t.to(torch.bfloat16)

    def moe_block(self, name: str, block: nn.Module) -> None:
        prefix = self.stored(name)
        E, two_i, H = block.experts.gate_up_proj.shape
        inter = two_i // 2
        names = EXPERT_NAMES.get(self.model_type, DEFAULT_EXPERT_NAMES)
        for e in range(E):
            for role, (k, n) in (("gate", (H, inter)), ("up", (H, inter)), ("down", (inter, H))):
                self.linear(f"{prefix}.experts.{e}.{names[role]}", k, n, False)
        self.plain(f"{prefix}.gate.weight", (E, H), f"{name}.gate.weight")
        if getattr(block.gate, "e_score_correction_bias", None) is not None:
            self.plain(f"{prefix}.gate.e_score_correction_bias", (E,), "e_score_correction_bias")
        for child in SHARED_EXPERT_CHILDREN:
            shared = getattr(block, child, None)
            if shared is not None:
                for role in ("gate", "up", "down"):
                    m = getattr(shared, DEFAULT_EXPERT_NAMES[role])
                    self.linear(f"{prefix}.{child}.{DEFAULT_EXPERT_NAMES[role]}", m.in_features, m.out_features, False)
        gate = getattr(block, "shared_expert_gate", None)
        if gate is not None:
            self.plain(f"{prefix}.shared_expert_gate.weight", tuple(gate.weight.shape), "shared_expert_gate.weight")


def synthetic_model_config(config: dict) -> tuple:
    """(config completed by transformers, with architectures; the model on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_supported(config)
    rest = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **rest)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {**hf_config.to_dict(), "architectures": [type(model).__name__]}, model


def write_synthetic_checkpoint(path, config: dict, K: float = 4, codebook: str = "mcg", head_K: float = 6,
                               seed: int = 0, device="cpu", max_shard_bytes: int = 4 << 30) -> dict:
    """Write a random EXL3 checkpoint of `config` (a config.json dict with model_type) into the empty directory
    `path`; every linear at K bits (the lm_head at head_K) in `codebook`. Returns the config written."""
    full, model = synthetic_model_config(config)
    writer = _Writer(full["model_type"], K, codebook, head_K, torch.Generator(device).manual_seed(seed), device)
    replaced = []
    for name, module in model.named_modules():
        if any(name.startswith(r + ".") for r in replaced):
            continue
        if is_moe_block(module):
            writer.moe_block(name, module)
            replaced.append(name)
        elif isinstance(module, nn.Linear):
            head = module is model.get_output_embeddings()
            writer.linear(writer.stored(name), module.in_features, module.out_features, module.bias is not None,
                          head_K if head else None)
            replaced.append(name)
    for name, tensor in model.state_dict().items():
        if not any(name.startswith(r + ".") for r in replaced):
            writer.plain(writer.stored(name.rsplit(".", 1)[0]) + "." + name.rsplit(".", 1)[1], tuple(tensor.shape), name)
    full = {k: v for k, v in full.items() if not k.startswith("_") and k not in ("transformers_version",)}
    write_checkpoint(path, writer.linears, writer.tensors, full, max_shard_bytes)
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": full.get("bos_token_id"), "eos_token_id": full.get("eos_token_id")}, f)
    return full
