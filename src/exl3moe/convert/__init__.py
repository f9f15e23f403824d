"""Model conversion (docs/convert.md): `quantize_model` (Hugging Face -> EXL3, per-expert widths) and
`make_stages` (residual stages of a target model on an EXL3 base)."""

from .allocate import allocate_widths, relative_error, widths_for
from .quantize import ConvertReport, quantize_model

__all__ = ["ConvertReport", "allocate_widths", "quantize_model", "relative_error", "widths_for"]
