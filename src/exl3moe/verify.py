"""`exl3moe verify`: every quantized linear and MoE layer of a checkpoint through this machine's kernels, each
row printed as it completes, against float64 evaluation of the same quantized weights."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from rich.console import Console

from . import reference
from .backends import CUDA, describe, device_backend, plan_backend
from .errors import ContractError, FormatError
from .format.checkpoint import EXPERT_RE, PROJECTIONS, CheckpointReader
from .ops.linear import linear_plan
from .ops.moe import moe_plan
from .ops.moe_module import EXL3MoE, activation_from_config
from .rows import LIMIT, RowPrinter, progress_bar, rel_l2, report_console
from .warmup import checkpoint_specs, moe_top_k, warm

LINEAR_ROWS = 4
MOE_TOKENS = 8


@dataclass
class VerifyResult:
    """What verify checked: rows run, linears covered, the worst error, rows over the limit, rows not checked."""

    rows: int = 0
    covered: set = field(default_factory=set)
    linears: int = 0
    worst: float = 0.0
    failed: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.rows > 0 and not self.failed and not self.skipped

    @property
    def exit_code(self) -> int:
        """0 pass, 1 a row over the limit, 2 a layer not checked (or nothing checked)."""
        return 0 if self.passed else 1 if self.failed else 2


def summarise_formats(weights) -> list:
    """["K/codebook"] when uniform, else ["K/codebook xCOUNT", ...]."""
    counts = Counter(f"{w.K:g}/{w.codebook}" for w in weights)
    if len(counts) == 1:
        return list(counts)
    return [f"{f} x{c}" for f, c in sorted(counts.items())]


def check_linear(reader: CheckpointReader, key: str, device, g: torch.Generator) -> tuple:
    """(cells, error, backend, linears covered) of one quantized linear on LINEAR_ROWS random rows."""
    w = reader.linear(key, device)
    x = torch.randn(LINEAR_ROWS, w.in_features, generator=g).half().to(device)
    plan = linear_plan(w, LINEAR_ROWS)
    y = plan.bind(plan.allocate()).run(x, torch.empty(LINEAR_ROWS, w.out_features, dtype=torch.float16, device=device))
    cells = (key, f"{w.in_features}x{w.out_features}", [f"{w.K:g}/{w.codebook}"])
    return cells, rel_l2(y, reference.linear(x, w)), plan_backend(plan), {key}


def _routed_by_router(reader, prefix: str, device, x: torch.Tensor) -> tuple:
    """(out, float64 reference, experts, shared, plans) of the layer as EXL3MoE runs it, routed by its router."""
    module = EXL3MoE.from_checkpoint(reader, prefix, device, max_tokens=x.shape[0], out_dtype=torch.float16)
    ids, weights = module.router(x)
    out = module(x)
    gated = module.shared_gate is not None
    ref = reference.moe(x, module.experts, ids, weights, shared=None if gated else module.shared)
    if gated:
        gate = torch.sigmoid(x.double() @ module.shared_gate.double())
        ref = ref + reference.moe(x, module.shared, torch.zeros_like(ids[:, :1]), gate)
    plans = [module.plan] + ([module.shared_plan] if gated else [])
    return out, ref, module.experts, module.shared, plans


def _routed_at_random(reader, prefix: str, device, x: torch.Tensor, g: torch.Generator) -> tuple:
    """The same for a layer without a router tensor: softmax top-k over random logits (top-k as warmup plans it)."""
    config = reader.config
    activation = activation_from_config(config) if "hidden_act" in config else "silu"
    experts = reader.experts(prefix, activation, device=device)
    shared = reader.shared_expert(prefix, activation, device=device)
    top_k = moe_top_k(config, experts.num_experts)
    logits = x.float() @ torch.randn(x.shape[1], experts.num_experts, generator=g).to(device)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    plan = moe_plan(experts, x.shape[0], top_k, shared, torch.float16)
    out = plan.bind(plan.allocate()).run(x, ids, weights, torch.empty_like(x))
    return out, reference.moe(x, experts, ids, weights, shared), experts, shared, [plan]


def hidden_size(reader: CheckpointReader, prefix: str) -> int:
    """The in-features of the layer's up projections (from headers)."""
    for info in reader.linears():
        m = EXPERT_RE.match(info.key)
        if m and m["prefix"] == prefix and PROJECTIONS[m["proj"]] == "up":
            return info.in_features
    raise FormatError(f"{prefix}.experts", "no up projection (up_proj or w3)")


def check_moe(reader: CheckpointReader, prefix: str, device, g: torch.Generator) -> tuple:
    """(cells, error, backend, linears covered) of one MoE layer on MOE_TOKENS random tokens."""
    routed = f"{prefix}.gate.weight" in reader
    x = (torch.randn(MOE_TOKENS, hidden_size(reader, prefix), generator=g) * 0.5).half().to(device)
    if routed:
        out, ref, experts, shared, plans = _routed_by_router(reader, prefix, device, x)
    else:
        out, ref, experts, shared, plans = _routed_at_random(reader, prefix, device, x, g)
    weights = [w for ws in experts.projections().values() for w in ws]
    shared_weights = [w for ws in shared.projections().values() for w in ws] if shared is not None else []
    backends = sorted({plan_backend(p) for p in plans})
    name = f"{prefix} (experts{'' if routed else ', random routing'})"
    shape = f"E{experts.num_experts}{'+1' if shared else ''} {experts.hidden_size}x{experts.intermediate_size}"
    cells = (name, shape, summarise_formats(weights + shared_weights))
    return cells, rel_l2(out, ref), "+".join(backends), {w.name for w in weights + shared_weights}


def work_items(reader: CheckpointReader) -> list:
    """[(check, name)]: every quantized linear outside routed experts, then every MoE layer."""
    experts = {info.key for info in reader.linears() if EXPERT_RE.match(info.key)}
    linears = [("linear", info.key) for info in reader.linears() if info.key not in experts]
    return linears + [("moe", prefix) for prefix in reader.moe_layers()]


def precompile(reader: CheckpointReader, device: torch.device, console: Console) -> None:
    """On a GPU that runs the CUDA C++ kernels: compile those the rows below need, in parallel, first."""
    if device.type != "cuda" or device_backend(device) != CUDA:
        return
    warm(checkpoint_specs(reader), device, console, linear_rows=LINEAR_ROWS, moe_tokens=(MOE_TOKENS,))


def verify_checkpoint(reader: CheckpointReader, device: torch.device, console: Console | None = None) -> VerifyResult:
    """Check every row; print each as it completes; return what was checked."""
    console = console or report_console()
    result = VerifyResult(linears=len(reader.linears()))
    console.print(f"exl3moe verify {reader.path}")
    console.print(f"kernels: {describe(device)}")
    console.print(f"compares: each quantized linear on {LINEAR_ROWS} random fp16 rows, each MoE layer on {MOE_TOKENS} "
                  "random fp16 tokens routed by its own router, against float64 evaluation of the same quantized "
                  f"weights; pass: relative L2 error < {LIMIT:g} in every row")
    items = work_items(reader)
    precompile(reader, device, console)
    printer = RowPrinter(console)
    printer.header()
    g = torch.Generator().manual_seed(0)
    with progress_bar(console) as progress:
        task = progress.add_task("verify", total=len(items))
        for check, name in items:
            progress.update(task, description=name.rsplit(".", 2)[0] if check == "linear" else name)
            start = time.perf_counter()
            try:
                cells, error, backend, covered = (check_linear if check == "linear" else check_moe)(
                    reader, name, device, g)
            except (FormatError, ContractError) as err:
                printer.error(name, err)
                result.skipped.append(name)
            else:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                result.rows += 1
                result.covered |= covered
                result.worst = max(result.worst, error)
                if not printer.row(*cells, backend, error, time.perf_counter() - start):
                    result.failed.append(name)
            progress.advance(task)
    report(result, reader, console)
    return result


def report(result: VerifyResult, reader: CheckpointReader, console: Console) -> None:
    """The verdict and what it covers; names every linear not checked."""
    missed = [i.key for i in reader.linears() if i.key not in result.covered]
    if missed and not result.skipped:
        result.skipped += missed
    what = f"{len(result.covered)} of {result.linears} quantized linears in {result.rows} rows"
    if result.passed:
        console.print(f"[green]PASS[/green] {what}; worst relative L2 error {result.worst:.2e} < {LIMIT:g}")
        return
    if result.rows == 0:
        console.print("[red]FAIL[/red] nothing was checked: the checkpoint holds no quantized linear")
    if result.failed:
        console.print(f"[red]FAIL[/red] {what}; {len(result.failed)} over the limit {LIMIT:g}: "
                      f"{', '.join(result.failed)}")
    if result.skipped:
        console.print(f"[red]FAIL[/red] {what}; not checked: {', '.join(result.skipped)}")
