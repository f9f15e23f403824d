"""A Hugging Face bf16/fp16 checkpoint read one decoder layer at a time into transformers' own modules.

The model is built on the meta device; a layer's parameters are read from the safetensors (lazily, by name) only
when that layer is processed, so host memory holds one layer. Per-expert checkpoint tensors (`experts.<e>.gate_proj`
or Mixtral's `w1`/`w3`/`w2`) fill the fused `gate_up_proj` / `down_proj` parameters of transformers' expert modules.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..errors import FormatError
from ..format.hadamard import HAD
from ..hf.architectures import SHARED_GATE_CHILD, candidate_keys, check_supported, is_moe_block

EXPERT_ROLES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
ROUTER_CHILDREN = ("gate", SHARED_GATE_CHILD)   # kept in bf16, as exllamav3 keeps routers


def read_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FormatError(file, "missing: pass a Hugging Face checkpoint directory (config.json and *.safetensors)")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    if isinstance(config.get("quantization_config"), dict):
        raise FormatError("config.json:quantization_config", "the input is already quantized; convert a bf16/fp16 "
                          "checkpoint")
    check_supported(config)
    return config


class SafetensorsFolder:
    """Every tensor name of a checkpoint folder and the shard holding it; tensors read on request."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path, self._open, self._where = path, safe_open, {}
        shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not shards:
            raise FormatError(path, "holds no *.safetensors shard")
        for shard in shards:
            with safe_open(os.path.join(path, shard), "pt") as f:
                for key in f.keys():
                    self._where[key] = shard

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list:
        return list(self._where)

    def shape(self, key: str) -> list:
        with self._open(os.path.join(self.path, self._where[key]), "pt") as f:
            return list(f.get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise FormatError(key, f"missing from {self.path}: the architecture needs it")
        with self._open(os.path.join(self.path, self._where[key]), "pt") as f:
            return f.get_tensor(key)


def meta_causal_lm(config: dict) -> nn.Module:
    """The transformers causal LM of `config` on the meta device (sdpa attention: causal without a mask)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    hf_config = AutoConfig.for_model(config["model_type"], **rest)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")


class HFSource:
    """The input checkpoint: config, meta model, tensors; `layer(i, device)` materialises one decoder layer."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.config = read_config(self.path)
        self.model_type = self.config["model_type"]
        self.files = SafetensorsFolder(self.path)
        self.model = meta_causal_lm(self.config)
        self.layers = self.model.model.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def stored(self, name: str) -> str:
        """The checkpoint key of a module path (the transformers name, or the alias a converter kept)."""
        if not hasattr(self, "_known"):
            self._known = {".".join(k.split(".")[:i]) for k in self.files.keys() for i in range(1, k.count(".") + 2)}
        keys = candidate_keys(self.model_type, name)
        return next((k for k in keys if k in self._known), keys[-1])

    def expert_key(self, block_name: str, e: int, role: str) -> str:
        base = f"{self.stored(block_name)}.experts.{e}"
        return next((f"{base}.{n}.weight" for n in EXPERT_ROLES[role] if f"{base}.{n}.weight" in self.files),
                    f"{base}.{EXPERT_ROLES[role][0]}.weight")

    def tensor_for(self, module_name: str, leaf: str) -> torch.Tensor:
        """A parameter or buffer of the transformers module `module_name` read from the checkpoint."""
        module = self.model.get_submodule(module_name)
        if leaf in ("gate_up_proj", "down_proj") and module_name.endswith(".experts") and module_name + "." + leaf \
                not in self.files:
            block = module_name.rsplit(".", 1)[0]
            experts = getattr(module, leaf).shape[0]
            if leaf == "down_proj":
                return torch.stack([self.files.tensor(self.expert_key(block, e, "down")) for e in range(experts)])
            return torch.stack([torch.cat([self.files.tensor(self.expert_key(block, e, "gate")),
                                           self.files.tensor(self.expert_key(block, e, "up"))]) for e in range(experts)])
        return self.files.tensor(f"{self.stored(module_name)}.{leaf}" if module_name else leaf)

    def fill(self, module_name: str, device, dtype=torch.float32) -> nn.Module:
        """Materialise the module `module_name` (e.g. model.layers.3) with its checkpoint tensors on `device`."""
        module = self.model.get_submodule(module_name)
        module.to_empty(device=device)
        for sub_name, sub in module.named_modules():
            full = f"{module_name}.{sub_name}" if sub_name else module_name
            for leaf, param in list(sub._parameters.items()):
                if param is None:
                    continue
                value = self.tensor_for(full, leaf).to(device, dtype)
                if tuple(value.shape) != tuple(param.shape):
                    raise FormatError(f"{full}.{leaf}", f"stored shape {list(value.shape)}, the config defines "
                                      f"{list(param.shape)}")
                sub._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            for leaf in list(sub._buffers):
                if leaf in sub._non_persistent_buffers_set:
                    continue
                sub._buffers[leaf] = self.tensor_for(full, leaf).to(device, torch.float32)
        return module

    def release(self, module_name: str) -> None:
        """Return a module's tensors to the meta device (bounded host and GPU memory)."""
        self.model.get_submodule(module_name).to("meta")

    def rotary(self, device) -> nn.Module:
        rotary = self.model.model.rotary_emb
        return type(rotary)(rotary.config).to(device)

    def tied(self) -> bool:
        return bool(self.model.config.tie_word_embeddings)


def linear_modules(layer: nn.Module) -> dict:
    """{relative name: nn.Linear} of a decoder layer outside its routed-expert blocks."""
    blocks = [n for n, m in layer.named_modules() if is_moe_block(m)]
    routers = {f"{b}.{child}" for b in blocks for child in ROUTER_CHILDREN}
    return {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear) and n not in routers}


def moe_blocks(layer: nn.Module) -> dict:
    return {n: m for n, m in layer.named_modules() if is_moe_block(m)}


def check_source(source: HFSource) -> None:
    """Refusals before anything is written: every linear's dims multiples of 128, every tensor stored as a float."""
    for i in range(source.num_layers):
        layer = source.layers[i]
        prefix = f"model.layers.{i}"
        for name, m in linear_modules(layer).items():
            _check_dims(f"{source.stored(prefix + '.' + name)}.weight", m.in_features, m.out_features)
        for name, block in moe_blocks(layer).items():
            E, two_i, hidden = block.experts.gate_up_proj.shape
            _check_dims(f"{prefix}.{name}.experts", hidden, two_i // 2)
            for e in range(E):
                for role in EXPERT_ROLES:
                    key = source.expert_key(f"{prefix}.{name}", e, role)
                    if key not in source.files and f"{source.stored(prefix + '.' + name)}.experts.gate_up_proj" \
                            not in source.files:
                        raise FormatError(key, f"missing from {source.path}: the config defines {E} experts")
        for sub_name, sub in layer.named_modules():
            full = f"{prefix}.{sub_name}" if sub_name else prefix
            for leaf, p in sub._parameters.items():
                if p is not None and not (leaf in ("gate_up_proj", "down_proj") and full.endswith(".experts")):
                    key = f"{source.stored(full)}.{leaf}"
                    if key not in source.files:
                        raise FormatError(key, f"missing from {source.path}: the config defines it")
    head = source.model.get_output_embeddings()
    if not source.tied():
        _check_dims("lm_head.weight", head.in_features, head.out_features)
        if "lm_head.weight" not in source.files:
            raise FormatError("lm_head.weight", f"missing from {source.path} (tie_word_embeddings is false)")
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        if key not in source.files:
            raise FormatError(key, f"missing from {source.path}")


def _check_dims(name: str, k: int, n: int) -> None:
    if k % HAD or n % HAD:
        raise FormatError(name, f"in/out features {k}x{n}: EXL3 needs multiples of {HAD}")
