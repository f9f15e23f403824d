"""`exl3moe demo`: a mixed-K MoE layer and a linear through this machine's kernels, each checked against float64."""

from __future__ import annotations

import time

import torch
from rich.console import Console

from . import reference
from .backends import CUDA, describe, device_backend, plan_backend
from .format.experts import ExpertSet
from .format.weight import EXL3Weight
from .ops.linear import linear_plan
from .ops.moe import moe_plan
from .rows import LIMIT, RowPrinter, rel_l2, report_console
from .warmup import MoESpec, Specs, WeightSpec, warm

DEMO_K = [2, 3, 4, 5, 6, 8, 2.5, 3.5]
DEMO_CODEBOOKS = ["mcg", "mul1", "3inst", "mcg", "mul1", "3inst", "mul1", "mul1"]


def random_weight(k: int, n: int, K: float, codebook: str, g: torch.Generator, device) -> EXL3Weight:
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), generator=g, dtype=torch.int32)
    sign = lambda m: torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(k) * (0.5 + torch.rand(k, generator=g))).half()
    svh = (sign(n) * (0.5 + torch.rand(n, generator=g))).half()
    return EXL3Weight(trellis.to(torch.int16), suh, svh, codebook).to(device)


def demo_layer(E: int, hidden: int, inter: int, g: torch.Generator, device) -> ExpertSet:
    """A random routed layer whose experts cycle through eight (K, codebook) pairs: one layer, mixed widths."""
    def proj(k, n):
        return [random_weight(k, n, DEMO_K[e % 8], DEMO_CODEBOOKS[e % 8], g, device) for e in range(E)]
    return ExpertSet(proj(hidden, inter), proj(hidden, inter), proj(inter, hidden), "silu", name="demo")


def route(hidden: torch.Tensor, E: int, top_k: int, g: torch.Generator):
    """Softmax router over random logits, top-k, renormalised."""
    logits = hidden.float() @ torch.randn(hidden.shape[1], E, generator=g).to(hidden.device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def precompile(experts: ExpertSet, top_k: int, tokens: int, console: Console) -> None:
    """On a GPU that runs the CUDA C++ kernels: compile the demo's variants in parallel before its rows."""
    if device_backend(experts.device) != CUDA:
        return
    spec = lambda w: WeightSpec(w.in_features, w.out_features, w.K, w.codebook)  # noqa: E731
    layer = MoESpec(*(tuple(map(spec, ws)) for ws in (experts.gate, experts.up, experts.down)), top_k=top_k)
    warm(Specs({spec(experts.down[0])}, {layer}), experts.device, console, linear_rows=tokens, moe_tokens=(tokens,))


def run_demo(device: torch.device, tokens: int = 9, console: Console | None = None) -> float:
    """Run a mixed-K MoE layer and one linear on `device`; print a row each; return the worst relative error."""
    console = console or report_console()
    g = torch.Generator().manual_seed(0)
    E, hidden, inter, top_k = 8, 256, 256, 2
    console.print(f"exl3moe demo on {device}: {describe(device)}")
    console.print(f"compares: {tokens} random fp16 tokens through a routed MoE layer whose 8 experts use 8 (K, "
                  f"codebook) formats, and through one linear, against float64 on the same quantized weights; "
                  f"pass: relative L2 error < {LIMIT:g}")
    experts = demo_layer(E, hidden, inter, g, device)
    precompile(experts, top_k, tokens, console)
    printer = RowPrinter(console)
    printer.header()
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).half().to(device)
    ids, weights = route(x, E, top_k, g)
    start = time.perf_counter()
    plan = moe_plan(experts, tokens, top_k, out_dtype=torch.float16)
    out = plan.bind(plan.allocate()).run(x, ids, weights, torch.empty_like(x))
    moe_s = time.perf_counter() - start
    mix = [f"{k:g}/{cb}" for k, cb in zip(DEMO_K, DEMO_CODEBOOKS)]
    moe_err = rel_l2(out, reference.moe(x, experts, ids, weights))
    printer.row(f"routed MoE, silu, top-{top_k}", f"E{E} {hidden}x{inter}", mix, plan_backend(plan), moe_err, moe_s)
    w = experts.down[0]
    xl = torch.randn(tokens, w.in_features, generator=g).half().to(device)
    start = time.perf_counter()
    lin = linear_plan(w, tokens)
    y = lin.bind(lin.allocate()).run(xl, torch.empty(tokens, w.out_features, dtype=torch.float16, device=device))
    lin_s = time.perf_counter() - start
    lin_err = rel_l2(y, reference.linear(xl, w))
    printer.row("linear", f"{w.in_features}x{w.out_features}", [f"{w.K:g}/{w.codebook}"], plan_backend(lin),
                lin_err, lin_s)
    worst = max(moe_err, lin_err)
    verdict = "[green]PASS[/green]" if worst < LIMIT else "[red]FAIL[/red]"
    console.print(f"{verdict} worst relative L2 error {worst:.2e} (limit {LIMIT:g}); ms include planning and, on a "
                  "cold cache, kernel compilation")
    return worst
