"""Interleaved A/B of NVRTC define sets on a GPU, in one process: each case is built and captured once per set (its
kernels compiled with that set as EXL3MOE_NVRTC_DEFINES, its EXL3MOE_* items set in the environment), then the sets'
graphs are replayed in turn, round after round, so drift over the run falls on every set alike. Prints each case's
median per set and the ratio to the first set. Note the variants first without a GPU (--note) and warm the cache
(scripts/warm_cache.py)."""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import linear as bench_linear  # noqa: E402
from moe import LAYERS, SHAPES, exl3_calls, random_layer, stage_layers  # noqa: E402

from exl3moe.kernels import nvrtc  # noqa: E402
from exl3moe.ops.linear import LinearPlan  # noqa: E402
from exl3moe.ops.moe import moe_plan  # noqa: E402
from exl3moe.timing import capture_graph, replay_times  # noqa: E402


_SET_ENV = set()   # EXL3MOE_* variables the current set has put in the environment


def use_set(define_set: str) -> None:
    """A set: comma-separated NAME=VALUE items, NVRTC defines or (EXL3MOE_*) environment variables; "0" for none."""
    items = dict(item.split("=", 1) for item in define_set.split(",") if define_set != "0")
    for name in _SET_ENV - set(items):
        del os.environ[name]
    _SET_ENV.clear()
    for name, value in items.items():
        if name.startswith("EXL3MOE_"):
            os.environ[name] = value
            _SET_ENV.add(name)
    os.environ["EXL3MOE_NVRTC_DEFINES"] = ",".join(f"{k}={v}" for k, v in items.items() if k not in _SET_ENV)
    if hasattr(nvrtc.kernel, "cache_clear"):   # not under note_variants.pretend_sm90
        nvrtc.kernel.cache_clear()


def linear_case(k, n, K, codebook, rows, gen):
    calls, _ = bench_linear.exl3_calls(k, n, K, codebook, rows, gen)
    return f"{k}x{n} K{K} {codebook} rows {rows}", calls


def layer_widths(label: str) -> list:
    return LAYERS[int(label) if label.isdigit() else label]


def moe_case(shape, label, tokens, gen, shared=False):
    hidden, inter, E, top_k = SHAPES[shape]
    widths = layer_widths(label)
    one = random_layer(hidden, inter, 1, widths[:1], "mcg", gen) if shared else None   # as bench/moe.py --shared
    build = exl3_calls(random_layer(hidden, inter, E, widths, "mcg", gen), tokens, top_k, gen, one)
    return f"moe {shape} K={label}{' shared' if shared else ''} T {tokens}", lambda: build()[0]


def stage_case(name, layer, tokens, gen):
    build = exl3_calls(layer, tokens, SHAPES["qwen3-30b-a3b"][3], gen)
    return f"moe qwen3-30b-a3b K4 {name} T {tokens}", lambda: build()[0]


def linear_params(args):
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        for K in args.bits:
            for codebook in args.codebooks:
                for rows in args.rows:
                    yield k, n, K, codebook, rows


def moe_params(args):
    for shape in args.moe_shapes:
        for label in args.layers:
            for tokens in args.tokens:
                yield shape, label, tokens


def cases(args, gen):
    for k, n, K, codebook, rows in linear_params(args):
        yield linear_case(k, n, K, codebook, rows, gen)
    for shape, label, tokens in moe_params(args):
        yield moe_case(shape, label, tokens, gen, args.shared)
    layers = stage_layers("mcg", gen) if args.stages else {}
    for name in args.stages:
        for tokens in args.tokens:
            yield stage_case(name, layers[name], tokens, gen)


def note(args):
    """Build every case's plans under every set without a GPU, so warm_cache.py compiles their kernels."""
    import note_variants
    note_variants.pretend_sm90()
    for define_set in args.sets:
        use_set(define_set)
        for k, n, K, codebook, rows in linear_params(args):
            LinearPlan(note_variants.weight(k, n, K, codebook), rows)
        for shape, label, tokens in moe_params(args):
            hidden, inter, E, top_k = SHAPES[shape]
            shared = note_variants.layer(hidden, inter, 1, layer_widths(label)[:1]) if args.shared else None
            moe_plan(note_variants.layer(hidden, inter, E, layer_widths(label)), tokens, top_k, shared=shared)
        hidden, inter, E, top_k = SHAPES["qwen3-30b-a3b"]
        for tokens in args.tokens if args.stages else ():
            moe_plan(note_variants.stage_layer(hidden, inter, E), tokens, top_k)


def main(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("case", *args.sets, *(f"{s}/{args.sets[0]}" for s in args.sets[1:]), sep=" | ", flush=True)
    for name, calls in cases(args, gen):
        graphs = []   # (graph, its calls): the calls keep the runners' workspaces alive while the graph replays
        for define_set in args.sets:
            use_set(define_set)
            fns = calls()
            graphs.append((capture_graph(fns), fns))
        times = [[] for _ in args.sets]
        for _ in range(args.rounds):
            for i, (graph, fns) in enumerate(graphs):
                times[i] += replay_times(graph, len(fns), args.replays)
        med = [statistics.median(t) for t in times]
        print(name, *(f"{m:.2f}" for m in med), *(f"{m / med[0]:.3f}" for m in med[1:]), sep=" | ", flush=True)
        del graphs


def case_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options that choose the cases and define sets."""
    ap.add_argument("--sets", nargs="+", default=["0"], help='define sets, "A=1,B=2" each; "0" for none')
    ap.add_argument("--shapes", nargs="*", default=["4096x14336"])
    ap.add_argument("--bits", nargs="+", type=int, default=[4])
    ap.add_argument("--codebooks", nargs="+", default=["mcg"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--tokens", nargs="*", type=int, default=[])
    ap.add_argument("--layers", nargs="*", default=["4"], help="MoE layers (bench/moe.py LAYERS)")
    ap.add_argument("--moe-shapes", nargs="+", default=["qwen3-30b-a3b"], help="bench/moe.py SHAPES")
    ap.add_argument("--stages", nargs="*", default=[], help="Qwen3 K4 stage layers (bench/moe.py stage_layers)")
    ap.add_argument("--shared", action="store_true", help="MoE layers with a shared expert of their own width")
    ap.add_argument("--note", action="store_true", help="note the variants for warm_cache.py (no GPU)")
    return ap


if __name__ == "__main__":
    ap = case_arguments(argparse.ArgumentParser())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=4)
    a = ap.parse_args()
    note(a) if a.note else main(a)
