"""quantize_weight: a float weight [in, out] and its input Hessian -> an EXL3Weight and the proxy error."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ContractError
from ..format.bitstream import pack_states
from ..format.hadamard import hadamard_blockwise
from ..format.weight import EXL3Weight
from .checks import check_hessian, check_rate, check_weight, resolve_device, symmetric_psd_hessian
from .ldlq import block_ldl, ldlq
from .refit import refit_scales
from .rotation import (channel_rms, divide_channels, left_hadamard, output_scales, random_signs, rotate,
                       rotated_hessian, to_fp16_scale)
from .scale_search import global_scale
from .tiles import tile_ring

DAMP = 0.025          # H + DAMP x mean(diag H) x I before the LDL (the proxy error uses H undamped)
SCALE_TILES = 64      # tiles the global scale search quantizes at each trial scale


@dataclass
class QuantStats:
    proxy_error: float          # trace(E^T H E) / trace(W^T H W), E = decoded W - W
    seconds: float
    K: float
    codebook: str
    global_scale: float = 1.0
    hessian_shift: float = 0.0  # added to the diagonal to make H positive semidefinite
    counters: dict = field(default_factory=dict)
    inner: torch.Tensor | None = None  # with keep_inner: the searched W_inner (fp16 [in, out]) that decode must give
    kept_init: bool = False            # init was returned: the new encoding was not better


def proxy_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor | None) -> float:
    """trace(E^T H E) / trace(W^T H W) in float64 (H None: the identity); 0 when W and E are both zero."""
    E = W_hat - W
    if H is None:
        num, den = float(E.square().sum()), float(W.square().sum())
    else:
        num, den = float((E * (H @ E)).sum()), float((W * (H @ W)).sum())
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


def _check_init(init, W: torch.Tensor, K: float, codebook: str) -> None:
    if init is None:
        return
    if not isinstance(init, EXL3Weight):
        raise ContractError("init", f"must be an EXL3Weight or None, got {type(init).__name__}")
    if (init.in_features, init.out_features) != tuple(W.shape) or init.K != K or init.codebook != codebook:
        raise ContractError("init", f"is [{init.in_features}, {init.out_features}] K={init.K} {init.codebook}; "
                                    f"W is {list(W.shape)} and the call asks K={K} {codebook}")


def quantize_weight(W: torch.Tensor, H: torch.Tensor | None = None, K: float = 4, codebook: str = "mcg",
                    seed: int = 0, device=None, *, damp: float = DAMP, init: EXL3Weight | None = None,
                    scale: float | None = None, scale_tiles: int = SCALE_TILES, out_scales: bool = True,
                    exact: bool = True, refit: bool = True, keep_inner: bool = False,
                    name: str = "weight") -> tuple[EXL3Weight, QuantStats]:
    """Encode W [in, out] as EXL3 at K bits per weight with `codebook`, minimising trace(E^T H E).

    H is the input Hessian X^T X / rows ([in, in]; None: identity). `init` (an EXL3Weight of the same shape, K and
    codebook) reuses its scales and is returned instead when the new encoding is not better. `scale` fixes the
    global scale instead of searching it on `scale_tiles` tiles. exact=False skips the search of other seams.
    refit re-solves the channel scales for the final trellis (kept when better). keep_inner keeps the searched
    W_inner in the stats.
    """
    check_rate(K, codebook)
    check_weight(W)
    if H is not None:
        check_hessian(H, W.shape[0])
    _check_init(init, W, K, codebook)
    if not (isinstance(damp, (int, float)) and damp >= 0):
        raise ContractError("damp", f"must be a number >= 0, got {damp!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise ContractError("scale", f"must be a positive finite number or None, got {scale!r}")
    dev = resolve_device(device, W)
    start = time.perf_counter()
    W64 = W.to(dev, torch.float64)
    H64, shift = (None, 0.0) if H is None else symmetric_psd_hessian(H.to(dev))
    ring = tile_ring(K, codebook, dev)
    generator = torch.Generator().manual_seed(seed)

    if init is not None:
        su, sv, g = init.suh.to(dev), init.svh.to(dev), 1.0
    else:
        sv = output_scales(W64, generator, out_scales)
        inner = divide_channels(W64, sv, 1)
        rows = channel_rms(hadamard_blockwise(inner), 1)
        su0 = random_signs(W64.shape[0], generator, dev) * torch.where(rows > 0, rows, 0.0)
        g = scale if scale is not None else global_scale(ring, rotate(W64, su0, sv), scale_tiles, generator)
        su = to_fp16_scale(su0 / g)
    W_r = rotate(W64, su, sv)
    L = None
    if H64 is not None:
        H_r = rotated_hessian(H64 + damp * float(H64.diagonal().mean()) * torch.eye(
            H64.shape[0], dtype=torch.float64, device=dev), su)
        L = block_ldl(H_r)
    states, Q, counters = ldlq(ring, W_r, L, exact)
    trellis = pack_states(states, K)
    weight = EXL3Weight(trellis, su, sv, codebook, None, name)
    error = proxy_error(W64, weight.dense(torch.float64), H64)
    if refit:
        A = hadamard_blockwise(left_hadamard(Q))
        su_f, sv_f = refit_scales(A, su, sv, W64, H64)
        refitted = EXL3Weight(trellis, to_fp16_scale(su_f), to_fp16_scale(sv_f), codebook, None, name)
        refit_error = proxy_error(W64, refitted.dense(torch.float64), H64)
        counters["refit_gain"] = error / refit_error if refit_error > 0 else float("inf")
        if refit_error < error:
            weight, error = refitted, refit_error
    kept_init = False
    if init is not None:
        init_error = proxy_error(W64, init.to(dev).dense(torch.float64), H64)
        if init_error <= error:
            weight, error, kept_init = init.to(dev), init_error, True
    stats = QuantStats(error, time.perf_counter() - start, K, codebook, g, shift, counters,
                       Q.to(torch.float16) if keep_inner else None, kept_init)
    return weight, stats
