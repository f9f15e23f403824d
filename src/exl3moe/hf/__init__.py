"""Hugging Face transformers models of EXL3 checkpoints on exl3moe's kernels (needs the `hf` extra).

`from_pretrained(path, ...)` builds the model; importing this package also registers the `exl3` quantizer,
so `transformers.AutoModelForCausalLM.from_pretrained(path)` loads EXL3 checkpoints the same way.
"""

from .loader import from_pretrained

__all__ = ["from_pretrained"]
