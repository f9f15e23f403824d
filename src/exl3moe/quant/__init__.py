"""The EXL3 encoder: rotation, LDLQ and the exact tail-biting Viterbi search (docs/quant.md)."""

from .encoder import QuantStats, proxy_error, quantize_weight, quantize_weights
from .ring_search import RingResult, search_ring
from .tiles import quantize_tiles, tile_ring
from .trellis import Ring, format_ring

__all__ = ["QuantStats", "Ring", "RingResult", "format_ring", "proxy_error", "quantize_tiles", "quantize_weight",
           "quantize_weights", "search_ring", "tile_ring"]
