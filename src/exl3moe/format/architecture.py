"""The linears (and router tensors) a known architecture defines, from its config.json alone.

qwen3_moe, qwen2_moe, mixtral, glm4_moe and the dense llama / mistral / qwen2 / qwen3: every layer's attention
q/k/v/o, its dense MLP or its routed experts (and shared expert, router), and lm_head unless the embeddings are tied.
Unknown architectures return None: the checkpoint is then checked against its own manifest only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT = ("w1", "w2", "w3")
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
ARCHITECTURE_NAMES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                      "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                      "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
                      "Glm4MoeForCausalLM": "glm4_moe"}


@dataclass(frozen=True)
class Expected:
    """What an architecture defines: linear module keys (quantized, or plain where the manifest says so) and plain
    tensors (routers) by full name."""

    model_type: str
    linears: tuple
    tensors: tuple


def model_type(config: dict) -> str | None:
    """config's model_type when it is one of the known architectures, else the one its `architectures` names."""
    kind = config.get("model_type")
    if kind in DENSE + MOE:
        return kind
    names = config.get("architectures")
    for name in names if isinstance(names, list) else ():
        if isinstance(name, str) and name in ARCHITECTURE_NAMES:
            return ARCHITECTURE_NAMES[name]
    return None


def _count(config: dict, key: str, minimum: int = 1) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FormatError(f"config.json:{key}", f"must be an int >= {minimum} for this architecture, got {value!r}")
    return value


def _first_count(config: dict, keys: tuple) -> int:
    for key in keys:
        if key in config:
            return _count(config, key)
    raise FormatError(f"config.json:{keys[0]}", "missing: the architecture has routed experts")


def _sparse_layers(config: dict, kind: str, layers: int) -> set:
    """Indices of the layers whose MLP is routed experts."""
    if kind == "mixtral":
        return set(range(layers))
    if kind == "glm4_moe":
        first = config.get("first_k_dense_replace", 1)   # transformers' default
        return set(range(first if isinstance(first, int) else 1, layers))
    step = config.get("decoder_sparse_step", 1)
    dense = config.get("mlp_only_layers") or []
    step = step if isinstance(step, int) and step >= 1 else 1
    return {i for i in range(layers) if (i + 1) % step == 0 and i not in dense}


def _moe_layer(config: dict, kind: str, mlp: str) -> tuple:
    """(linear keys, router tensors) of one routed layer at `mlp` (e.g. model.layers.3.mlp)."""
    if kind == "mixtral":
        experts = _first_count(config, ("num_local_experts",))
        return [f"{mlp}.experts.{e}.{p}" for e in range(experts) for p in MIXTRAL_EXPERT], [f"{mlp}.gate.weight"]
    names = ("n_routed_experts",) if kind == "glm4_moe" else ("num_experts", "num_local_experts")
    experts = _first_count(config, names)
    linears = [f"{mlp}.experts.{e}.{p}" for e in range(experts) for p in GATED_MLP]
    tensors = [f"{mlp}.gate.weight"]
    if kind == "qwen2_moe" and config.get("shared_expert_intermediate_size", 1):
        linears += [f"{mlp}.shared_expert.{p}" for p in GATED_MLP]
        tensors.append(f"{mlp}.shared_expert_gate.weight")
    if kind == "glm4_moe":
        if config.get("n_shared_experts", 1):
            linears += [f"{mlp}.shared_experts.{p}" for p in GATED_MLP]
        tensors.append(f"{mlp}.gate.e_score_correction_bias")
    return linears, tensors


def expected(config: dict) -> Expected | None:
    """The linears and router tensors the config's architecture defines, or None for an unknown architecture."""
    kind = model_type(config)
    if kind is None:
        return None
    layers = _count(config, "num_hidden_layers")
    sparse = _sparse_layers(config, kind, layers) if kind in MOE else set()
    mlp_name = "block_sparse_moe" if kind == "mixtral" else "mlp"
    linears, tensors = [], []
    for i in range(layers):
        prefix = f"model.layers.{i}"
        linears += [f"{prefix}.self_attn.{p}" for p in ATTENTION]
        if i in sparse:
            more, routers = _moe_layer(config, kind, f"{prefix}.{mlp_name}")
            linears += more
            tensors += routers
        else:
            linears += [f"{prefix}.mlp.{p}" for p in GATED_MLP]
    if config.get("tie_word_embeddings") is not True:
        linears.append("lm_head")
    return Expected(kind, tuple(linears), tuple(tensors))
