"""Tiny Hugging Face MoE checkpoints (random init, real architectures) for the converter tests."""

from __future__ import annotations

import torch

from exl3moe.convert.commands import FAST_ENCODING as FAST_ENCODE   # quantize --fast: keeps CPU tests short
from exl3moe.hf.synthetic import synthetic_model_config

TINY = {
    "qwen3_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=128, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=2, num_experts_per_tok=1, intermediate_size=128),
}


def tiny_config(model_type: str = "qwen3_moe", layers: int = 1, tied: bool = True, **extra) -> dict:
    base = dict(model_type=model_type, hidden_size=128, num_hidden_layers=layers, num_attention_heads=1,
                num_key_value_heads=1, head_dim=128, vocab_size=128, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    return {**base, **TINY.get(model_type, {}), **extra}


def save_tiny_model(path, config: dict, seed: int = 0):
    """A random-init transformers model of `config` saved as bf16 safetensors in `path`; returns it (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    full, _ = synthetic_model_config(config)
    rest = {k: v for k, v in full.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **rest),
                                             attn_implementation="sdpa")
    model.to(torch.bfloat16).save_pretrained(path)
    return model.float().eval()
