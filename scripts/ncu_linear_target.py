"""The process Nsight Compute profiles for the linear scripts: three runs of one planned linear call (K4 MCG,
random trellis) on a GPU. Usage: python3 scripts/ncu_linear_target.py ROWS [K N]"""

import sys

import torch

from exl3moe import EXL3Weight
from exl3moe.ops.linear import LinearPlan

rows = int(sys.argv[1])
k, n = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (4096, 14336)
g = torch.Generator(device="cuda").manual_seed(0)
w = EXL3Weight(torch.randint(-32768, 32767, (k // 16, n // 16, 64), dtype=torch.int16, device="cuda", generator=g),
               torch.ones(k, device="cuda").half(), torch.ones(n, device="cuda").half(), "mcg")
plan = LinearPlan(w, rows)
runner = plan.bind(plan.allocate())
x = torch.randn(rows, k, device="cuda").half()
out = torch.empty(rows, n, device="cuda", dtype=torch.float16)
for _ in range(3):
    runner.run(x, out)
torch.cuda.synchronize()
