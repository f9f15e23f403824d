"""`exl3moe demo` and `exl3moe verify`: run layers through the fastest path here and check them against float64."""

from __future__ import annotations

import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from . import reference
from .format.experts import ExpertSet
from .format.weight import EXL3Weight
from .kernels.trellis_decode import interpreting
from .ops.linear import linear
from .ops.moe import fused_experts

DEMO_K = [2, 3, 4, 5, 6, 8, 2.5, 3.5]
DEMO_CODEBOOKS = ["mcg", "mul1", "3inst", "mcg", "mul1", "3inst", "mul1", "mul1"]


def path_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"Triton on {torch.cuda.get_device_name(device)}"
    return "Triton interpreter (CPU)" if interpreting() else "torch (CPU, fp32)"


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


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def report_console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=140)


def run_demo(device: str | None = None, tokens: int = 9, console: Console | None = None) -> float:
    """Run a mixed-K MoE layer and one linear; print a report; return the worst relative error."""
    console = console or report_console()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(0)
    E, hidden, inter, top_k = 8, 256, 256, 2
    experts = demo_layer(E, hidden, inter, g, dev)
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).half().to(dev)
    ids, weights = route(x, E, top_k, g)
    start = time.perf_counter()
    out = fused_experts(x, experts, ids, weights)
    moe_s = time.perf_counter() - start
    moe_err = rel_l2(out, reference.moe(x, experts, ids, weights))
    w = experts.down[0]
    xl = torch.randn(tokens, w.in_features, generator=g).half().to(dev)
    start = time.perf_counter()
    y = linear(xl, w)
    lin_s = time.perf_counter() - start
    lin_err = rel_l2(y, reference.linear(xl, w))
    table = Table(title=f"exl3moe demo: {path_name(dev)}")
    for col in ("op", "shape", "K / codebook", "rel. L2 vs float64", "limit", "wall time"):
        table.add_column(col)
    mix = ", ".join(f"{k:g}/{cb}" for k, cb in zip(DEMO_K, DEMO_CODEBOOKS))
    table.add_row("routed MoE (silu)", f"T={tokens} H={hidden} I={inter} E={E} top-{top_k}", mix,
                  f"{moe_err:.2e}", "2e-3", f"{moe_s * 1e3:.0f} ms")
    table.add_row("linear", f"{tokens}x{w.in_features} @ {w.in_features}x{w.out_features}",
                  f"{w.K:g}/{w.codebook}", f"{lin_err:.2e}", "2e-3", f"{lin_s * 1e3:.0f} ms")
    console.print(table)
    worst = max(moe_err, lin_err)
    console.print("[green]PASS[/green]" if worst < 2e-3 else "[red]FAIL[/red]", f"worst error {worst:.2e}")
    return worst


def verify_checkpoint(reader, device: str | None = None, rows: int = 4, console: Console | None = None) -> float:
    """Run every quantized linear and every MoE layer of a checkpoint against float64; return the worst error."""
    console = console or report_console()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(0)
    table = Table(title=f"exl3moe verify: {path_name(dev)}")
    for col in ("module", "shape", "K / codebook", "rel. L2 vs float64"):
        table.add_column(col)
    worst = 0.0
    for info in reader.linears():
        if ".experts." in info.key:
            continue
        w = reader.linear(info.key).to(dev)
        x = torch.randn(rows, w.in_features, generator=g).half().to(dev)
        err = rel_l2(linear(x, w), reference.linear(x, w))
        worst = max(worst, err)
        table.add_row(info.key, f"{w.in_features}x{w.out_features}", f"{w.K:g}/{w.codebook}", f"{err:.2e}")
    for prefix in reader.moe_layers():
        experts = reader.experts(prefix).to(dev)
        x = (torch.randn(rows * 2, experts.hidden_size, generator=g) * 0.5).half().to(dev)
        ids, weights = route(x, experts.num_experts, min(4, experts.num_experts), g)
        err = rel_l2(fused_experts(x, experts, ids, weights), reference.moe(x, experts, ids, weights))
        worst = max(worst, err)
        ks = sorted({f"{w.K:g}/{w.codebook}" for ws in experts.projections().values() for w in ws})
        table.add_row(f"{prefix} (experts)", f"E={experts.num_experts} H={experts.hidden_size} "
                      f"I={experts.intermediate_size}", ", ".join(ks), f"{err:.2e}")
    console.print(table)
    console.print("[green]PASS[/green]" if worst < 2e-3 else "[red]FAIL[/red]", f"worst error {worst:.2e}")
    return worst
