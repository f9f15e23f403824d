"""Diagnose the linear kernels on a GPU: per-variant times, registers, spills."""

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from common import time_graph  # noqa: E402

from exl3moe.kernels import trellis_matmul as tm  # noqa: E402
from exl3moe.kernels.hadamard import hadamard128  # noqa: E402

k, n, K = 4096, 14336, 4
g = torch.Generator(device="cuda").manual_seed(0)
trs = [torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda", generator=g)
       for _ in range(8)]
for rows in (1, 128):
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    xh = torch.empty_like(x)
    print(f"hadamard rows {rows}: {time_graph([lambda: hadamard128(x, xh, pre=None)] * 8):.1f} us")
variants = [(False, 64, 16, 4, 1, 512), (False, 64, 16, 4, 3, 512), (False, 64, 16, 4, 2, 2048),
            (False, 64, 16, 4, 1, 4096), (True, 64, 16, 4, 2, 512), (True, 64, 32, 4, 2, 512),
            (True, 128, 32, 4, 2, 512), (True, 64, 64, 4, 2, 512), (True, 128, 64, 8, 3, 512),
            (True, 64, 32, 4, 1, 2048), (True, 128, 32, 4, 3, 1024), (True, 256, 32, 8, 3, 512)]
for gather, bn, bk, warps, stages, target in variants:
    chunks = k // bk
    splits = max(1, min(chunks, -(-target // (n // bn))))
    per = -(-chunks // splits)
    splits = -(-chunks // per)
    wpad = triton.next_power_of_2(bn // 16 * 4 * 2 * K)
    for rows in (1, 128):
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
        part = torch.empty(splits, rows, n, device="cuda", dtype=torch.float32)
        grid = (n // bn, splits, 1)

        def call(t):
            return tm._trellis_matmul_kernel[grid](x, t.view(torch.int32), part, rows, n, n // 16, per, chunks,
                                                   x.stride(0), 2 * K, 1, 16 if rows == 1 else 128, bn, bk, True,
                                                   False, gather, wpad, num_warps=warps, num_stages=stages)
        try:
            kern = call(trs[0])
            us = time_graph([lambda t=t: call(t) for t in trs])
            print(f"gather={gather:d} bn={bn:3d} bk={bk:2d} w={warps} st={stages} splits={splits:3d} rows={rows:3d}: "
                  f"{us:8.1f} us regs {kern.n_regs} spills {kern.n_spills}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"gather={gather} bn={bn} bk={bk} failed: {str(e)[:200]}", flush=True)
