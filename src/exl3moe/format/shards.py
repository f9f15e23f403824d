"""How `count` whole units (128-wide blocks, experts) divide among `world` ranks: contiguous, in rank order, the first
`count % world` ranks holding one more; a world that leaves a rank with none is refused."""

from __future__ import annotations

from ..errors import ContractError


def _check_int(value, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ContractError(name, f"must be an int in {low}..{high}, got {value!r}")


def shard_ranges(count: int, world: int, name: str, unit: str) -> list:
    """[(first, stop)] of every rank."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ContractError("world", f"must be a positive int, got {world!r}")
    if world > count:
        raise ContractError(name, f"has {count} {unit}: a world of {world} leaves a rank with none")
    base, extra = divmod(count, world)
    return [(r * base + min(r, extra), (r + 1) * base + min(r + 1, extra)) for r in range(world)]


def shard_range(count: int, rank: int, world: int, name: str, unit: str) -> tuple:
    """(first, stop) of rank `rank`."""
    ranges = shard_ranges(count, world, name, unit)
    _check_int(rank, "rank", 0, world - 1)
    return ranges[rank]
