"""Residual stages: a target model's routed experts as an EXL3 base plus scaled residual trellises.

Stage s of projection p of expert e holds R with the base's suh/svh (the kernels share them) and a scale c, so the
expert computes diag(suh) Hk (W_inner + sum_s c_s R_inner,s) Hn diag(svh). Each stage quantizes what is left,
D = W_target - W_base - earlier stages, in the base's rotated basis: c = RMS(Hk diag(1/suh) D diag(1/svh) Hn) / RMS
of the codebook, and D / c is encoded with the base's scales fixed (no refit, unweighted error). A residual whose
relative size ||D|| / ||W_target|| is below `negligible` gets scale 0 and no trellis: the kernels skip it.

The stage file (safetensors, docs/convert.md): `<prefix>.stages.<s>.<gate|up|down>.<e>.trellis` (int16, present
only where the scale is nonzero) and `<prefix>.stages.<s>.scales` (float32 [E, 3]); metadata `format` =
`exl3moe-stages`, `abi_version` = the tables' ABI version, `stage_bits`, `codebook`, `stages`, `layers`.
`read_stages(path, prefix, experts)` gives the ResidualStages that `MoEPlan.load_stages` takes.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import ContractError, FormatError
from ..format.checkpoint import PROJECTIONS, open_checkpoint
from ..format.codebook import codebook_table
from ..format.experts import ExpertSet, ResidualStage
from ..format.weight import EXL3Weight
from ..ops.tables import MOE_ADDITIVE_ABI_VERSION
from ..quant import quantize_weights
from ..quant.checks import check_rate
from ..quant.rotation import rotate
from .source import SafetensorsFolder, read_config

STAGE_FORMAT = "exl3moe-stages"
ROLES = ("gate", "up", "down")
DEFAULT_NEGLIGIBLE = 1e-4


def _role_keys(reader, prefix: str) -> dict:
    """{(e, role): base module key} of the routed experts at `prefix`."""
    keys = {}
    for info in reader.linears():
        head, _, proj = info.key.rpartition(".")
        if head.startswith(f"{prefix}.experts.") and proj in PROJECTIONS:
            keys[(int(head.rsplit(".", 1)[1]), PROJECTIONS[proj])] = info.key
    return keys


def plan_stages(base_dir, target_dir) -> tuple:
    """(base reader, target tensors, {prefix: {(e, role): key}}) after every refusal: a target of another
    architecture, a tensor missing from the target, a shape that differs."""
    reader = open_checkpoint(base_dir)
    target_config = read_config(os.fspath(target_dir))
    if target_config.get("model_type") != reader.config.get("model_type"):
        raise FormatError("config.json:model_type", f"target is {target_config.get('model_type')!r}, base is "
                          f"{reader.config.get('model_type')!r}")
    target = SafetensorsFolder(os.fspath(target_dir))
    layers = {}
    for prefix in reader.moe_layers():
        keys = _role_keys(reader, prefix)
        for key in keys.values():
            info = next(i for i in reader.linears() if i.key == key)
            if f"{key}.weight" not in target:
                raise FormatError(f"{key}.weight", f"missing from the target {target_dir}")
            shape = target.shape(f"{key}.weight")
            if shape != [info.out_features, info.in_features]:
                raise FormatError(f"{key}.weight", f"target shape {shape} differs from the base's "
                                  f"[{info.out_features}, {info.in_features}] ([out, in])")
        layers[prefix] = keys
    if not layers:
        raise FormatError(os.fspath(base_dir), "holds no routed experts: stages are per expert")
    return reader, target, layers


def make_stages(base_dir, target_dir, out_path, stage_bits: float = 2, stages: int = 1, codebook: str = "mcg",
                negligible: float = DEFAULT_NEGLIGIBLE, device=None, force: bool = False, seed: int = 0,
                **encode_options) -> dict:
    """Write the stage file; returns {prefix: [relative weight error before, after 1 stage, after 2, ...]}."""
    check_rate(stage_bits, codebook)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ContractError("stages", f"must be a positive int, got {stages!r}")
    out_path = os.fspath(out_path)
    if os.path.exists(out_path) and not force:
        raise ContractError(out_path, "exists; pass --force to overwrite it")
    reader, target, layers = plan_stages(base_dir, target_dir)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    spread = float(codebook_table(codebook).double().std())
    tensors, errors = {}, {}
    for prefix, keys in layers.items():
        E = 1 + max(e for e, _ in keys)
        bases = {k: reader.linear(key, device) for k, key in keys.items()}
        goal = {k: target.tensor(f"{key}.weight").to(device, torch.float64).T for k, key in keys.items()}
        approx = {k: w.dense(torch.float64) for k, w in bases.items()}
        norm = sum(float(g.square().sum()) for g in goal.values()) ** 0.5
        history = [_relative(goal, approx, norm)]
        for s in range(stages):
            scales = torch.zeros(E, 3, dtype=torch.float32)
            for p, role in enumerate(ROLES):
                members = [e for e in range(E) if (e, role) in keys]
                for e, weight in _stage(members, role, bases, goal, approx, stage_bits, codebook, spread,
                                        negligible, scales, p, seed + 100 * s + 10 * p, device, encode_options):
                    tensors[f"{prefix}.stages.{s}.{role}.{e}.trellis"] = weight.trellis.cpu()
                    approx[(e, role)] = approx[(e, role)] + float(scales[e, p]) * weight.dense(torch.float64)
            tensors[f"{prefix}.stages.{s}.scales"] = scales
            history.append(_relative(goal, approx, norm))
        errors[prefix] = history
    from safetensors.torch import save_file

    meta = {"format": STAGE_FORMAT, "abi_version": str(MOE_ADDITIVE_ABI_VERSION), "stage_bits": str(stage_bits),
            "codebook": codebook, "stages": str(stages), "layers": json.dumps(list(layers))}
    save_file({k: t.contiguous() for k, t in tensors.items()}, out_path, metadata=meta)
    return errors


def _relative(goal: dict, approx: dict, norm: float) -> float:
    return sum(float((goal[k] - approx[k]).square().sum()) for k in goal) ** 0.5 / norm if norm else 0.0


def _stage(members, role, bases, goal, approx, K, codebook, spread, negligible, scales, p, seed, device, options):
    """[(e, residual EXL3Weight)] for the experts whose residual is not negligible; scales[e, p] set for them."""
    jobs = []
    for e in members:
        D = goal[(e, role)] - approx[(e, role)]
        size = float(D.norm()) / max(float(goal[(e, role)].norm()), 1e-30)
        if size < negligible:
            continue
        base = bases[(e, role)]
        c = float(rotate(D, base.suh.double(), base.svh.double()).square().mean().sqrt()) / spread
        scales[e, p] = c
        jobs.append((e, D / c, base))
    if not jobs:
        return []
    inits = [_zero_like(base, K, codebook) for _, _, base in jobs]
    results = quantize_weights([D for _, D, _ in jobs], None, K, codebook, seed, device, inits=inits, refit=False,
                               **options)
    return [(e, weight) for (e, _, _), (weight, _) in zip(jobs, results)]


def _zero_like(base: EXL3Weight, K: float, codebook: str) -> EXL3Weight:
    """A weight on the base's suh/svh with an all-zero trellis of width K: the encoder keeps its scales."""
    trellis = torch.zeros(base.in_features // 16, base.out_features // 16, int(16 * K), dtype=torch.int16,
                          device=base.trellis.device)
    return EXL3Weight(trellis, base.suh, base.svh, codebook, None, "stage")


def read_stages(path, prefix: str, experts: ExpertSet) -> list:
    """The ResidualStages of layer `prefix` for its base ExpertSet (their suh/svh are the base's own tensors)."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != STAGE_FORMAT:
            raise FormatError(os.fspath(path), f"is not an exl3moe stage file (metadata format {meta.get('format')!r})")
        if meta.get("abi_version") != str(MOE_ADDITIVE_ABI_VERSION):
            raise FormatError(os.fspath(path), f"abi_version {meta.get('abi_version')!r}, this library reads "
                                               f"{MOE_ADDITIVE_ABI_VERSION}")
        codebook, keys = meta["codebook"], set(f.keys())
        out = []
        for s in range(int(meta["stages"])):
            name = f"{prefix}.stages.{s}.scales"
            if name not in keys:
                raise FormatError(name, f"missing from {path}: layers are {meta.get('layers')}")
            scales = f.get_tensor(name)
            lists = {}
            for role in ROLES:
                bases = getattr(experts, role)
                if bases is None:
                    continue
                lists[role] = [None if f"{prefix}.stages.{s}.{role}.{e}.trellis" not in keys else
                               EXL3Weight(f.get_tensor(f"{prefix}.stages.{s}.{role}.{e}.trellis").to(b.device),
                                          b.suh, b.svh, codebook, None, f"{prefix}.stages.{s}.{role}.{e}")
                               for e, b in enumerate(bases)]
            out.append(ResidualStage(lists.get("gate"), lists["up"], lists["down"], scales.to(experts.device),
                                     name=f"{prefix}.stages.{s}"))
    return out
