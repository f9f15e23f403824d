"""The `exl3` quantization method for transformers: AutoModelForCausalLM.from_pretrained on EXL3 checkpoints.

Registered through transformers' public hooks (register_quantization_config / register_quantizer). Before
transformers loads weights, the quantizer checks the model against the checkpoint's headers (the same plan as
exl3moe.hf.from_pretrained) and puts parameterless placeholders where EXL3 modules go; transformers then loads
embeddings, norms and other plain tensors as usual, and the quantizer finally builds EXL3Linear / EXL3MoE on
the device the embeddings landed on.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..errors import ContractError
from .loader import (ACTIVATION_DTYPES, DEFAULT_MAX_BATCH_TOKENS, check_materialised, finish, open_supported,
                     replace_quantized, set_module)
from .plan import plan_load

QUANT_METHOD = "exl3"


class Exl3Config(QuantizationConfigMixin):
    """config.json's quantization_config of an EXL3 checkpoint; every stored key is kept as an attribute."""

    def __init__(self, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, **kwargs):
        kwargs.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.max_batch_tokens = max_batch_tokens
        for key, value in kwargs.items():
            setattr(self, key, value)


class PendingEXL3(nn.Module):
    """Stands where an EXL3 module will be built once transformers has loaded the plain tensors."""

    def __init__(self, name: str):
        super().__init__()
        self.pending = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.pending}: the EXL3 module was never built (loading did not finish)")


class Exl3HfQuantizer(HfQuantizer):
    """Loads pre-quantized EXL3 checkpoints onto exl3moe's modules (no quantization, no serialization)."""

    requires_calibration = True

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.plan = None
        self.path = None

    def validate_environment(self, *args, device_map=None, **kwargs):
        if isinstance(device_map, dict) and len(set(map(str, device_map.values()))) > 1:
            raise ContractError("device_map", f"exl3moe runs a model on one device, got {sorted(set(map(str, device_map.values())))}")

    def update_dtype(self, dtype):
        return dtype if dtype in ACTIVATION_DTYPES else torch.float16

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files:
            raise ContractError("checkpoint_files", "the exl3 quantizer needs the checkpoint's safetensors files")
        self.path = os.path.dirname(os.path.abspath(checkpoint_files[0]))
        reader = open_supported(self.path)
        self.plan = plan_load(model, reader, reader.config["model_type"])
        stored = list(self.plan.linears.values()) + list(self.plan.moe_blocks.values())
        for name in self.plan.replaced:
            set_module(model, name, PendingEXL3(name))
        ignored = set(model._keys_to_ignore_on_load_unexpected or ())
        model._keys_to_ignore_on_load_unexpected = ignored | {rf"^{re.escape(key)}\." for key in stored}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        device = model.get_input_embeddings().weight.device
        max_batch_tokens = getattr(self.quantization_config, "max_batch_tokens", DEFAULT_MAX_BATCH_TOKENS)
        replace_quantized(model, self.plan, device, max_batch_tokens)
        check_materialised(model)
        finish(model, self.path, device, cuda_graphs=True)
        return model

    def is_serializable(self, *args, **kwargs):
        return False

    @property
    def is_trainable(self):
        return False

    @property
    def is_compileable(self):
        return True


def register() -> None:
    """Register `exl3` with transformers once (a method transformers itself already defines is left alone)."""
    if QUANT_METHOD in AUTO_QUANTIZER_MAPPING:
        return
    register_quantization_config(QUANT_METHOD)(Exl3Config)
    register_quantizer(QUANT_METHOD)(Exl3HfQuantizer)
