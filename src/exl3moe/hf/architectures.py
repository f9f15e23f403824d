"""The transformers architectures exl3moe runs, and where each keeps its weights in an EXL3 checkpoint."""

from __future__ import annotations

from ..errors import FormatError

# model_type -> (module path part, checkpoint name it may be stored under): original names kept by converters.
CHECKPOINT_ALIASES = {
    "qwen3_moe": (), "qwen2_moe": (), "glm4_moe": (), "llama": (), "qwen3": (),
    "mixtral": (("mlp", "block_sparse_moe"),),
}
SUPPORTED = tuple(CHECKPOINT_ALIASES)
SHARED_EXPERT_CHILDREN = ("shared_expert", "shared_experts")
SHARED_GATE_CHILD = "shared_expert_gate"


def check_supported(config: dict) -> str:
    """The checkpoint's model_type if exl3moe runs it; FormatError naming the architecture otherwise."""
    model_type = config.get("model_type")
    if model_type not in CHECKPOINT_ALIASES:
        names = ", ".join(map(str, config.get("architectures") or [])) or "no architectures entry"
        raise FormatError("config.json:model_type", f"architecture {model_type!r} ({names}) is not supported; "
                          f"exl3moe.hf runs {', '.join(SUPPORTED)}")
    return model_type


def is_moe_block(module) -> bool:
    """A routed-expert block of the transformers model: a router `gate` and an `experts` collection."""
    return hasattr(module, "experts") and hasattr(module, "gate") and not hasattr(module, "in_features")


def candidate_keys(model_type: str, name: str) -> list:
    """Checkpoint names a module path may be stored under, the transformers name first."""
    keys = [name]
    parts = name.split(".")
    for ours, stored in CHECKPOINT_ALIASES[model_type]:
        if ours in parts:
            keys.append(".".join(stored if p == ours else p for p in parts))
    return keys
