"""quantize_weight(s): float weights [in, out] and their input Hessians -> EXL3Weights and the proxy error.

Several weights of one shape (the experts of a layer) are encoded together: every LDLQ strip is searched for all of
them in one batch of tiles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ContractError
from ..format.bitstream import pack_states
from ..format.hadamard import hadamard_blockwise
from ..format.weight import EXL3Weight
from .checks import check_call
from .ldlq import block_ldl, ldlq, refine
from .phases import phase, sync_requested, timing
from .refit import refit_scales
from .rotation import (divide_channels, input_scales, left_hadamard, output_scales, rotate, rotated_hessian,
                       to_fp16_scale)
from .scale_search import global_scales
from .tiles import tile_ring

DAMP = 0.025          # H + DAMP x mean(diag H) x I before the LDL (the proxy error uses H undamped)
SCALE_TILES = 64      # tiles of each weight the global scale search quantizes at each trial scale
CHANNEL_POWER = 0.5   # channel scale magnitudes (RMS^2 / relative diag H)^(power/2), docs/quant.md


@dataclass
class QuantStats:
    proxy_error: float          # trace(E^T H E) / trace(W^T H W), E = decoded W - W
    seconds: float              # wall time of the call (for a batch: of the whole batch)
    K: float
    codebook: str
    global_scale: float = 1.0
    hessian_shift: float = 0.0  # added to the diagonal to make H positive semidefinite
    counters: dict = field(default_factory=dict)
    inner: torch.Tensor | None = None  # with keep_inner: the searched W_inner (fp16 [in, out]) that decode must give
    kept_init: bool = False            # init was returned: the new encoding was not better
    phase_seconds: dict = field(default_factory=dict)  # exclusive seconds per phase (quant/phases.py), whole call
    part_seconds: dict = field(default_factory=dict)   # inclusive seconds of the trellis passes and tracebacks


@dataclass
class _Job:
    """One weight on its way through the encoder (float64 on the compute device)."""
    W: torch.Tensor
    H: torch.Tensor | None
    shift: float
    init: EXL3Weight | None
    su: torch.Tensor | None = None
    sv: torch.Tensor | None = None
    g: float = 1.0
    H_r: torch.Tensor | None = None


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


def quantize_weight(W: torch.Tensor, H: torch.Tensor | None = None, K: float = 4, codebook: str = "mcg",
                    seed: int = 0, device=None, *, init: EXL3Weight | None = None, name: str = "weight",
                    **options) -> tuple[EXL3Weight, QuantStats]:
    """Encode W [in, out] as EXL3 at K bits per weight with `codebook`, minimising trace(E^T H E).

    H is the input Hessian X^T X / rows ([in, in]; None: identity). `init` (an EXL3Weight of the same shape, K and
    codebook) reuses its scales and is returned instead when the new encoding is not better. Options: see
    quantize_weights.
    """
    return quantize_weights([W], [H], K, codebook, seed, device, inits=[init], names=[name], **options)[0]


def quantize_weights(Ws: list, Hs: list | None = None, K: float = 4, codebook: str = "mcg", seed: int = 0,
                     device=None, *, inits: list | None = None, names: list | None = None, damp: float = DAMP,
                     scale: float | None = None, scale_tiles: int = SCALE_TILES, out_scales: bool = True,
                     channel_power: float = CHANNEL_POWER, exact: bool = True, refit: bool = True, sweeps: int = 0,
                     keep_inner: bool = False,
                     sync_phases: bool | None = None) -> list[tuple[EXL3Weight, QuantStats]]:
    """Encode weights of one shape together (each with its own Hessian, scales and seed seed + index).

    damp: the LDL factors H + damp x mean(diag H) x I. scale: a fixed global scale instead of the search on
    `scale_tiles` tiles per weight. channel_power: channel scales (RMS^2 / relative diag H)^(power/2) (docs/quant.md);
    out_scales=False: output channels get signs only.
    exact=False skips the search of other seams. refit: the channel scales re-solved for the final trellis (kept when
    better). sweeps: block coordinate descent sweeps after LDLQ. keep_inner: the searched W_inner kept in the stats.
    sync_phases: synchronise the device at phase boundaries so that stats.phase_seconds charges GPU time to its
    phase (None: EXL3MOE_QUANT_SYNC_PHASES=1 asks for it).
    """
    start = time.perf_counter()
    with timing(sync_requested() if sync_phases is None else sync_phases) as timer:
        out = _encode(timer, Ws, Hs, K, codebook, seed, device, inits, names, damp, scale, scale_tiles, out_scales,
                      channel_power, exact, refit, sweeps, keep_inner)
    seconds = time.perf_counter() - start
    for pair in out:
        pair[1].seconds = seconds
        pair[1].phase_seconds = dict(timer.seconds)
        pair[1].part_seconds = dict(timer.parts)
        pair[1].counters.update(timer.counts)
    return [tuple(pair) for pair in out]


def _encode(timer, Ws, Hs, K, codebook, seed, device, inits, names, damp, scale, scale_tiles, out_scales,
            channel_power, exact, refit, sweeps, keep_inner) -> list:
    with phase("checks"):
        dev, hessians, inits = check_call(Ws, Hs, inits, K, codebook, device, damp, scale, scale_tiles, sweeps,
                                          channel_power)
        names = [f"weight{i}" for i in range(len(Ws))] if names is None else names
        if len(names) != len(Ws):
            raise ContractError("names", f"must name each of the {len(Ws)} weights, got {len(names)} names")
    timer.device = dev
    jobs = [_Job(W.to(dev, torch.float64), H64, shift, init) for W, (H64, shift), init in zip(Ws, hessians, inits)]
    ring = tile_ring(K, codebook, dev)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(jobs))]
    _choose_scales(ring, jobs, generators, out_scales, channel_power, scale, scale_tiles)
    with phase("scales"):
        W_r = torch.stack([rotate(job.W, job.su, job.sv) for job in jobs])
    with phase("hessian"):
        for job in jobs:
            if job.H is not None:
                ridge = damp * float(job.H.diagonal().mean())
                eye = torch.eye(job.H.shape[0], dtype=job.H.dtype, device=dev)
                job.H_r = rotated_hessian(job.H + ridge * eye, job.su)
        weighted = any(job.H is not None for job in jobs)
        L = torch.stack([_ldl_or_zeros(job.H_r, W_r) for job in jobs]) if weighted else None
    with phase("ldlq"):
        states, Q, counters = ldlq(ring, W_r, L, exact)
    if weighted and sweeps:
        with phase("refine"):
            H_r = torch.stack([_or_identity(j.H_r, W_r) for j in jobs])
            counters["refined_strips"] = sum(refine(ring, W_r, Q, states, H_r, exact) for _ in range(sweeps))
    out = []
    for job, st, inner, name in zip(jobs, states, Q, names):
        with phase("pack"):
            packed = pack_states(st, K)
        weight, error, kept, gain = _finish(job, packed, inner, codebook, refit, name)
        out.append([weight, QuantStats(error, 0.0, K, codebook, job.g, job.shift, dict(counters, refit_gain=gain),
                                       inner.to(torch.float16) if keep_inner else None, kept)])
    return out


def _ldl_or_zeros(H_r: torch.Tensor | None, W_r: torch.Tensor) -> torch.Tensor:
    """The LDL factor of H_r, or zeros (no feedback) for a weight without a Hessian."""
    k = W_r.shape[1]
    return torch.zeros(k, k, dtype=W_r.dtype, device=W_r.device) if H_r is None else block_ldl(H_r)


def _or_identity(H: torch.Tensor | None, W_r: torch.Tensor) -> torch.Tensor:
    k = W_r.shape[1]
    return torch.eye(k, dtype=W_r.dtype, device=W_r.device) if H is None else H


def _choose_scales(ring, jobs, generators, out_scales, channel_power, scale, scale_tiles) -> None:
    """su, sv and g of every job: from init, or random signs x (RMS^2 / diag H)^(p/2) and the global scale search."""
    fresh = [(job, gen) for job, gen in zip(jobs, generators) if job.init is None]
    for job in jobs:
        if job.init is not None:
            job.su, job.sv = job.init.suh.to(job.W.device), job.init.svh.to(job.W.device)
    su0 = []
    with phase("scales"):
        for job, gen in fresh:
            job.sv = output_scales(job.W, gen, channel_power if out_scales else 0.0)
            su0.append(input_scales(hadamard_blockwise(divide_channels(job.W, job.sv, 1)), job.H, gen,
                                    channel_power))
    if scale is None and fresh:
        with phase("scale_search"):
            gs = global_scales(ring, [rotate(job.W, s, job.sv) for (job, _), s in zip(fresh, su0)], scale_tiles,
                               [gen for _, gen in fresh])
    else:
        gs = [scale] * len(fresh)
    for (job, _), s, g in zip(fresh, su0, gs):
        job.g, job.su = g, to_fp16_scale(s / g)


def _finish(job: _Job, trellis: torch.Tensor, Q: torch.Tensor, codebook: str, refit: bool, name: str):
    """(weight, proxy error, init kept, refit gain): the encoding, its refit when better, init when not worse."""
    weight = EXL3Weight(trellis, job.su, job.sv, codebook, None, name)
    with phase("proxy_error"):
        error = proxy_error(job.W, weight.dense(torch.float64), job.H)
    gain = 1.0
    if refit:
        with phase("refit"):
            su, sv = refit_scales(hadamard_blockwise(left_hadamard(Q)), job.su, job.sv, job.W, job.H)
            refitted = EXL3Weight(trellis, to_fp16_scale(su), to_fp16_scale(sv), codebook, None, name)
        with phase("proxy_error"):
            refit_error = proxy_error(job.W, refitted.dense(torch.float64), job.H)
        gain = error / refit_error if refit_error > 0 else float("inf")
        if refit_error < error:
            weight, error = refitted, refit_error
    if job.init is not None:
        init = job.init.to(job.W.device)
        with phase("proxy_error"):
            init_error = proxy_error(job.W, init.dense(torch.float64), job.H)
        if init_error <= error:
            return init, init_error, True, gain
    return weight, error, False, gain
