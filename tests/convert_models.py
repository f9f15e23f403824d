"""Tiny Hugging Face checkpoints (random init, real architectures) for the converter tests."""

from __future__ import annotations

import torch

from exl3moe.convert.commands import FAST_ENCODING as FAST_ENCODE   # quantize --fast: keeps CPU tests short
from exl3moe.hf.synthetic import synthetic_model_config

# The smallest shapes reaching each architecture's converter paths: 2 routed experts (top-1), one 128-wide head.
TINY = {
    "qwen3_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=128, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=2, num_experts_per_tok=1, intermediate_size=128),
    "qwen2_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=128,
                      shared_expert_intermediate_size=128, intermediate_size=128),
    "glm4_moe": dict(n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=128, intermediate_size=128,
                     first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1, attention_bias=True),
    "llama": dict(intermediate_size=128),
    "qwen3": dict(intermediate_size=128),
}
CORRECTION_BIAS = "e_score_correction_bias"
INIT = 0.1   # weights' init std for the KL tests: logits of std ~1, so a lost or misplaced tensor moves the KL far


def tiny_config(model_type: str = "qwen3_moe", layers: int = 1, tied: bool = True, **extra) -> dict:
    base = dict(model_type=model_type, hidden_size=128, num_hidden_layers=layers, num_attention_heads=1,
                num_key_value_heads=1, head_dim=128, vocab_size=128, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    return {**base, **TINY.get(model_type, {}), **extra}


def save_tiny_model(path, config: dict, seed: int = 0):
    """A random-init transformers model of `config` saved as bf16 safetensors in `path`; returns it (float32).

    Router correction biases (zero at init) are drawn at random, as trained ones are, so a lost one changes routing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    full, _ = synthetic_model_config(config)
    rest = {k: v for k, v in full.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **rest),
                                             attn_implementation="sdpa")
    for module in model.modules():
        bias = getattr(module, CORRECTION_BIAS, None)
        if bias is not None:
            bias.data = 0.2 * torch.randn_like(bias)
    model.to(torch.bfloat16).save_pretrained(path)
    return model.float().eval()


def source_tensors(path) -> dict:
    """Every tensor of a checkpoint saved by save_tiny_model (one shard)."""
    import os

    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def next_token_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) of the next-token distributions."""
    p, q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def check_written(src, reader, routers: set, K: float, widths: dict | None = None) -> None:
    """Every input tensor written: linears (all but the routers and embeddings) encoded at K (or at widths[key]) with
    their biases in fp16, every other tensor (routers, correction biases, norms, embeddings) copied bit for bit; the
    config's quantization_config giving the linears' weighted mean K."""
    source = source_tensors(src)
    linears = {info.key: info for info in reader.linears()}
    assert routers <= set(source), "the tiny model lacks a router tensor the test expects"
    for key, value in source.items():
        module, leaf = key.rsplit(".", 1)
        if module in linears:
            assert leaf in ("weight", "bias") and key not in routers, key
            if leaf == "bias":
                assert torch.equal(reader.tensor(key), value.to(torch.float16)), key
        else:
            assert torch.equal(reader.tensor(key), value), key
    expected = {k.rsplit(".", 1)[0] for k, v in source.items()
                if k.endswith(".weight") and v.dim() == 2 and k not in routers and "embed" not in k}
    assert set(linears) == expected
    want = {key: (widths or {}).get(key, K) for key in linears}
    assert {key: info.K for key, info in linears.items()} == want
    sizes = {key: info.in_features * info.out_features for key, info in linears.items()}
    bits = round(sum(want[k] * n for k, n in sizes.items()) / sum(sizes.values()), 2)
    assert reader.config["quantization_config"] == {"quant_method": "exl3", "bits": bits, "codebook": "mcg"}
