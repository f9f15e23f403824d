"""Time each launch of a fused MoE call separately (route pack, gate/up with and without the hidden split, down,
combine) on a GPU, to find where the time goes. `--dry-run` executes every stage once on small CPU shapes."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from moe import SHAPES, random_layer, routings, stage_layers  # noqa: E402

from exl3moe.ops import moe_planning  # noqa: E402
from exl3moe.kernels.moe_experts import moe_gate_up  # noqa: E402
from exl3moe.kernels.route_pack import route_pack_max_blocks  # noqa: E402
from exl3moe.ops.moe import moe_plan  # noqa: E402


def stages(runner, hidden, ids, weights, out):
    """The runner's launches of one chunk, plus gate/up without the hidden split for comparison."""
    launches = runner.chunk_launches(hidden, ids, weights, out)
    plan = runner.plan
    if plan.mma is None and plan.gate_up_splits > 1:
        tables, ws = plan.tables, runner._ws
        slots = ids.numel()
        max_blocks = route_pack_max_blocks(slots, tables.num_experts, plan.block_m)
        route = (ws["block_expert"][:max_blocks], ws["block_start"][:max_blocks], ws["offsets"],
                 ws["sorted_slots"][:slots])
        launches["gate_up (no split)"] = lambda: moe_gate_up(hidden, ws["token_scale"], ws["h32"], route, slots,
                                                             ids.shape[1], tables, max_blocks, True, plan.block_m,
                                                             plan.decode_k)
    return launches


def main(args):
    device = "cpu" if args.dry_run else "cuda"
    hidden_size, inter, E, top_k = (256, 128, 8, 2) if args.dry_run else SHAPES[args.shape]
    gen = torch.Generator(device=device).manual_seed(0)
    if args.dry_run:
        from helpers import random_experts
        layer = random_experts(E, hidden_size, inter, K=4, codebook="mcg")
    else:
        layer = random_layer(hidden_size, inter, E, args.Ks or [args.K], args.codebook, gen, args.contiguous)
        if args.stage:   # a Qwen3 K4 stage layer of bench/moe.py instead
            layer = stage_layers(args.codebook, gen)[args.stage]
    if args.target_warps:
        moe_planning.TARGET_WARPS = args.target_warps
    if args.direct_max_slots is not None:
        moe_planning.DIRECT_MAX_SLOTS = args.direct_max_slots
    for T in ([3] if args.dry_run else args.tokens):
        plan = moe_plan(layer, T, top_k, block_m=args.block_m, slot_capacity=args.slot_capacity)
        runner = plan.bind(plan.allocate())
        x = (torch.randn(T, hidden_size, device=device, generator=gen) * 0.03).half()
        if args.dry_run:
            ids = torch.randint(0, E, (T, top_k), generator=gen, dtype=torch.int32)
            weights = torch.rand(T, top_k, generator=gen)
        else:
            ids, weights = routings(T, E, top_k, gen)[0]
        out = torch.empty(T, hidden_size, device=device, dtype=torch.float16)
        runner.run(x, ids, weights, out)
        if args.once:   # one call, for WS_TRACE builds (their block 0 prints its events)
            torch.cuda.synchronize()
            continue
        c = runner.plan.chunk_tokens  # the per-launch timings cover the first chunk
        parts = stages(runner, x[:c], ids[:c], weights[:c], out[:c])
        if args.dry_run:
            for name, call in parts.items():
                call()
            print("dry run: every stage launched:", ", ".join(parts))
            continue
        from exl3moe.timing import time_graph
        whole = time_graph([lambda: runner.run(x, ids, weights, out)], replays=20)
        line = " ".join(f"{name} {time_graph([call], replays=20):7.1f}" for name, call in parts.items())
        splits = (plan.mma.gate_up_splits, plan.mma.down_splits) if plan.mma else plan.gate_up_splits
        line += f" (block_m {plan.block_m}, splits {splits})"
        layout = " contiguous" if args.contiguous else ""
        layout += f" {args.stage}" if args.stage else ""
        print(f"{args.shape} K{args.Ks or args.K}{layout} T={T:5d} whole {whole:8.1f} us | {line}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--K", type=float, default=4)
    ap.add_argument("--Ks", nargs="+", type=float, default=None, help="mixed layer: these widths round robin")
    ap.add_argument("--contiguous", action="store_true", help="mixed layer: each width on a contiguous run of experts")
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--block-m", type=int, default=None, help="route-block rows (default: the plan's choice)")
    ap.add_argument("--slot-capacity", type=int, default=None, help="workspace slots per chunk (moe_plan's)")
    ap.add_argument("--target-warps", type=int, default=None,
                    help="CUDA experts' split target (moe_planning.TARGET_WARPS)")
    ap.add_argument("--direct-max-slots", type=int, default=None, help="moe_planning.DIRECT_MAX_SLOTS (0: always pack)")
    ap.add_argument("--stage", default=None, help="a Qwen3 K4 stage layer (bench/moe.py stage_layers): zero-stage...")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--once", action="store_true", help="run the layer once, time nothing (WS_TRACE builds)")
    main(ap.parse_args())
