"""quantize_model: a Hugging Face checkpoint -> an EXL3 checkpoint, one decoder layer at a time.

Per layer: read its tensors, run it on the calibration states collecting each linear's Hessian, quantize every
linear (routed experts at per-expert widths when `expert_bits` is given), put the decoded weights back and run the
layer again, so the next layer calibrates on what the quantized model computes; write the layer's shard and the
progress marker. The embeddings, final norm and lm_head (at head_bits) are the last shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ContractError
from ..format.weight import EXL3Weight
from ..quant import quantize_weights
from ..quant.checks import check_rate
from .allocate import allocate_widths, check_budget
from .calibration import DEFAULT_MIN_ROWS, LayerCalibration, calibration_tokens, run_layer
from .source import HFSource, check_source, linear_modules, moe_blocks
from .writer import OutputFolder

EXPERT_NAMES = {"mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}
DEFAULT_EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
ROLES = ("gate", "up", "down")


@dataclass
class ConvertReport:
    """Per unit (decoder layer, then 'head'): K, proxy error, seconds, regularised experts; and the totals."""

    rows: list = field(default_factory=list)
    resumed: list = field(default_factory=list)     # units found finished and not redone
    regularised_experts: int = 0
    allocations: dict = field(default_factory=dict)  # block key -> K [E, 3]


def check_options(bits, head_bits, codebook, expert_bits, rows) -> None:
    check_rate(bits, codebook)
    check_rate(head_bits, codebook)
    if expert_bits is not None:
        check_budget(expert_bits, codebook)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ContractError("rows", f"must be a positive number of calibration tokens, got {rows!r}")


def quantize_model(in_dir, out_dir, bits: float = 4, head_bits: float = 6, codebook: str = "mcg",
                   calibration: str = "random", rows: int = 2048, expert_bits: float | None = None, device=None,
                   force: bool = False, seed: int = 0, min_rows: int = DEFAULT_MIN_ROWS, on_unit=None,
                   log=print, **encode_options) -> ConvertReport:
    """Convert the checkpoint in `in_dir` into `out_dir` (see the module doc); every refusal comes before any write.

    on_unit(unit, row) is called after each unit is written (a unit is a layer index, or the head after the last).
    encode_options go to quantize_weights (e.g. exact=False)."""
    check_options(bits, head_bits, codebook, expert_bits, rows)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    source = HFSource(in_dir)
    check_source(source)
    options = {"source": str(source.path), "bits": bits, "head_bits": head_bits, "codebook": codebook,
               "calibration": calibration, "rows": rows, "expert_bits": expert_bits, "seed": seed,
               "min_rows": min_rows, "encode": {k: encode_options[k] for k in sorted(encode_options)}}
    tokens = calibration_tokens(calibration, source.path, rows, source.model.config.vocab_size, seed)
    folder = OutputFolder(out_dir, options, source.num_layers + 1, force)
    job = _Job(source, folder, device, bits, head_bits, codebook, expert_bits, seed, min_rows, encode_options, log)
    states = folder.states()
    if states is None:
        embed = source.fill("model.embed_tokens", device)
        states = embed(tokens.to(device)).to("cpu", torch.float32)
        source.release("model.embed_tokens")
    for unit in range(source.num_layers + 1):
        if folder.done(unit):
            job.report.resumed.append(unit)
            job.report.rows.append(folder.summary(unit))
            continue
        states = job.layer(unit, states) if unit < source.num_layers else job.head(states)
        if on_unit is not None:
            on_unit(unit, job.report.rows[-1])
    folder.finish(source.config, source.path, codebook)
    return job.report


class _Job:
    def __init__(self, source, folder, device, bits, head_bits, codebook, expert_bits, seed, min_rows,
                 encode_options, log):
        self.source, self.folder, self.device = source, folder, device
        self.bits, self.head_bits, self.codebook, self.expert_bits = bits, head_bits, codebook, expert_bits
        self.seed, self.min_rows, self.encode, self.log = seed, min_rows, encode_options, log
        self.report = ConvertReport()
        self.rotary = source.rotary(device)

    def _encode(self, Ws: list, Hs: list, K: float, seed: int, names: list) -> list:
        return quantize_weights(Ws, Hs, K, self.codebook, seed, self.device, names=names, **self.encode)

    def layer(self, i: int, states: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        prefix = f"model.layers.{i}"
        layer = self.source.fill(prefix, self.device)
        cal = LayerCalibration(layer, self.device)
        run_layer(layer, states, self.rotary, self.device)
        cal.remove()
        linears, errors, widths = {}, [], []
        for name, module in linear_modules(layer).items():
            key = self.source.stored(f"{prefix}.{name}")
            H = cal.linears[name].hessian()
            (weight, stats), = self._encode([module.weight.T], [H], self.bits, self.seed + 1000 * i + len(linears),
                                            [key])
            weight = _with_bias(weight, module.bias)
            linears[key] = weight
            errors.append(stats.proxy_error)
            widths.append((self.bits, module.weight.numel()))
            module.weight.data = weight.dense(torch.float32).T.to(module.weight.dtype)
        regularised = 0
        for name, block in moe_blocks(layer).items():
            block_key = self.source.stored(f"{prefix}.{name}")
            regularised += self._experts(block, block_key, cal.experts[name], linears, errors, widths, i)
        tensors = self._plain(layer, prefix, linears)
        states = run_layer(layer, states, self.rotary, self.device)
        self.source.release(prefix)
        row = {"unit": f"layer {i}", "K": round(sum(k * n for k, n in widths) / sum(n for _, n in widths), 3),
               "proxy_error": sum(errors) / len(errors), "seconds": time.perf_counter() - start,
               "regularised_experts": regularised}
        self.report.regularised_experts += regularised
        self.report.rows.append(row)
        self.folder.write_unit(i, linears, tensors, row, states)
        self.log(f"layer {i + 1}/{self.source.num_layers}: K {row['K']:g}, proxy error {row['proxy_error']:.3g}, "
                 f"{row['seconds']:.1f} s")
        return states

    def _experts(self, block, block_key, cal, linears, errors, widths, i) -> int:
        experts = block.experts
        E, two_i, hidden = experts.gate_up_proj.shape
        inter = two_i // 2
        hessians = [cal.hessians(e, self.min_rows) for e in range(E)]
        if self.expert_bits is None:
            K = torch.full((E, 3), float(self.bits), dtype=torch.float64)
        else:
            sizes = torch.tensor([hidden * inter] * 3, dtype=torch.float64)
            K = allocate_widths(cal.importance, sizes, self.expert_bits, self.codebook)
        self.report.allocations[block_key] = K
        names = EXPERT_NAMES.get(self.source.model_type, DEFAULT_EXPERT_NAMES)
        gate_up = experts.gate_up_proj.data
        weights = {"gate": lambda e: gate_up[e, :inter].T, "up": lambda e: gate_up[e, inter:].T,
                   "down": lambda e: experts.down_proj.data[e].T}
        for p, role in enumerate(ROLES):
            for k in sorted(set(K[:, p].tolist())):
                members = [e for e in range(E) if K[e, p] == k]
                keys = [f"{block_key}.experts.{e}.{names[role]}" for e in members]
                Hs = [hessians[e][0 if role != "down" else 1] for e in members]
                results = self._encode([weights[role](e) for e in members], Hs, k,
                                       self.seed + 1000 * i + 100 * p + members[0], keys)
                for e, key, (weight, stats) in zip(members, keys, results):
                    linears[key] = weight
                    errors.append(stats.proxy_error)
                    widths.append((k, hidden * inter))
                    dense = weight.dense(torch.float32).T.to(gate_up.dtype)
                    if role == "gate":
                        gate_up[e, :inter] = dense
                    elif role == "up":
                        gate_up[e, inter:] = dense
                    else:
                        experts.down_proj.data[e] = dense
        return len(cal.regularised)

    def _plain(self, layer: nn.Module, prefix: str, linears: dict) -> dict:
        """Every layer tensor that is not part of a quantized linear or the experts, as stored in the input."""
        tensors = {}
        for sub_name, sub in layer.named_modules():
            full = f"{prefix}.{sub_name}" if sub_name else prefix
            stored = self.source.stored(full)
            if stored in linears or full.endswith(".experts"):
                continue
            for leaf in list(sub._parameters) + [b for b in sub._buffers if b not in sub._non_persistent_buffers_set]:
                if getattr(sub, leaf, None) is not None:
                    tensors[f"{stored}.{leaf}"] = self.source.files.tensor(f"{stored}.{leaf}")
        return tensors

    def head(self, states: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        source = self.source
        tensors = {key: source.files.tensor(key) for key in ("model.embed_tokens.weight", "model.norm.weight")}
        linears, row = {}, {"unit": "head", "K": None, "proxy_error": None, "seconds": 0.0, "regularised_experts": 0}
        if not source.tied():
            norm = source.fill("model.norm", self.device)
            head = source.fill("lm_head", self.device)
            x = norm(states.to(self.device)).reshape(-1, states.shape[-1]).float()
            H = (x.T @ x).double() / x.shape[0]
            (weight, stats), = self._encode([head.weight.T], [H], self.head_bits, self.seed + 999_999, ["lm_head"])
            linears["lm_head"] = _with_bias(weight, head.bias)
            row.update(K=self.head_bits, proxy_error=stats.proxy_error)
            source.release("model.norm")
            source.release("lm_head")
        row["seconds"] = time.perf_counter() - start
        self.report.rows.append(row)
        self.folder.write_unit(source.num_layers, linears, tensors, row, None)
        return states


def _with_bias(weight: EXL3Weight, bias) -> EXL3Weight:
    if bias is None:
        return weight
    return EXL3Weight(weight.trellis, weight.suh, weight.svh, weight.codebook, bias.detach().to(weight.trellis.device, torch.float16),
                      weight.name)
