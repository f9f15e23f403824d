"""Random routing against routings that give every expert the same rows, same plan (GPU): what partly filled route
blocks cost at 2048-4096 tokens. Usage: python3 scripts/route_balance_probe.py [TOKENS ...]"""
import sys

import torch

sys.path.insert(0, "bench")
from moe import SHAPES, random_layer, routings  # noqa: E402

from exl3moe.ops.moe import moe_plan  # noqa: E402
from exl3moe.timing import time_graph  # noqa: E402


def main(tokens: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in ("qwen3-30b-a3b", "glm-4.5-air"):
        H, I, E, top_k = SHAPES[shape]
        layer = random_layer(H, I, E, [4], "mcg", gen)
        for T in tokens:
            x = (torch.randn(T, H, device="cuda", generator=gen) * 0.3).half()
            out = torch.empty(T, H, device="cuda", dtype=torch.float16)
            plan = moe_plan(layer, T, top_k)
            runner = plan.bind(plan.allocate())
            rnd = routings(T, E, top_k, gen)
            flat = (torch.arange(T * top_k, device="cuda") % E).reshape(T, top_k)
            balanced = [((flat + s) % E).to(torch.int32).contiguous() for s in range(4)]
            w = torch.full((T, top_k), 1.0 / top_k, device="cuda")
            t_rnd = time_graph([lambda r=r: runner.run(x, r[0], r[1], out) for r in rnd], replays=10)
            t_bal = time_graph([lambda b=b: runner.run(x, b, w, out) for b in balanced], replays=10)
            counts = torch.bincount(rnd[0][0].reshape(-1).long(), minlength=E)
            blocks = int((-(-counts // plan.block_m)).sum())
            even = E * -(-(T * top_k // E) // plan.block_m)
            print(f"{shape} T {T} block_m {plan.block_m}: random {t_rnd:.1f} us ({blocks} route blocks), balanced "
                  f"{t_bal:.1f} us ({even}), ratio {t_bal / t_rnd:.3f}", flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [2048, 4096])
