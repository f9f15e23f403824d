"""Benchmark the fused EXL3 MoE layer on a GPU against the same layer in bf16 through torch._grouped_mm."""

import argparse

import torch

from exl3moe import EXL3Weight, ExpertSet, ResidualStage
from exl3moe.ops.moe import moe_plan
from exl3moe.timing import time_graph
from results_io import save_results

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "glm-4.5-air": (4096, 1408, 128, 8)}
LAYERS = {2: [2], 3: [3], 4: [4], 5: [5], 6: [6],  # 5: the uniform layer of mixed-k2k8's bytes
          "mixed-k3k4": [3, 4], "mixed-k2k8": [2, 3, 4, 5, 6, 7, 8]}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
RESULT_KEY = ("shape", "K", "codebook", "tokens", "stages", "shared")  # what a --merge rerun replaces
# Distinct routings per timed graph, so a replay does not find the previous calls' experts in L2: below 32 tokens a
# call reads few experts, so more calls keep the graph's footprint above the L2 and average over more routings.
CALLS, SMALL_CALLS, SMALL_TOKENS = 4, 16, 32


def random_weight(k, n, K, codebook, gen):
    trellis = torch.randint(-32768, 32767, (k // 16, n // 16, int(16 * K)), dtype=torch.int16, device=gen.device,
                            generator=gen)
    suh = (torch.rand(k, device=gen.device, generator=gen) + 0.5).half() / 32
    svh = (torch.rand(n, device=gen.device, generator=gen) + 0.5).half()
    return EXL3Weight(trellis, suh, svh, codebook)


def random_layer(hidden, inter, E, Ks, codebook, gen, contiguous=False):
    """Random experts with widths Ks assigned round robin (or in contiguous runs of experts)."""
    K_of = [Ks[e * len(Ks) // E] if contiguous else Ks[e % len(Ks)] for e in range(E)]
    proj = lambda k, n: [random_weight(k, n, K_of[e], codebook, gen) for e in range(E)]  # noqa: E731
    return ExpertSet(proj(hidden, inter), proj(hidden, inter), proj(inter, hidden), "silu")


def routings(T, E, top_k, gen):
    out = []
    for _ in range(SMALL_CALLS if T < SMALL_TOKENS else CALLS):
        logits = torch.randn(T, E, device=gen.device, generator=gen)
        w, ids = torch.softmax(logits, -1).topk(top_k, -1)
        out.append((ids.to(torch.int32).contiguous(), (w / w.sum(-1, keepdim=True)).contiguous()))
    return out


def exl3_calls(experts, T, top_k, gen, shared=None):
    """A builder of (one call per routing, the plan): it plans, binds and returns the calls to time."""
    x = (torch.randn(T, experts.hidden_size, device="cuda", generator=gen) * 0.3).half()
    out = torch.empty(T, experts.hidden_size, device="cuda", dtype=torch.float16)
    routes = routings(T, experts.num_experts, top_k, gen)

    def calls():
        plan = moe_plan(experts, T, top_k, shared=shared)
        runner = plan.bind(plan.allocate())
        return [lambda r=r: runner.run(x, r[0], r[1], out) for r in routes], plan
    return calls


def time_exl3(experts, T, top_k, gen, shared=None) -> tuple:
    """(median us, "cuda" or "triton": which expert kernels the plan runs)."""
    calls, plan = exl3_calls(experts, T, top_k, gen, shared)()
    return time_graph(calls, replays=10), "cuda" if plan.mma is not None else "triton"


def bf16_layer(hidden, inter, E, gen):
    gate_up = torch.randn(E, hidden, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(E, inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return gate_up, down


def expert_order(ids, E):
    """(slot order sorted by expert, int32 end offsets per expert) of a [T, top_k] routing, without a host sync."""
    flat = ids.reshape(-1).long()
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return torch.argsort(flat, stable=True), torch.cumsum(counts, 0).to(torch.int32)


def grouped_experts(rows, offs, gate_up, down):
    """bf16 routed experts on rows sorted by expert: grouped GEMMs and the SiLU gate."""
    g, u = torch._grouped_mm(rows, gate_up, offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(torch.nn.functional.silu(g) * u, down, offs=offs)


def dense_expert(x, shared):
    """A dense shared expert (gate_up [H, 2 I_s], down [I_s, H]) in bf16."""
    g, u = (x @ shared[0]).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u) @ shared[1]


def bf16_moe(x, ids, weights, gate_up, down, out, shared=None):
    """The same routed layer in bf16: sort slots by expert, grouped GEMMs, SiLU gate, weighted scatter-add;
    plus a dense shared expert when given."""
    top_k = ids.shape[1]
    order, offs = expert_order(ids, gate_up.shape[0])
    y = grouped_experts(x[order // top_k], offs, gate_up, down)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    out.zero_()
    out.index_add_(0, order // top_k, y.to(out.dtype))
    if shared is not None:
        out += dense_expert(x, shared)


def time_bf16(layer, hidden, E, T, top_k, gen, shared=None) -> tuple:
    """(the whole bf16 layer, its grouped GEMMs and SiLU alone with the rows sorted outside the timing), median us."""
    x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(T, hidden, device="cuda", dtype=torch.bfloat16)
    routes = routings(T, E, top_k, gen)
    whole = time_graph([lambda r=r: bf16_moe(x, r[0], r[1], layer[0], layer[1], out, shared) for r in routes],
                       replays=10)
    def gemms_only(ids):
        order, offs = expert_order(ids, E)
        rows = x[order // top_k].contiguous()

        def call():
            grouped_experts(rows, offs, layer[0], layer[1])
            if shared is not None:
                dense_expert(x, shared)
        return call
    return whole, time_graph([gemms_only(ids) for ids, _ in routes], replays=10)


def residual_stage(experts, scales, K, codebook, gen):
    """A K-bit residual on every expert and projection of `experts`, sharing the base suh/svh."""
    def residuals(bases):
        return [EXL3Weight(torch.randint(-32768, 32767, w.trellis.shape[:2] + (int(16 * K),), dtype=torch.int16,
                                         device="cuda", generator=gen), w.suh, w.svh, codebook) for w in bases]
    return ResidualStage(residuals(experts.gate), residuals(experts.up), residuals(experts.down), scales)


def stage_layers(codebook, gen) -> dict:
    """Qwen3 shape, K4 base: alone; with an all-zero stage table; one K2 MCG stage on all / a quarter of experts."""
    hidden, inter, E, top_k = SHAPES["qwen3-30b-a3b"]
    base = random_layer(hidden, inter, E, [4], codebook, gen)
    every = torch.full((E, 3), 0.1, device="cuda")
    quarter = torch.zeros(E, 3, device="cuda")
    quarter[::4] = 0.1
    variants = {"base": [], "zero-stage": [residual_stage(base, torch.zeros(E, 3, device="cuda"), 2, "mcg", gen)],
                "k2-all": [residual_stage(base, every, 2, "mcg", gen)],
                "k2-quarter": [residual_stage(base, quarter, 2, "mcg", gen)]}
    return {name: ExpertSet(base.gate, base.up, base.down, "silu", stages=st) for name, st in variants.items()}


def stage_variants(args):
    gen = torch.Generator(device="cuda").manual_seed(1)
    top_k = SHAPES["qwen3-30b-a3b"][3]
    layers = stage_layers(args.codebook, gen)
    results = []
    for T in args.tokens:
        for name, layer in layers.items():
            us, kernels = time_exl3(layer, T, top_k, gen)
            results.append(dict(shape="qwen3-30b-a3b", K=4, stages=name, codebook=args.codebook, tokens=T,
                                us=round(us, 1), experts=kernels))
            print(f"stages {name:10s} T={T:5d} {us:9.1f} us", flush=True)
    return results


def main(args):
    if args.stages:
        return stage_variants(args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for shape in args.shapes:
        hidden, inter, E, top_k = SHAPES[shape]
        base = bf16_layer(hidden, inter, E, gen)
        bf16_shared = [t[0] for t in bf16_layer(hidden, inter, 1, gen)] if args.shared else None
        bf16 = {T: time_bf16(base, hidden, E, T, top_k, gen, bf16_shared) for T in args.tokens}
        del base
        for label in args.layers:
            key = int(label) if label.isdigit() else label
            experts = random_layer(hidden, inter, E, LAYERS[key], args.codebook, gen)
            shared = random_layer(hidden, inter, 1, LAYERS[key][:1], args.codebook, gen) if args.shared else None
            for T in args.tokens:
                us, kernels = time_exl3(experts, T, top_k, gen, shared)
                whole, gemms = bf16[T]
                results.append(dict(shape=shape, K=key, codebook=args.codebook, tokens=T, us=round(us, 1),
                                    bf16_us=round(whole, 1), bf16_gemm_us=round(gemms, 1), experts=kernels,
                                    **({"shared": True} if args.shared else {})))
                print(f"{shape:14s} K={str(key):10s} {args.codebook} T={T:5d} {us:9.1f} us  bf16 {whole:8.1f} us "
                      f"ratio {us / whole:5.2f}  bf16 GEMMs only {gemms:8.1f} us ratio {us / gemms:5.2f}", flush=True)
            del experts
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe_h200.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--layers", nargs="+", default=[str(k) for k in LAYERS])
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--codebook", default="mcg")
    ap.add_argument("--stages", action="store_true", help="residual-stage variants (issue: additive stages)")
    ap.add_argument("--shared", action="store_true", help="add one shared expert of the routed width (as GLM-4.5)")
    ap.add_argument("--merge", action="store_true", help="keep the entries of --out that this run does not replace")
    a = ap.parse_args()
    save_results(a.out, main(a), RESULT_KEY, a.merge)
