"""Hugging Face transformers models of EXL3 checkpoints on exl3moe's kernels (needs the `hf` extra).

`from_pretrained(path, ...)` builds the model; importing this package also registers the `exl3` quantizer,
so `transformers.AutoModelForCausalLM.from_pretrained(path)` loads EXL3 checkpoints the same way.
"""

from .dense import dense_model
from .graphs import install_decode_graphs
from .loader import from_pretrained
from .quantizer import Exl3Config, Exl3HfQuantizer, register

register()

__all__ = ["Exl3Config", "Exl3HfQuantizer", "dense_model", "from_pretrained", "install_decode_graphs"]
