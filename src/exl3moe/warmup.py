"""`exl3moe warmup [PATH]`: compile the CUDA C++ kernels a checkpoint's layers need (or a default set's) into the
disk cache, in parallel, so that no first call waits for NVRTC.

Plans are made on this GPU for placeholder weights of each layer's shapes and formats (the variants a plan compiles
depend on those, never on the weights' values), with nvrtc.kernel noting each variant instead of compiling it; the
variants not yet cached are then compiled in worker processes (NVRTC needs no GPU)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import itertools
import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console

from .format.checkpoint import EXPERT_RE, PROJECTIONS, SHARED_EXPERT_NAMES, CheckpointReader
from .format.experts import ExpertSet
from .format.weight import EXL3Weight
from .kernels import nvrtc
from .ops.linear import LinearPlan
from .ops.moe_module import EXL3MoE, activation_from_config
from .ops.router import Router
from .rows import progress_bar

CACHE_DOC = ("EXL3MOE_CACHE_DIR, default $XDG_CACHE_HOME/exl3moe/cubins or ~/.cache/exl3moe/cubins; entries are "
             "keyed by kernel source, options, GPU architecture and NVRTC version")
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
LINEAR_ROWS = 256   # a plan above 128 rows compiles every fused row count's kernels and the dense path's
DEFAULT_TOP_K = 8
DEFAULT_KS = (2, 3, 4, 5, 6)
DEFAULT_CODEBOOK = "mul1"   # exllamav3's converter default
SHARED_PROJECTIONS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class WeightSpec:
    """What a plan reads of a weight: shape, K, codebook, whether it has a bias."""

    k: int
    n: int
    K: float
    codebook: str
    bias: bool = False


@dataclass(frozen=True)
class MoESpec:
    """A routed layer's per-expert formats (gate None when ungated), activation, top-k and shared expert."""

    gate: tuple | None
    up: tuple
    down: tuple
    activation: str = "silu"
    top_k: int = DEFAULT_TOP_K
    shared: tuple | None = None   # (gate, up, down) WeightSpecs of the one shared expert
    shared_gated: bool = False


@dataclass
class Specs:
    """The layers to compile for, deduplicated."""

    linears: set = field(default_factory=set)
    moes: set = field(default_factory=set)

    def describe(self) -> str:
        return f"{len(self.linears)} distinct linear(s) and {len(self.moes)} distinct MoE layer(s)"


def nvrtc_problem() -> str | None:
    """Why NVRTC cannot compile here, in one line; None when it can."""
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-bindings is not installed, so NVRTC cannot compile here: pip install 'exl3moe[cuda]'"
    try:
        nvrtc.nvrtc_version()
    except Exception as err:  # noqa: BLE001 (the loader's own error types vary by cuda-bindings version)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"the NVRTC library cannot be loaded ({first}): install the CUDA toolkit or nvidia-cuda-nvrtc"
    return None


def _spec(reader: CheckpointReader, info) -> WeightSpec:
    return WeightSpec(info.in_features, info.out_features, info.K, info.codebook, f"{info.key}.bias" in reader)


def moe_top_k(config: dict, experts: int) -> int:
    """config's num_experts_per_tok, or DEFAULT_TOP_K (at most `experts`) where it has none."""
    value = config.get("num_experts_per_tok")
    return value if isinstance(value, int) and 1 <= value <= experts else min(DEFAULT_TOP_K, experts)


def checkpoint_specs(reader: CheckpointReader) -> Specs:
    """Every quantized linear outside routed experts and every MoE layer of a checkpoint, from its headers."""
    config = reader.config
    activation = activation_from_config(config) if "hidden_act" in config else "silu"
    specs, routed = Specs(), {}
    for info in reader.linears():
        m = EXPERT_RE.match(info.key)
        if m:
            routed.setdefault(m["prefix"], {}).setdefault(int(m["index"]), {})[PROJECTIONS[m["proj"]]] = \
                _spec(reader, info)
        else:
            specs.linears.add(_spec(reader, info))
    infos = {info.key: info for info in reader.linears()}
    for prefix, experts in routed.items():
        order = [experts[e] for e in sorted(experts)]
        gate = tuple(e["gate"] for e in order) if all("gate" in e for e in order) else None
        shared, gated = None, f"{prefix}.shared_expert_gate.weight" in reader
        for name, projections in itertools.product(SHARED_EXPERT_NAMES, SHARED_PROJECTIONS):
            keys = [f"{prefix}.{name}.{p}" for p in projections]
            if keys[1] in infos and keys[2] in infos:
                shared = tuple(_spec(reader, infos[key]) if key in infos else None for key in keys)
        specs.moes.add(MoESpec(gate, tuple(e["up"] for e in order), tuple(e["down"] for e in order), activation,
                               moe_top_k(config, len(order)), shared, gated and shared is not None))
    return specs


def default_specs() -> Specs:
    """Qwen3-30B-A3B's layers (attention, 128 experts of 2048x768, top-8, lm_head) and Llama-3-8B's linears, at
    K = 2..6 with exllamav3's default codebook."""
    specs = Specs()
    for K in DEFAULT_KS:
        for k, n in ((2048, 4096), (2048, 512), (4096, 2048), (4096, 4096), (4096, 1024), (4096, 14336),
                     (14336, 4096)):
            specs.linears.add(WeightSpec(k, n, K, DEFAULT_CODEBOOK))
        up = (WeightSpec(2048, 768, K, DEFAULT_CODEBOOK),) * 128
        specs.moes.add(MoESpec(up, up, (WeightSpec(768, 2048, K, DEFAULT_CODEBOOK),) * 128))
    specs.linears.add(WeightSpec(2048, 151936, 6, DEFAULT_CODEBOOK))
    return specs


class _Placeholders:
    """Zero-trellis, unit-scale weights per WeightSpec on one device, shared between the experts that use them."""

    def __init__(self, device: torch.device):
        self.device, self.weights = device, {}

    def __call__(self, spec: WeightSpec | None) -> EXL3Weight | None:
        if spec is None:
            return None
        if spec not in self.weights:
            ones = lambda m: torch.ones(m, dtype=torch.float16, device=self.device)  # noqa: E731
            trellis = torch.zeros(spec.k // 16, spec.n // 16, int(16 * spec.K), dtype=torch.int16, device=self.device)
            self.weights[spec] = EXL3Weight(trellis, ones(spec.k), ones(spec.n), spec.codebook,
                                            ones(spec.n) if spec.bias else None)
        return self.weights[spec]


def _moe_module(spec: MoESpec, weight: _Placeholders, max_tokens: int) -> EXL3MoE:
    """The layer as EXL3MoE plans it (router and shared gate of zeros: routing does not change a plan)."""
    gate = [weight(s) for s in spec.gate] if spec.gate is not None else None
    experts = ExpertSet(gate, [weight(s) for s in spec.up], [weight(s) for s in spec.down], spec.activation)
    shared = None
    if spec.shared is not None:
        g, u, d = (weight(s) for s in spec.shared)
        shared = ExpertSet([g] if g is not None else None, [u], [d], spec.activation)
    zeros = lambda *shape: torch.zeros(*shape, device=weight.device)  # noqa: E731
    router = Router(zeros(experts.num_experts, experts.hidden_size), spec.top_k)
    shared_gate = zeros(experts.hidden_size) if spec.shared_gated else None
    return EXL3MoE(experts, router, shared, shared_gate, max_tokens)


@contextlib.contextmanager
def noting_variants():
    """While active, nvrtc.kernel notes each variant asked for ({key: entry}) and compiles nothing."""
    noted: dict = {}
    saved = nvrtc.kernel, nvrtc.local_bytes, nvrtc.allow_non_portable_clusters

    def note(file, name, defines, device_index, prelude="", arch_suffix=""):
        entry = nvrtc.variant_entry(file, defines, device_index, prelude, arch_suffix)
        noted[json.dumps(entry, sort_keys=True)] = entry
        return ("noted", file, name)

    nvrtc.kernel = note
    nvrtc.local_bytes = lambda func: 1   # note both variants where a bound might spill
    nvrtc.allow_non_portable_clusters = lambda func: None
    try:
        yield noted
    finally:
        nvrtc.kernel, nvrtc.local_bytes, nvrtc.allow_non_portable_clusters = saved


def variants(specs: Specs, device: torch.device, linear_rows: int = LINEAR_ROWS,
             moe_tokens: tuple = MOE_TOKENS) -> list:
    """The kernel variants plans on `device` compile for these layers (linears planned for `linear_rows` rows, MoE
    layers for each of `moe_tokens` tokens)."""
    weight = _Placeholders(device)
    with noting_variants() as noted:
        for spec in sorted(specs.linears, key=repr):
            LinearPlan(weight(spec), linear_rows)
        for spec in specs.moes:
            for tokens in moe_tokens:
                _moe_module(spec, weight, tokens)
    return list(noted.values())


def _text(entry: dict) -> str:
    return entry["prelude"] + nvrtc.source(entry["file"])


def cached(entry: dict) -> bool:
    path = nvrtc.cubin_path(_text(entry), entry["defines"], entry["arch"])
    return path is not None and os.path.isfile(path) and os.path.getsize(path) > 0


def compile_entry(entry: dict) -> None:
    """Compile one variant into the cache (run in a worker process)."""
    nvrtc.cached_cubin(_text(entry), entry["defines"], entry["arch"])


def compile_all(entries: list, workers: int, console: Console, compile_one=compile_entry) -> None:
    """Compile `entries` over `workers` processes (in this one for 1), advancing a progress bar per variant."""
    with progress_bar(console) as progress:
        task = progress.add_task(f"compiling CUDA kernels ({workers} workers)", total=len(entries))
        if workers <= 1 or len(entries) <= 1:
            for entry in entries:
                compile_one(entry)
                progress.advance(task)
            return
        context = multiprocessing.get_context("spawn")   # no CUDA state in the workers
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(entries)), mp_context=context) as pool:
            for future in concurrent.futures.as_completed([pool.submit(compile_one, e) for e in entries]):
                future.result()
                progress.advance(task)


def warm(specs: Specs, device: torch.device, console: Console, workers: int | None = None,
         linear_rows: int = LINEAR_ROWS, moe_tokens: tuple = MOE_TOKENS) -> dict:
    """Note the variants these layers need on `device`, compile the uncached ones, print and return a summary."""
    workers = workers or os.cpu_count() or 1
    start = time.perf_counter()
    entries = variants(specs, device, linear_rows, moe_tokens)
    todo = [entry for entry in entries if not cached(entry)]
    planned = time.perf_counter()
    compile_all(todo, workers, console)
    for entry in entries:
        nvrtc.record_variant(entry["file"], entry["defines"], entry["prelude"], entry["arch"])
    summary = {"variants": len(entries), "compiled": len(todo), "cached": len(entries) - len(todo),
               "workers": workers, "plan_s": planned - start, "compile_s": time.perf_counter() - planned,
               "cache_dir": nvrtc.cache_dir()}
    console.print(f"CUDA kernels for {specs.describe()}: {summary['variants']} variants, {summary['compiled']} "
                  f"compiled in {summary['compile_s']:.1f} s over {min(workers, max(1, len(todo)))} processes, "
                  f"{summary['cached']} already cached in {summary['cache_dir']}")
    return summary
