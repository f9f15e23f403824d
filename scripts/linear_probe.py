"""Diagnose the linear kernels on a GPU: per-variant times, registers, spills; whole-op times."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from common import time_graph  # noqa: E402

from exl3moe import EXL3Weight  # noqa: E402
from exl3moe.kernels import trellis_matmul as tm  # noqa: E402
from exl3moe.ops.linear import LinearPlan, LinearTiles  # noqa: E402

k, n, K = 4096, 14336, 4
g = torch.Generator(device="cuda").manual_seed(0)
trs = [torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda", generator=g)
       for _ in range(8)]
variants = [(128, 32, 4, 3, 1024), (128, 64, 8, 3, 1024), (64, 32, 4, 3, 2048), (256, 16, 8, 3, 1024),
            (128, 32, 4, 4, 2048), (256, 32, 8, 3, 1024)]
for asm in (1, 2):
    for bn, bk, warps, stages, target in variants:
        chunks = k // bk
        splits = max(1, min(chunks, -(-target // (n // bn))))
        per = -(-chunks // splits)
        splits = -(-chunks // per)
        for cb in ("mcg", "mul1"):
            for rows in (1, 128):
                x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
                part = torch.empty(splits, rows, n, device="cuda", dtype=torch.float32)
                try:
                    us = time_graph([lambda t=t: tm.trellis_matmul(x, t, K, cb, part, splits, 16 if rows == 1 else 128,
                                                                  bn, bk, warps, stages, asm_level=asm) for t in trs])
                    print(f"asm={asm} bn={bn:3d} bk={bk:2d} w={warps} st={stages} splits={splits:3d} {cb:4s} "
                          f"rows={rows:3d}: {us:8.1f} us", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"asm={asm} bn={bn} bk={bk} {cb} failed: {str(e)[:300]}", flush=True)
                    break
for rows in (1, 8, 32, 128):
    ws = [EXL3Weight(t, torch.ones(k, device="cuda").half(), torch.ones(n, device="cuda").half(), "mcg") for t in trs]
    plan = LinearPlan(ws[0], rows)
    buf = plan.allocate()
    runners = [LinearPlan(w, rows).bind(buf) for w in ws]
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
    print(f"whole op {plan.tiles} rows={rows}: {time_graph([lambda r=r: r.run(x, out) for r in runners]):.1f} us")
