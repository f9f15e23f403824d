"""Float64 oracles every kernel is tested against: linear, routed MoE, route packing."""

from .linear import linear
from .moe import moe
from .route_pack import RoutePack, route_pack_reference

__all__ = ["RoutePack", "linear", "moe", "route_pack_reference"]
