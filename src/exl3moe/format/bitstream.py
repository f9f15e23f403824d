"""The tile ring: int16 trellis words <-> 16-bit states, and the 16x16 tile permutation."""

from functools import lru_cache

import torch

from ..errors import FormatError

TILE = 16
TILE_WEIGHTS = 256
INTEGER_K = (1, 2, 3, 4, 5, 6, 7, 8)
HALF_K = (1.5, 2.5, 3.5)
_CHUNK_TILES = 1 << 14


def k_from_last_dim(last_dim: int, name: str = "trellis") -> float:
    """Bits per weight implied by a trellis last dimension (16K, or 16K for K = 1.5, 2.5, 3.5)."""
    if last_dim % 16 == 0 and 1 <= last_dim // 16 <= 8:
        return last_dim // 16
    if last_dim in (24, 40, 56):
        return last_dim / 16
    raise FormatError(name, f"last dim must be 16*K for K in 1..8 or 24/40/56 for K = 1.5/2.5/3.5, got {last_dim}")


def check_k(K: float, name: str = "K") -> int:
    """Validate K and return it in half-bit units (2K)."""
    k2 = K * 2
    if k2 != int(k2) or not (K in INTEGER_K or K in HALF_K):
        raise FormatError(name, f"K must be an integer 1..8 or one of 1.5, 2.5, 3.5, got {K}")
    return int(k2)


def words_per_tile(K: float) -> int:
    """int16 elements per tile: 256 weights x K bits / 16."""
    return check_k(K) * 8


@lru_cache(maxsize=None)
def state_ends(k2: int) -> tuple:
    """S(p) = floor((p + 1) * K): the ring bit after position p's last bit."""
    return tuple(((p + 1) * k2) >> 1 for p in range(TILE_WEIGHTS))


@lru_cache(maxsize=None)
def _window_tables(k2: int):
    ring = TILE_WEIGHTS * k2 // 2
    nwords = ring // 32
    ends = torch.tensor(state_ends(k2), dtype=torch.int64) + ring
    last = (ends - 1) >> 5
    shift = 32 * (last + 1) - ends
    return (last - 1) % nwords, last % nwords, shift


def _as_u32_words(trellis: torch.Tensor) -> torch.Tensor:
    t = trellis.to(torch.int64) & 0xFFFF
    return t[..., 0::2] | (t[..., 1::2] << 16)


def unpack_states(trellis: torch.Tensor, K: float) -> torch.Tensor:
    """int16 [..., 16K] -> int32 [..., 256] states in packed order (tail-biting ring windows)."""
    k2 = check_k(K)
    if trellis.shape[-1] != k2 * 8:
        raise FormatError("trellis", f"last dim {trellis.shape[-1]} does not match K={K} (expects {k2 * 8})")
    lead = trellis.shape[:-1]
    flat = trellis.reshape(-1, trellis.shape[-1])
    prev_idx, last_idx, shift = (x.to(trellis.device) for x in _window_tables(k2))
    out = torch.empty(flat.shape[0], TILE_WEIGHTS, dtype=torch.int32, device=trellis.device)
    for start in range(0, flat.shape[0], _CHUNK_TILES):
        words = _as_u32_words(flat[start:start + _CHUNK_TILES])
        window = (words[:, prev_idx] << 32) | words[:, last_idx]
        out[start:start + _CHUNK_TILES] = ((window >> shift) & 0xFFFF).to(torch.int32)
    return out.reshape(*lead, TILE_WEIGHTS)


@lru_cache(maxsize=None)
def _ring_tables(k2: int):
    ends = state_ends(k2)
    owner, shift = [], []
    start = 0
    for p, end in enumerate(ends):
        for b in range(start, end):
            owner.append(p)
            shift.append(end - 1 - b)
        start = end
    return torch.tensor(owner, dtype=torch.int64), torch.tensor(shift, dtype=torch.int64)


def pack_states(states: torch.Tensor, K: float) -> torch.Tensor:
    """[..., 256] states (or D(p)-bit symbols) in packed order -> int16 [..., 16K] trellis.

    Only the low D(p) bits of each state are stored, as the format does.
    """
    k2 = check_k(K)
    if states.shape[-1] != TILE_WEIGHTS:
        raise FormatError("states", f"last dim must be 256, got {states.shape[-1]}")
    owner, shift = (x.to(states.device) for x in _ring_tables(k2))
    lead = states.shape[:-1]
    s = states.reshape(-1, TILE_WEIGHTS).to(torch.int64)
    bits = (s[:, owner] >> shift) & 1
    weights = torch.tensor([1 << (31 - i) for i in range(32)], dtype=torch.int64, device=states.device)
    words = (bits.reshape(s.shape[0], -1, 32) * weights).sum(-1)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).reshape(s.shape[0], -1)
    halves = halves - ((halves & 0x8000) << 1)
    return halves.to(torch.int16).reshape(*lead, k2 * 8)


@lru_cache(maxsize=None)
def _perm_cpu() -> torch.Tensor:
    rows, cols = [], []
    for p in range(TILE_WEIGHTS):
        lane, j = p >> 3, p & 7
        rows.append(2 * (lane % 4) + (j & 1) + 8 * ((j >> 1) & 1))
        cols.append((lane >> 2) + 8 * (j >> 2))
    flat = torch.empty(TILE_WEIGHTS, dtype=torch.int64)
    flat[torch.tensor(rows) * TILE + torch.tensor(cols)] = torch.arange(TILE_WEIGHTS)
    return flat


def tile_permutation(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [256]: entry r*16 + c is the packed position p of tile element (row r, col c)."""
    return _perm_cpu().to(device)


def tiles_to_matrix(values: torch.Tensor) -> torch.Tensor:
    """[k/16, n/16, 256] values in packed order -> [k, n] row-major matrix."""
    tk, tn, _ = values.shape
    perm = tile_permutation(values.device)
    tiles = values[..., perm].reshape(tk, tn, TILE, TILE)
    return tiles.permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def matrix_to_tiles(matrix: torch.Tensor) -> torch.Tensor:
    """[k, n] row-major matrix -> [k/16, n/16, 256] in packed order (inverse of tiles_to_matrix)."""
    k, n = matrix.shape
    tiles = matrix.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(k // TILE, n // TILE, -1)
    out = torch.empty_like(tiles)
    out[..., tile_permutation(matrix.device)] = tiles
    return out
