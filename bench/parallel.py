"""Benchmark one EXL3 MoE layer (K4 MCG random trellises) on one GPU against tensor-parallel (TP) and expert-parallel
(EP) shards over every rank of a torchrun group, the all-reduce included, each case captured in one CUDA graph.

  torchrun --nproc_per_node 2 bench/parallel.py --out F.json [--plot P.png] [--check]
  torchrun --nproc_per_node 2 bench/parallel.py --device cpu --backend gloo --shape tiny=128,256,4,2 --tokens 1 4

Every rank builds the whole layer from the same seed, then keeps its shard. "one" is rank 0 alone with the whole
layer; the split cases run in lockstep on every rank: fp32 partial output, all-reduce, cast to fp16 (as
parallel/modules.py's ReducedMoE). `--check` runs each split twice and compares the output bytes.
"""

import argparse
import datetime
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from exl3moe.ops.moe import moe_plan
from exl3moe.parallel.experts import all_reduce_sum, expert_range, expert_shard, local_ids, tensor_shard
from moe import SHAPES, random_layer, routings
from parallel_report import plot, print_table, summarize, with_ratios

TOKENS = [1, 4, 16, 64, 1024, 4096]
CHECK_TOKENS = [64, 1024]
BACKENDS = ("cuda", "triton", "torch")   # MoECallPlan.backend


class Group:
    """This process in the torchrun group: rank, world, device, and a barrier that leaves every rank's GPU idle."""

    def __init__(self, device: str, backend: str, timeout_s: int):
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        self.cuda = device == "cuda"
        self.device = torch.device("cuda", local) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        bound = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **bound)
        self.backend = backend
        all_reduce_sum(torch.zeros(1, device=self.device))   # the communicator exists before any capture

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(**({"device_ids": [self.device.index]} if self.backend == "nccl" else {}))
        if self.cuda:
            torch.cuda.synchronize()

    def gather(self, value: float) -> list:
        """Every rank's `value`, in rank order."""
        mine = torch.tensor([value], dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [t.item() for t in out]


def replay_us(calls, replays: int, graphs: bool, sync) -> float:
    """Median microseconds per call over `replays` runs of all `calls` (one CUDA graph, or eagerly); `sync` before
    each run keeps the ranks in lockstep."""
    times = []
    if graphs:
        from exl3moe.timing import capture_graph
        graph = capture_graph(calls, "thread_local")
        for _ in range(replays):
            sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / len(calls))
        graph.reset()   # a graph holding NCCL work must go before the process group is destroyed
    else:
        for fn in calls:
            fn()
        for _ in range(replays):
            sync()
            t0 = time.perf_counter()
            for fn in calls:
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return statistics.median(times)


def layer_calls(experts, x, routes, top_k: int, reduce: bool, first=None) -> tuple:
    """(one call per routing, the fp16 output they write, the experts' kernels: "cuda" or "triton" or "torch"): the
    layer on `x`; with `reduce`, fp32 partials all-reduced then cast; `first` renumbers the routing for an expert
    shard starting there."""
    T, H = x.shape
    plan = moe_plan(experts, T, top_k, out_dtype=torch.float32 if reduce else torch.float16)
    runner = plan.bind(plan.allocate())
    out = torch.empty(T, H, dtype=torch.float16, device=x.device)
    partial = torch.empty(T, H, dtype=torch.float32, device=x.device) if reduce else out

    def call(ids, weights):
        if first is not None:
            ids = local_ids(ids, first, experts.num_experts)
        runner.run(x, ids, weights, partial)
        if reduce:
            all_reduce_sum(partial)
            out.copy_(partial)
    return [lambda r=r: call(*r) for r in routes], out, plan.call_plan.backend


def shards(whole, group) -> dict:
    """{split name: (this rank's experts, first expert id or None)}."""
    first, _ = expert_range(whole.num_experts, group.rank, group.world)
    return {f"tp{group.world}": (tensor_shard(whole, group.rank, group.world), None),
            f"ep{group.world}": (expert_shard(whole, group.rank, group.world), first)}


def inputs(shape_seed: int, T: int, H: int, E: int, top_k: int, device, count=None) -> tuple:
    """(x, routings): the same on every rank (seeded by shape and token count); `count` routings, else bench/moe.py's
    number for T tokens."""
    gen = torch.Generator(device=device).manual_seed(shape_seed * 100003 + T)
    x = (torch.randn(T, H, device=device, generator=gen) * 0.3).half()
    routes = routings(T, E, top_k, gen)
    return x, routes[:count] if count else routes


def measure_point(shape: str, T: int, whole, split_experts: dict, group, args) -> list:
    """The rows of one (shape, tokens): one GPU, each split, and the all-reduce alone."""
    H, _, E, top_k = args.shapes[shape]
    x, routes = inputs(list(args.shapes).index(shape), T, H, E, top_k, group.device, args.routings)
    graphs = group.cuda and not args.eager
    rows = []
    if group.rank == 0:
        one_calls, _, kernels = layer_calls(whole, x, routes, top_k, reduce=False)
        one = replay_us(one_calls, args.replays, graphs, lambda: None)
        rows.append(dict(mode="one", us=round(one, 2), rank_us=[round(one, 2)], experts=[kernels]))
    group.sync()
    buf = torch.zeros(T, H, dtype=torch.float32, device=group.device)
    collective = max(group.gather(replay_us([lambda: all_reduce_sum(buf)] * len(routes), args.replays, graphs,
                                            group.sync)))
    for name, (experts, first) in split_experts.items():
        group.sync()
        calls, _, kernels = layer_calls(experts, x, routes, top_k, reduce=True, first=first)
        per_rank = group.gather(replay_us(calls, args.replays, graphs, group.sync))
        backends = [BACKENDS[int(i)] for i in group.gather(BACKENDS.index(kernels))]
        rows.append(dict(mode=name, us=round(max(per_rank), 2), rank_us=[round(u, 2) for u in per_rank],
                         collective_us=round(collective, 2), experts=backends))
    group.sync()
    for row in rows:
        row.update(shape=shape, tokens=T, calls=len(routes), graphs=graphs)
    return rows


def run_once(experts, x, routes, top_k, first, reduce) -> torch.Tensor:
    calls, out, _ = layer_calls(experts, x, routes[:1], top_k, reduce=reduce, first=first)
    calls[0]()
    return out.clone()


def check_point(shape: str, T: int, whole, split_experts: dict, group, args) -> list:
    """Each split run twice on the same sequence (fresh plan and workspace each time): bytes equal on every rank, and
    the fp16 output's relative L2 to one GPU's."""
    H, _, E, top_k = args.shapes[shape]
    x, routes = inputs(list(args.shapes).index(shape), T, H, E, top_k, group.device)
    single = run_once(whole, x, routes, top_k, None, reduce=False).double() if group.rank == 0 else None
    rows = []
    for name, (experts, first) in split_experts.items():
        group.sync()
        a = run_once(experts, x, routes, top_k, first, reduce=True)
        b = run_once(experts, x, routes, top_k, first, reduce=True)
        equal = group.gather(float(torch.equal(a, b)))
        if group.rank == 0:
            rel = ((a.double() - single).norm() / single.norm()).item()
            rows.append(dict(shape=shape, tokens=T, mode=name, identical=all(e == 1.0 for e in equal),
                             rank_identical=[e == 1.0 for e in equal], vs_one_gpu_rel_l2=rel))
    group.sync()
    return rows


def run_record(group, args) -> dict:
    """GPU, versions, NCCL and the world, for the result file."""
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "world_size": group.world,
            "backend": group.backend, "graphs": group.cuda and not args.eager, "replays": args.replays,
            "collective": "all-reduce sum of the fp32 [tokens, hidden] partial output"}
    if group.cuda:
        from exl3moe.timing import run_info
        info.update(run_info(), gpus=torch.cuda.device_count(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if group.backend == "nccl" else None,
                    peer_access=torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1),
                    env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")})
    else:
        info.update(gpu="none (cpu)", nccl=None)
    return info


def write_doc(group, args, results: list, checks: list) -> dict:
    """The result file as far as measured (a run stopped part way keeps its points)."""
    rows = with_ratios(results)
    shapes = {k: dict(zip(("hidden", "intermediate", "experts", "top_k"), v)) for k, v in args.shapes.items()}
    doc = {**run_record(group, args), "shapes": shapes, "results": rows, "summary": summarize(rows, group.world),
           **({"determinism": checks} if args.check else {})}
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    return doc


def main(args) -> None:
    group = Group(args.device, args.backend, args.timeout)
    results, checks = [], []

    for shape, (H, I, E, top_k) in args.shapes.items():
        gen = torch.Generator(device=group.device).manual_seed(args.seed)
        whole = random_layer(H, I, E, [4], "mcg", gen)
        split_experts = shards(whole, group)
        if group.rank != 0:
            whole = None
        for T in args.tokens:
            rows = measure_point(shape, T, whole, split_experts, group, args)
            results += rows
            if group.rank == 0:
                print(" ".join(f"{r['mode']} {r['us']:.1f} us" for r in rows), f"<- {shape} T={T}", flush=True)
                write_doc(group, args, results, checks)
        if args.check:
            for T in args.check_tokens:
                checks += check_point(shape, T, whole, split_experts, group, args)
            if group.rank == 0:
                write_doc(group, args, results, checks)
        del whole, split_experts
        if group.cuda:
            torch.cuda.empty_cache()
    if group.rank == 0:
        doc = write_doc(group, args, results, checks)
        print_table(doc)
        if args.plot:
            plot(doc, args.plot)
    group.sync()
    dist.destroy_process_group()


def shape_arg(text: str) -> tuple:
    """NAME (a known shape) or NAME=H,I,E,TOP_K."""
    name, _, dims = text.partition("=")
    if not dims:
        if name not in SHAPES:
            raise argparse.ArgumentTypeError(f"unknown shape {name!r}: one of {list(SHAPES)} or NAME=H,I,E,TOP_K")
        return name, SHAPES[name]
    try:
        values = tuple(int(v) for v in dims.split(","))
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=H,I,E,TOP_K with four positive ints")
    return name, values


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/parallel_h200x2.json")
    ap.add_argument("--plot", help="also draw the result into this PNG (needs matplotlib)")
    ap.add_argument("--shape", dest="shapes", action="append", type=shape_arg,
                    help="a shape to time (repeatable); default Qwen3-30B-A3B and GLM-4.5-Air")
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--check", action="store_true", help="also compare each split's output bytes over two runs")
    ap.add_argument("--check-tokens", nargs="+", type=int, default=CHECK_TOKENS)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default nccl on cuda, gloo on cpu")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (always so on the CPU)")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--routings", type=int, help="routings (calls) per timed graph; default bench/moe.py's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=600, help="seconds a collective may wait for the other ranks")
    ap.add_argument("--from-json", help="print the table (and --plot) of an earlier result file; no processes")
    args = ap.parse_args(argv)
    args.shapes = dict(args.shapes or SHAPES.items())
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    return args


if __name__ == "__main__":
    cli = parse()
    if cli.from_json:
        with open(cli.from_json) as fh:
            loaded = json.load(fh)
        print_table(loaded)
        if cli.plot:
            plot(loaded, cli.plot)
    else:
        main(cli)
