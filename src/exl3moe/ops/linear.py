"""EXL3 linear: validate -> plan -> bind -> run. `run` allocates nothing and never syncs with the host."""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch

from ..errors import ContractError
from ..format.hadamard import hadamard_blockwise_by_rows
from ..format.weight import EXL3Weight
from ..kernels import nvrtc
from ..kernels.hadamard import hadamard128
from ..kernels.row_scale import row_scales, row_scales_torch
from ..kernels.trellis_decode import interpreting, trellis_decode
from ..kernels.trellis_matmul import trellis_epilogue, trellis_matmul
from ..kernels.split_gemm import split_ordered_gemm, warm_split_gemm
from ..kernels.trellis_dense import decode_dense, dense_epilogue, dense_kernel
from ..kernels.trellis_mma import counter_count, reduce_kernel, rotate_kernel
from ..kernels.trellis_ws import ws_kernel
from .linear_cuda import call_kernel, rotate_input, trellis_mma
from .linear_planning import (PROMPT_WS_MAX_ROWS, fuses_rotation, late_rotation, linear_chains, plan_mma,
                              prefetch_for, prompt_on_ws, uses_ws, variant_for, ws_defers_reduce, ws_paired, ws_x_tma)
from .contracts import check_packed, check_workspace
from .rowwise import matmul_by_rows
from .workspaces import workspace_for

MAX_FUSED_ROWS = 128
INPUT_DTYPES = (torch.float16, torch.bfloat16)
OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TARGET_PROGRAMS = 1024  # enough programs in flight to hide load latency; a constant, so device-independent
_ALIGN = 256


@dataclass(frozen=True)
class LinearTiles:
    """Tile shape of the fused path; depends on (k, n, K) only, so a row's bytes never depend on the batch."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 3


def plan_tiles(k: int, n: int, K: float, block_n: int = 128, block_k: int = 64) -> LinearTiles:
    """Split k so that (n / block_n) x splits programs fill the GPU; no split is ever empty."""
    chunks = k // block_k
    splits = max(1, min(chunks, -(-TARGET_PROGRAMS // (n // block_n))))
    per_split = -(-chunks // splits)
    return LinearTiles(block_n, block_k, -(-chunks // per_split))


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


MIN_BLOCK_ROWS = 64  # one MMA instruction kind (Hopper wgmma, m64) for every row count: same row bytes at any batch


def block_rows(rows: int) -> int:
    """BM of the fused path: the next power of two >= rows, at least MIN_BLOCK_ROWS."""
    bm = MIN_BLOCK_ROWS
    while bm < rows:
        bm *= 2
    return bm


def check_weight(w: EXL3Weight) -> tuple:
    """Validate w for the linear ops (its format rules again where it changed since: format/frozen.py); returns its
    fingerprint, which a plan keeps to notice a weight changed after it was made."""
    if not isinstance(w, EXL3Weight):
        raise ContractError("w", f"must be an EXL3Weight, got {type(w).__name__}")
    key = w.ensure_valid()
    for name in ("trellis", "suh", "svh") + (("bias",) if w.bias is not None else ()):
        if not getattr(w, name).is_contiguous():
            raise ContractError(f"{w.name}.{name}", "must be contiguous")
    if w.trellis.data_ptr() % 4:
        raise ContractError(f"{w.name}.trellis", "data must be 4-byte aligned (kernels read int32 words)")
    return key


def check_input(x: torch.Tensor, w: EXL3Weight, name: str = "x") -> torch.Tensor:
    """Validate x [..., k] and return its 2-D view [rows, k]."""
    if not isinstance(x, torch.Tensor):
        raise ContractError(name, f"must be a tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ContractError(name, f"dtype must be float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != w.in_features:
        raise ContractError(name, f"last dim must be in_features = {w.in_features}, got shape {list(x.shape)}")
    if x.device != w.device:
        raise ContractError(name, f"is on {x.device}, the weight is on {w.device}")
    try:
        x2 = x.view(-1, w.in_features)
    except RuntimeError:
        raise ContractError(name, "must be viewable as [rows, k] with contiguous rows") from None
    if x2.stride(1) != 1:
        raise ContractError(name, f"must be viewable as [rows, k] with contiguous rows (last-dim stride 1, got "
                                  f"{x2.stride(1)})")
    return x2


def check_output(out: torch.Tensor, rows: int, w: EXL3Weight, lead: tuple, name: str = "out") -> torch.Tensor:
    """Validate out [..., n] and return its 2-D view [rows, n]."""
    if not isinstance(out, torch.Tensor):
        raise ContractError(name, f"must be a tensor, got {type(out).__name__}")
    if out.dtype not in OUTPUT_DTYPES:
        raise ContractError(name, f"dtype must be float16, bfloat16 or float32, got {out.dtype}")
    want = list(lead) + [w.out_features]
    if out.dim() == 0 or out.shape[-1] != w.out_features:
        raise ContractError(name, f"shape must be {want}: last dim must be out_features = {w.out_features}, got "
                            f"{list(out.shape)}")
    if tuple(out.shape[:-1]) != tuple(lead):
        raise ContractError(name, f"shape must be {want}: leading dims (the row count) must be x's {list(lead)}, "
                            f"got {list(out.shape)}")
    if out.device != w.device:
        raise ContractError(name, f"is on {out.device}, the weight is on {w.device}")
    check_packed(out, name)
    return out.view(rows, w.out_features)


def _carve(workspace: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> tuple:
    size = numel * torch.empty((), dtype=dtype).element_size()
    view = workspace[offset:offset + size].view(dtype)
    return view, offset + -(-size // _ALIGN) * _ALIGN


class LinearPlan:
    """Everything a call needs decided ahead: tiles, paths, workspace size for up to `max_rows` rows."""

    def __init__(self, w: EXL3Weight, max_rows: int, tiles: LinearTiles | None = None):
        self.weight_key = check_weight(w)
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ContractError("max_rows", f"must be a positive int, got {max_rows!r}")
        if tiles is not None and not isinstance(tiles, LinearTiles):
            raise ContractError("tiles", f"must be a LinearTiles or None, got {type(tiles).__name__}")
        self.weight = w
        self.max_rows = max_rows
        self.tiles = tiles or plan_tiles(w.in_features, w.out_features, w.K)
        self.dense_path = max_rows > MAX_FUSED_ROWS
        k, n = w.in_features, w.out_features
        # CUDA C++ fused path where it can run (compiled here, before any capture); Triton otherwise.
        self.mma = plan_mma(k, n) if nvrtc.available(w.device) else None
        if self.mma is not None:
            fused_rows = range(1, min(max_rows, MAX_FUSED_ROWS) + 1)
            for mt, fuse_in, prefetch in {variant_for(rows, k, n) + (prefetch_for(rows, k, n, w.K, self.mma),)
                                          for rows in fused_rows}:
                call_kernel(w, mt, fuse_in, prefetch, self.mma, w.device)
            prompt_ws = self.dense_path and prompt_on_ws(min(max_rows, PROMPT_WS_MAX_ROWS), k, n, self.mma.splits,
                                                         w.device)
            rotated_ws = any(uses_ws(rows, k, n, w.device) and not fuses_rotation(rows, k, n) for rows in fused_rows)
            if prompt_ws or rotated_ws:
                sms = nvrtc.sm_count(w.device)
                defer = ws_defers_reduce(self.mma.splits, n, sms)
                ws_kernel(w.K, w.codebook, w.device, ws_x_tma(k, n, w.K, w.codebook),
                          ws_paired(k, n, self.mma.splits, sms), defer)
                if defer:
                    reduce_kernel(w.device, linear_chains(MAX_FUSED_ROWS, w.device))   # ws rows are 32..128
            for chain, late in {(linear_chains(rows, w.device), late_rotation(rows)) for rows in fused_rows
                                if not fuses_rotation(rows, k, n)}:
                rotate_kernel(w.device, chain, chain and late)
            if self.dense_path:
                dense_kernel(w.K, w.codebook, w.device)
                dense_kernel(w.K, w.codebook, w.device, "dense_epilogue")
                rotate_kernel(w.device)
                warm_split_gemm(k, n, self.mma.ktiles_per_split * 16, w.device)
        splits = max(self.tiles.splits, self.mma.splits if self.mma is not None else 1)
        partials = splits * min(max_rows, MAX_FUSED_ROWS) * n   # calls of more rows run 128-row blocks (Triton)
        if self.dense_path and self.mma is not None:
            partials = max(partials, max_rows * n)   # the dense path's fp32 product
        sizes = [(max_rows * k, torch.float16), (partials, torch.float32)]
        if self.mma is None:
            sizes.append((max_rows, torch.float32))   # the Triton path's row scales
        if self.dense_path and self.mma is not None:
            sizes.append((k * n, torch.float16))
        if self.mma is not None:
            sizes.append((counter_count(n, max_rows), torch.int32))
        self._sizes = sizes
        self.workspace_bytes = sum(-(-numel * torch.empty((), dtype=dt).element_size() // _ALIGN) * _ALIGN
                                   for numel, dt in sizes)

    def bind(self, workspace: torch.Tensor) -> "LinearRunner":
        check_workspace(workspace, self.workspace_bytes, self.weight.device, "the weight is")
        self.check_weight_unchanged()
        views, offset = [], 0
        for numel, dtype in self._sizes:
            view, offset = _carve(workspace, offset, numel, dtype)
            views.append(view)
        counters = views.pop() if self.mma is not None else None
        if counters is not None:
            counters.zero_()
        dense = views.pop() if self.dense_path and self.mma is not None else None
        scales = views.pop() if self.mma is None else None
        return LinearRunner(self, *views, dense=dense, counters=counters, workspace=workspace, scales=scales)

    def check_weight_unchanged(self) -> None:
        """ContractError unless the plan's weight is still valid and has the tensors the plan was made for."""
        if check_weight(self.weight) != self.weight_key:
            raise ContractError(self.weight.name, "changed after the plan was made: make a new plan")

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def workspace_layout(self) -> tuple:
        """(elements, dtype) of every workspace entry in order: plans with equal layouts can share one."""
        return tuple(self._sizes)

    def allocate(self) -> torch.Tensor:
        return torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.weight.device)


class LinearRunner:
    """A plan bound to a workspace. `run` launches kernels only: no allocation, no host sync."""

    def __init__(self, plan: LinearPlan, xh: torch.Tensor, partials: torch.Tensor, dense: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None):
        self.plan = plan
        self._scales = scales
        self.workspace = workspace   # the bytes the views below are carved from
        self._xh = xh
        self._partials = partials
        self._dense = dense
        self._counters = counters

    def run(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        w = self.plan.weight
        self.plan.check_weight_unchanged()
        x2 = check_input(x, w)
        return self.run_checked(x, x2, out, check_output(out, x2.shape[0], w, tuple(x.shape[:-1])))

    def run_checked(self, x: torch.Tensor, x2: torch.Tensor, out: torch.Tensor, out2: torch.Tensor) -> torch.Tensor:
        """run for an x and out that check_input / check_output accepted; x2, out2 their [rows, k] / [rows, n] views."""
        w = self.plan.weight
        rows = x2.shape[0]
        if rows > self.plan.max_rows:
            raise ContractError("x", f"has {rows} rows, the plan was made for at most {self.plan.max_rows}")
        if rows == 0:
            return out
        if not use_triton(x):
            out2.copy_(linear_torch(x2, w))
            return out
        k, n = w.in_features, w.out_features
        xh = self._xh[:rows * k].view(rows, k)
        mma = self.plan.mma
        if rows <= MAX_FUSED_ROWS and mma is not None:
            partials = self._partials[:mma.splits * rows * n].view(mma.splits, rows, n)
            rotated = not fuses_rotation(rows, k, n)
            if rotated:
                x2 = rotate_input(x2, w.suh, xh, linear_chains(rows, x2.device))
            trellis_mma(x2, w, partials, self._counters, out2, mma, after_rotate=rotated)
            return out
        if rows > MAX_FUSED_ROWS and mma is not None:
            if prompt_on_ws(rows, k, n, mma.splits, x2.device):
                trellis_mma(rotate_input(x2, w.suh, xh), w, self._partials, self._counters, out2, mma,
                            after_rotate=True)
                return out
            return self._dense_cuda(x2, xh, out2, out)
        scales = row_scales(x2, w.suh, self._scales[:rows])
        hadamard128(x2, xh, pre=w.suh, row_scale=scales)
        t = self.plan.tiles
        for r0 in range(0, rows, MAX_FUSED_ROWS):   # larger calls in 128-row blocks: the same kernel, the same bytes
            block = min(MAX_FUSED_ROWS, rows - r0)
            partials = self._partials[:t.splits * block * n].view(t.splits, block, n)
            trellis_matmul(xh[r0:r0 + block], w.trellis, w.K, w.codebook, partials, t.splits, block_rows(block),
                           t.block_n, t.block_k, t.num_warps, t.num_stages)
            trellis_epilogue(partials, w.svh, w.bias, out2[r0:r0 + block], scales[r0:r0 + block])
        return out

    def _dense_cuda(self, x2, xh, out2, out):
        """More than 128 rows on a GPU: rotate, decode W_inner once, a GEMM that sums k in the few-row kernels'
        splits and order (so each row gets the bytes it gets in a call of 1-128 rows), then the output Hadamard, svh
        and bias."""
        w = self.plan.weight
        rows, (k, n) = x2.shape[0], (w.in_features, w.out_features)
        y = self._partials[:rows * n].view(rows, n)
        rotate_input(x2, w.suh, xh)
        split_ordered_gemm(xh, decode_dense(w, self._dense.view(k, n)), y, self.plan.mma.ktiles_per_split * 16)
        dense_epilogue(y, w, out2)
        return out


def linear_torch(x2: torch.Tensor, w: EXL3Weight) -> torch.Tensor:
    """The torch path (CPU without the Triton interpreter): fp32 arithmetic throughout, rows scaled by powers of two
    (row_scales_torch) so that no intermediate overflows; each row on its own (butterfly Hadamards, matmul_by_rows)."""
    scales = row_scales_torch(x2, w.suh)[:, None]
    xh = hadamard_blockwise_by_rows(x2.float() * scales * w.suh.float())
    y = hadamard_blockwise_by_rows(matmul_by_rows(xh, w.inner().float())) * w.svh.float() / scales
    return y + w.bias.float() if w.bias is not None else y


def dense_weight(w: EXL3Weight, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The original-basis weight W [in, out] = diag(suh) Hk W_inner Hn diag(svh), computed in fp32, cast once.

    For callers that multiply by a dense weight themselves; allocates.
    """
    check_weight(w)
    if dtype not in OUTPUT_DTYPES:
        raise ContractError("dtype", f"must be float16, bfloat16 or float32, got {dtype}")
    if not use_triton(w.trellis):
        return w.dense(torch.float32).to(dtype)
    k, n = w.in_features, w.out_features
    inner = trellis_decode(w.trellis, w.K, w.codebook, torch.empty(k, n, dtype=torch.float32, device=w.device))
    right = hadamard128(inner, torch.empty(k, n, dtype=torch.float32, device=w.device), post=w.svh)
    left = hadamard128(right.t().contiguous(), torch.empty(n, k, dtype=torch.float32, device=w.device), post=w.suh)
    return left.t().to(dtype).contiguous()


def linear_plan(w: EXL3Weight, max_rows: int, tiles: LinearTiles | None = None) -> LinearPlan:
    """Validate the weight and plan calls of up to `max_rows` rows."""
    return LinearPlan(w, max_rows, tiles)


# weight -> the runner that linear(x, w, out=...) reuses; its plan is made for a shallow copy of w, so an entry holds
# no reference to its key and goes with the weight.
_CACHED_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_rows(rows: int) -> int:
    """max_rows of a cached plan: MAX_FUSED_ROWS, or the power of two at or above a larger call's rows."""
    return block_rows(max(rows, MAX_FUSED_ROWS))


def cached_runner(w: EXL3Weight, rows: int, key: tuple | None = None) -> LinearRunner:
    """The runner cached for w (identity), planned again where w's tensors or device (its fingerprint `key`, from
    check_weight), the backend, or a call of more rows than planned changes it; bound to the workspace shared by
    plans of its layout on its device."""
    key = check_weight(w) if key is None else key
    runner = _CACHED_RUNNERS.get(w)
    plan = runner.plan if runner is not None else None
    if (plan is None or rows > plan.max_rows or plan.weight_key != key
            or (plan.mma is not None) != nvrtc.available(w.device)):
        plan = LinearPlan(copy.copy(w), cached_rows(rows))
        runner = _CACHED_RUNNERS[w] = plan.bind(workspace_for(plan, share=True))
    return runner


def linear(x: torch.Tensor, w: EXL3Weight, out: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ W + bias for an EXL3 weight; x fp16/bf16 [..., k]; output x's dtype unless out/out_dtype say.

    Without `out` a call plans and allocates. With `out`, calls reuse a plan cached per weight (for up to 128 rows,
    more as calls need) bound to the workspace shared by plans of its layout on its device (so do not overlap them
    on concurrent streams): after one call, a call of no more planned rows allocates nothing, never syncs with the
    host and can be captured in a CUDA graph. A row's bytes do not depend on the rows around it, at any row count.
    """
    key = check_weight(w)
    x2 = check_input(x, w)
    rows = x2.shape[0]
    if out is not None:
        out2 = check_output(out, rows, w, tuple(x.shape[:-1]))
        return cached_runner(w, rows, key).run_checked(x, x2, out, out2)
    dtype = out_dtype or x.dtype
    if dtype not in OUTPUT_DTYPES:
        raise ContractError("out_dtype", f"must be float16, bfloat16 or float32, got {dtype}")
    out = torch.empty(*x.shape[:-1], w.out_features, dtype=dtype, device=x.device)
    plan = LinearPlan(w, max(1, rows))
    return plan.bind(plan.allocate()).run_checked(x, x2, out, out.view(rows, w.out_features))
