"""y [rows, n] fp32 = xh @ W_inner over a decoded W, in the accumulation order of the few-row kernels: each k split
of the linear's plan summed from zero one 16-deep MMA step at a time, the splits' sums added in split order to a
running total that starts at zero. So a row's bytes equal those of the same row in a call of 1-128 rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_GEMM_BM, SPLIT_GEMM_BN, SPLIT_GEMM_BK, SPLIT_GEMM_GROUP_M = 64, 128, 64, 8
SPLIT_GEMM_WARPS, SPLIT_GEMM_STAGES = 4, 4


@triton.jit(do_not_specialize=["rows"])
def _split_ordered_gemm(x_ptr, w_ptr, y_ptr, rows, n, k, stride_x, split_k, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(rows, BM)
    grid_n = n // BN
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_mask = (rm < rows)[:, None]
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_x + rk[None, :]
    w_ptrs = w_ptr + rk.to(tl.int64)[:, None] * n + rn[None, :]
    total = tl.zeros((BM, BN), dtype=tl.float32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    steps = k // BK
    steps_per_split = split_k // BK
    for i in range(steps):
        a = tl.load(x_ptrs, mask=row_mask, other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        if ((i + 1) % steps_per_split == 0) | (i + 1 == steps):
            total += acc
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        x_ptrs += BK
        w_ptrs += BK * n
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * n + rn[None, :], total, mask=row_mask)


def split_ordered_gemm(xh: torch.Tensor, dense: torch.Tensor, y: torch.Tensor, split_k: int) -> torch.Tensor:
    """y [rows, n] fp32 <- xh [rows, k] fp16 @ dense [k, n] fp16, k summed in splits of split_k (a multiple of
    SPLIT_GEMM_BK) as the few-row kernels sum it; k a multiple of split_k's step, n of SPLIT_GEMM_BN."""
    rows, k = xh.shape
    n = dense.shape[1]
    grid = (triton.cdiv(rows, SPLIT_GEMM_BM) * (n // SPLIT_GEMM_BN),)
    _split_ordered_gemm[grid](xh, dense, y, rows, n, k, xh.stride(0), split_k, SPLIT_GEMM_BM, SPLIT_GEMM_BN,
                              SPLIT_GEMM_BK, SPLIT_GEMM_GROUP_M, num_warps=SPLIT_GEMM_WARPS,
                              num_stages=SPLIT_GEMM_STAGES)
    return y


def warm_split_gemm(k: int, n: int, split_k: int, device: torch.device) -> None:
    """Compile the GEMM for a weight of (k, n) without launching it, so that a first call can be captured."""
    half, y = torch.empty(1, dtype=torch.float16, device=device), torch.empty(1, device=device)
    _split_ordered_gemm.warmup(half, half, y, 1024, n, k, k, split_k, SPLIT_GEMM_BM, SPLIT_GEMM_BN, SPLIT_GEMM_BK,
                               SPLIT_GEMM_GROUP_M, num_warps=SPLIT_GEMM_WARPS, num_stages=SPLIT_GEMM_STAGES, grid=(1,))
