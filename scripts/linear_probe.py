"""Diagnose the linear matmul kernel on a GPU: occupancy (register caps), stages, registers and spills."""


import torch
import triton

from exl3moe.timing import time_graph  # noqa: E402

from exl3moe.kernels import trellis_matmul as tm  # noqa: E402

k, n, K = 4096, 14336, 4
g = torch.Generator(device="cuda").manual_seed(0)
trs = [torch.randint(-32768, 32767, (k // 16, n // 16, 16 * K), dtype=torch.int16, device="cuda", generator=g)
       for _ in range(8)]
variants = [(128, 64, 4, 3, 1024, None), (128, 64, 4, 3, 1024, 96), (128, 64, 4, 3, 1024, 80),
            (128, 64, 4, 3, 1024, 64), (128, 32, 4, 3, 1024, 64), (128, 32, 4, 3, 1024, 80),
            (128, 64, 4, 2, 1024, 64), (128, 64, 4, 4, 2048, 72), (128, 32, 4, 2, 2048, 64),
            (128, 128, 4, 2, 1024, 96)]
for bn, bk, warps, stages, target, maxnreg in variants:
    chunks = k // bk
    splits = max(1, min(chunks, -(-target // (n // bn))))
    per = -(-chunks // splits)
    splits = -(-chunks // per)
    wpad = triton.next_power_of_2(bn // 16 * 4 * 2 * K)
    for rows in (1, 128):
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
        part = torch.empty(splits, rows, n, device="cuda", dtype=torch.float32)
        grid = (n // bn, splits, 1)
        extra = {} if maxnreg is None else {"maxnreg": maxnreg}

        def call(t):
            return tm._trellis_matmul_kernel[grid](x, t.view(torch.int32), part, rows, n, n // 16, per, chunks,
                                                   x.stride(0), 2 * K, 1, 16 if rows == 1 else 128, bn, bk, 2,
                                                   False, wpad, num_warps=warps, num_stages=stages,
                                                   **extra)
        try:
            kern = call(trs[0])
            us = time_graph([lambda t=t: call(t) for t in trs])
            print(f"bn={bn} bk={bk:3d} w={warps} st={stages} splits={splits:2d} maxnreg={maxnreg} rows={rows:3d}: "
                  f"{us:6.1f} us regs {kern.n_regs} spills {kern.n_spills} smem {kern.metadata.shared}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"bn={bn} bk={bk} maxnreg={maxnreg} failed: {str(e)[-300:]}", flush=True)
