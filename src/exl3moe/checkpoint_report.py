"""`exl3moe inspect`: a checkpoint described from its headers (layers, shapes, K, codebooks, sizes) and every
problem its completeness checks found."""

from __future__ import annotations

import re
from collections import Counter

from rich.console import Console
from rich.table import Table

from .format.checkpoint import EXPERT_RE, SHARED_EXPERT_NAMES, CheckpointReader, natural_key

LAYER_RE = re.compile(r"^(?P<layer>.*?\.layers\.\d+)\.(?P<rest>.+)$")
BAR_WIDTH = 20


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_k(K: float) -> str:
    return f"{K:g}"


def summarise(values: list) -> str:
    """'2.5' when uniform, else counts per value: '2.5 x12, 3 x4'."""
    counts = Counter(values)
    if len(counts) == 1:
        return str(next(iter(counts)))
    return ", ".join(f"{v} x{c}" for v, c in sorted(counts.items(), key=lambda vc: str(vc[0])))


def split_layer(key: str) -> tuple:
    """('model.layers.3', 'mlp.experts.*.gate_proj'): the layer and the projection group of a linear key."""
    m = LAYER_RE.match(key)
    layer, rest = (m["layer"], m["rest"]) if m else ("-", key)
    return layer, re.sub(r"\.experts\.\d+\.", ".experts.*.", rest)


def overview_table(reader: CheckpointReader) -> Table:
    qc = reader.config.get("quantization_config", {})
    linears = reader.linears()
    weights = sum(i.numel for i in linears)
    shards = sorted({reader.entry(k).shard for k in reader.keys()})
    linear_bytes = sum(i.stored_bytes for i in linears)
    table = Table(title="Checkpoint", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("path", reader.path)
    table.add_row("architecture", ", ".join(map(str, reader.config.get("architectures", []))) or "-")
    table.add_row("quantization", ", ".join(f"{k}={qc[k]}" for k in ("quant_method", "version", "bits",
                                                                          "head_bits", "codebook") if k in qc))
    table.add_row("shards", f"{len(shards)} ({', '.join(shards)})")
    table.add_row("tensors", str(len(reader.keys())))
    table.add_row("quantized linears", f"{len(linears)} ({weights} weights)")
    if weights:
        avg_k = sum(i.K * i.numel for i in linears) / weights
        with_scales = linear_bytes * 8 / weights
        table.add_row("average bits per weight", f"{avg_k:.3f} (trellis), {with_scales:.3f} (with scales)")
    table.add_row("total bytes", f"{reader.tensor_bytes} ({format_bytes(reader.tensor_bytes)})")
    table.add_row("quantized linear bytes", f"{linear_bytes} ({format_bytes(linear_bytes)})")
    table.add_row("other tensor bytes", format_bytes(reader.tensor_bytes - linear_bytes))
    return table


def linears_table(reader: CheckpointReader) -> Table:
    groups: dict = {}
    for info in reader.linears():
        groups.setdefault(split_layer(info.key), []).append(info)
    table = Table(title="Quantized linears per layer and projection")
    for name, justify in (("layer", "left"), ("projection", "left"), ("count", "right"), ("in x out", "right"),
                          ("K", "left"), ("codebook", "left"), ("trellis bytes", "right")):
        table.add_column(name, justify=justify, overflow="fold")
    order = sorted(groups, key=lambda lp: (lp[0] == "-", natural_key(lp[0]), natural_key(lp[1])))
    for layer, projection in order:
        infos = groups[(layer, projection)]
        shapes = summarise([f"{i.in_features}x{i.out_features}" for i in infos])
        table.add_row(layer, projection, str(len(infos)), shapes, summarise([format_k(i.K) for i in infos]),
                      summarise([i.codebook for i in infos]), str(sum(i.trellis_bytes for i in infos)))
    return table


def k_histogram(ks: list) -> str:
    """One line per K: the K, a bar scaled to the largest count, the count."""
    counts = Counter(ks)
    top = max(counts.values())
    lines = []
    for K in sorted(counts):
        bar = "#" * max(1, round(BAR_WIDTH * counts[K] / top))
        lines.append(f"K={format_k(K):<4} {bar} {counts[K]}")
    return "\n".join(lines)


def moe_table(reader: CheckpointReader) -> Table:
    by_prefix: dict = {}
    for info in reader.linears():
        m = EXPERT_RE.match(info.key)
        if m:
            by_prefix.setdefault(m["prefix"], []).append((int(m["index"]), m["proj"], info))
    table = Table(title="MoE layers: routed experts and expert widths (K)")
    for name in ("prefix", "experts", "hidden", "intermediate", "projections", "shared expert",
                 "K histogram (expert projections)"):
        table.add_column(name, overflow="fold")
    keys = [info.key for info in reader.linears()]
    for prefix in reader.moe_layers():
        members = by_prefix[prefix]
        up = next((info for _, proj, info in members if proj in ("up_proj", "w3")), None)
        shared = [name for name in SHARED_EXPERT_NAMES if any(k.startswith(f"{prefix}.{name}.") for k in keys)]
        projections = ", ".join(sorted({proj for _, proj, _ in members}))
        hidden, inter = (str(up.in_features), str(up.out_features)) if up else ("-", "-")
        table.add_row(prefix, str(len({i for i, _, _ in members})), hidden, inter,
                      projections, ", ".join(shared) or "no", k_histogram([info.K for _, _, info in members]))
    return table


def problems_table(reader: CheckpointReader) -> Table:
    count = len(reader.problems)
    table = Table(title=f"{count} problem{'s' if count > 1 else ''}: the checkpoint is incomplete or contradicts "
                  "itself", title_style="bold red")
    table.add_column("tensor", overflow="fold", style="red")
    table.add_column("problem", overflow="fold")
    for problem in reader.problems:
        table.add_row(problem.name, problem.rule)
    return table


def inspect_checkpoint(reader: CheckpointReader, console: Console) -> None:
    console.print(overview_table(reader))
    console.print(linears_table(reader))
    if reader.moe_layers():
        console.print(moe_table(reader))
    else:
        console.print("no routed-expert (MoE) layers")
    if reader.problems:
        console.print(problems_table(reader))
