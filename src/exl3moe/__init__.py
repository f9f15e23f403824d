"""exl3moe: EXL3 (QTIP trellis) linear and routed-MoE layers for NVIDIA GPUs, with float64 oracles."""

from .errors import ContractError, FormatError
from .format import EXL3Weight, ExpertSet, ResidualStage, decode, open_checkpoint

__version__ = "0.1.0"
__all__ = ["ContractError", "EXL3Weight", "ExpertSet", "FormatError", "ResidualStage", "decode", "open_checkpoint",
           "__version__"]
