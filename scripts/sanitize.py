"""One kernel family at the smallest shape that reaches its code path, checked against the float64 oracle: the
target scripts/sanitizer_check.sh runs under each compute-sanitizer tool. A case also checks that the kernels it is
about were launched (a case that no longer reaches its path fails), and exits 3 when the output misses the oracle.

  python3 scripts/sanitize.py --list             the cases: name, family, "ws" where RACECHECK_ORDER applies, env
  python3 scripts/sanitize.py CASE [--result F]  run one case; F gets {"ok", "rel_l2", "launched", "error"}
  python3 scripts/sanitize.py --summarize DIR --out F   rows of a sweep (DIR/*.run.json) to JSON F, table to stdout
SANITIZE_REF_DIR keeps each case's float64 oracle for its later runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = 2e-3   # relative L2 of fp16 outputs against float64 (docs/DESIGN.md)
K_MIX = [4, 3]     # expert formats of the MoE cases: K4 MCG and K3 3INST, alternating
CB_MIX = ["mcg", "3inst"]


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    run: str                 # "linear", "moe" or "route_pack"
    shape: dict              # linear: rows, k, n; moe: E, H, I, top_k, T; route_pack: tokens, top_k, E, chunked
    env: dict = field(default_factory=dict)
    expect: tuple = ()       # (kernel name, {define: value or None for absent}) each launched at least once
    cuda: bool = True        # False: no CUDA C++ kernel may launch (the Triton paths)
    ws: bool = False         # warp-specialized: racecheck also runs the RACECHECK_ORDER build
    stages: bool = False     # MoE: one residual stage loaded by MoEPlan.load_stages


def _linear(name, family, rows, k, n, env=None, expect=(), cuda=True, ws=False):
    return Case(name, family, "linear", {"rows": rows, "k": k, "n": n}, env or {}, expect, cuda, ws)


WS16 = {"EXL3MOE_WS_PAIRED": "0", "EXL3MOE_WS_X_TMA": "0"}
LINEAR_CASES = [
    _linear("linear_mma_1row", "trellis_mma", 1, 256, 256, {"EXL3MOE_LINEAR_CLUSTER": "0"},
            (("trellis_mma", {"FUSE_IN": "1", "CLUSTER_SPLITS": None}),)),
    _linear("linear_mma_33rows", "trellis_mma", 33, 256, 256, {"EXL3MOE_WS": "0"},
            (("rotate_input", {}), ("trellis_mma", {"MT": "4", "DEFER_REDUCE": "1"}), ("reduce_splits", {}))),
    _linear("linear_cluster", "trellis_mma_cluster", 1, 512, 256, {},
            (("trellis_mma", {"CLUSTER_SPLITS": "4"}),)),
    # EXL3MOE_WS_SPB: consecutive splits per block, so that one block walks the 3-stage ring more than once
    _linear("linear_ws16", "trellis_ws16", 33, 512, 128, {**WS16, "EXL3MOE_WS_SPB": "4"},
            (("trellis_ws", {"WS_PRODUCERS": None, "DEFER_REDUCE": None, "X_TMA": None}),), ws=True),
    _linear("linear_ws16_tma", "trellis_ws16", 33, 512, 128, {**WS16, "EXL3MOE_WS_SPB": "4", "EXL3MOE_WS_X_TMA": "1"},
            (("trellis_ws", {"WS_PRODUCERS": None, "X_TMA": "1"}),), ws=True),
    _linear("linear_ws16_defer", "reduce_splits", 33, 512, 128, {**WS16, "EXL3MOE_WS_SPB": "2"},
            (("trellis_ws", {"DEFER_REDUCE": "1"}), ("reduce_splits", {})), ws=True),
    _linear("linear_ws12", "trellis_ws12", 33, 512, 128,
            {"EXL3MOE_WS_PAIRED": "1", "EXL3MOE_WS_X_TMA": "0", "EXL3MOE_WS_SPB": "4"},
            (("trellis_ws", {"WS_PRODUCERS": "12"}),), ws=True),
    _linear("linear_dense", "trellis_dense", 129, 256, 256, {},
            (("rotate_input", {}), ("trellis_dense", {}), ("dense_epilogue", {}))),
    _linear("linear_triton", "triton_linear", 2, 256, 256, {"EXL3MOE_CUDA_KERNELS": "0"}, cuda=False),
    _linear("linear_triton_dense", "triton_linear", 129, 256, 256, {"EXL3MOE_CUDA_KERNELS": "0"}, cuda=False),
]


def _moe(name, family, E, H, I, top_k, T, env=None, expect=(), cuda=True, ws=False):
    shape = {"E": E, "H": H, "I": I, "top_k": top_k, "T": T}
    return [Case(name, family, "moe", shape, env or {}, expect, cuda, ws),
            Case(name + "+stages", family, "moe", shape, env or {}, expect, cuda, ws, stages=True)]


PAIRED_WS = {"WS": "1", "WS_PRODUCERS": "12", "X_TMA": "1"}
SHALLOW_RING = {"EXL3MOE_MOE_WS_STAGE_KT": "4", "EXL3MOE_MOE_WS_STAGES": "3"}
# Warp-specialized MoE cases on one expert (racecheck's time grows with the blocks that run): 96 rows in one
# 128-row route block, hidden and intermediate of one chunk (gate/up and down in one k split).
WS_MOE = (1, 128, 128, 1, 96)
MOE_CASES = [
    *_moe("moe_direct", "moe_direct", 4, 256, 256, 2, 2, {},
          (("moe_gate_up_mma", {"DIRECT_ROUTE": "1"}), ("moe_down_mma", {"DIRECT_ROUTE": "1"}))),
    *_moe("moe_packed", "moe_packed", 8, 256, 256, 2, 20, {},
          (("moe_gate_up_mma", {"DIRECT_ROUTE": "0", "WS": None, "MT": "1"}), ("moe_down_mma", {"MT": "1"}))),
    *_moe("moe_ws", "moe_ws", *WS_MOE, {},
          (("moe_rotate_input", {}), ("moe_gate_up_mma", PAIRED_WS), ("moe_down_ws", PAIRED_WS)), ws=True),
    # A ring of 3 stages of 4 k-tiles: a chunk is two stages, in turns of different warps, and the stage's range
    # walks the ring on past its end.
    *_moe("moe_ws_ring3", "moe_ws", *WS_MOE, SHALLOW_RING,
          (("moe_gate_up_mma", {**PAIRED_WS, "STAGES": "3", "STAGE_KT": "4"}),
           ("moe_down_ws", {**PAIRED_WS, "STAGES": "3"})), ws=True),
    *_moe("moe_ws16", "moe_ws16", *WS_MOE, {"EXL3MOE_MOE_WS_PAIRED": "0"},
          (("moe_gate_up_mma", {"WS": "1", "WS_PRODUCERS": None}), ("moe_down_ws", {"WS_PRODUCERS": None})),
          ws=True),
    *_moe("moe_gate_up_ws", "moe_gate_up_ws", *WS_MOE, {"EXL3MOE_MOE_WS_GATE_UP": "1"},
          (("moe_gate_up_ws", {"WS": "1"}), ("moe_down_ws", {})), ws=True),
    # 160 rows of one expert: a 192-row block (and an empty 128-row table), or 192-row blocks alone.
    *_moe("moe_split", "moe_split_192_128", 1, 128, 128, 1, 160, {},
          (("moe_gate_up_mma", {"WS_BLOCK_ROWS": "192"}), ("moe_down_ws", {"WS_BLOCK_ROWS": "192"}),
           ("moe_gate_up_mma", {"WS": "1", "WS_BLOCK_ROWS": None})), ws=True),
    *_moe("moe_wide", "moe_split_192_128", 1, 128, 128, 1, 160, {"EXL3MOE_MOE_SPLIT_ROUTE": "0"},
          (("moe_gate_up_mma", {"WS_BLOCK_ROWS": "192"}), ("moe_down_ws", {"WS_BLOCK_ROWS": "192"})), ws=True),
    *_moe("moe_triton", "triton_moe", 4, 256, 256, 2, 8, {"EXL3MOE_CUDA_KERNELS": "0"}, cuda=False),
]
ROUTE_PACK_CASES = [
    Case("route_pack_small", "route_pack", "route_pack", {"tokens": 40, "top_k": 4, "E": 12, "chunked": False},
         cuda=False),
    Case("route_pack_chunked", "route_pack", "route_pack", {"tokens": 300, "top_k": 4, "E": 12, "chunked": True},
         cuda=False),
]
CASES = {c.name: c for c in LINEAR_CASES + MOE_CASES + ROUTE_PACK_CASES}


class Launches:
    """(kernel name, defines) of every CUDA C++ launch while in use (a context manager wrapping nvrtc.kernel and
    nvrtc.launch, restored on exit)."""

    def __enter__(self):
        from exl3moe.kernels import nvrtc
        self.names, self.launched = {}, []
        self._nvrtc, self._saved = nvrtc, (nvrtc.kernel, nvrtc.launch)
        kernel, launch = self._saved

        def recorded_kernel(file, name, defines, *args, **kwargs):
            func = kernel(file, name, defines, *args, **kwargs)
            self.names[int(func)] = (name, {k: str(v) for k, v in {**dict(defines), **nvrtc.extra_defines()}.items()})
            return func

        def recorded_launch(func, *args, **kwargs):
            self.launched.append(self.names.get(int(func), ("?", {})))
            return launch(func, *args, **kwargs)

        nvrtc.kernel, nvrtc.launch = recorded_kernel, recorded_launch
        return self

    def __exit__(self, *exc):
        self._nvrtc.kernel, self._nvrtc.launch = self._saved

    def ran(self, name: str, defines: dict) -> bool:
        """Whether kernel `name` launched with these defines (value None: the define absent)."""
        return any(n == name and all(d.get(k) == v for k, v in defines.items()) for n, d in self.launched)

    def missing(self, case: Case) -> list:
        """The expected launches of `case` that did not happen (and any CUDA launch of a Triton case)."""
        if not case.cuda:
            return [f"no CUDA C++ kernel, got {sorted({n for n, _ in self.launched})}"] if self.launched else []
        return [f"{name} {defines}" for name, defines in case.expect if not self.ran(name, defines)]


def reference(case: Case, compute):
    """The float64 oracle of `case`: compute(), kept under SANITIZE_REF_DIR (when set) for the case's later runs."""
    import torch
    directory = os.environ.get("SANITIZE_REF_DIR")
    path = os.path.join(directory, case.name + ".pt") if directory else None
    if path and os.path.isfile(path):
        return torch.load(path)
    ref = compute()
    if path:
        os.makedirs(directory, exist_ok=True)
        torch.save(ref, path + f".{os.getpid()}")
        os.replace(path + f".{os.getpid()}", path)
    return ref


def rel_l2(out, ref) -> float:
    return ((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm()).item()


def run_linear(case: Case, device) -> float:
    import torch
    from exl3moe.ops.linear import linear
    from exl3moe.reference import linear as linear_reference
    from helpers import random_weight
    s = case.shape
    g = torch.Generator().manual_seed(1)
    w = random_weight(s["k"], s["n"], 4, "mul1", bias=True, generator=g)
    x = torch.randn(s["rows"], s["k"], generator=g).half()
    ref = reference(case, lambda: linear_reference(x, w))
    out = linear(x.to(device), w.to(device))
    torch.cuda.synchronize()
    return rel_l2(out, ref)


def moe_data(case: Case):
    """(experts, stage or None, x, ids, weights) on the CPU; one routed id is out of range (a remote expert)."""
    import torch
    from helpers import random_experts, random_stage
    s = case.shape
    g = torch.Generator().manual_seed(2)
    experts = random_experts(s["E"], s["H"], s["I"], (K_MIX * s["E"])[:s["E"]], (CB_MIX * s["E"])[:s["E"]],
                             generator=g)
    x = (torch.randn(s["T"], s["H"], generator=g) / 32).half()
    ids = torch.rand(s["T"], s["E"], generator=g).argsort(-1)[:, :s["top_k"]].to(torch.int32).contiguous()
    ids[-1, -1] = s["E"] + 3
    weights = torch.softmax(torch.randn(s["T"], s["top_k"], generator=g), -1)
    stage = None
    if case.stages:
        scales = torch.rand(s["E"], 3, generator=g) * 0.2 + 0.05
        scales[0, 1] = 0.0   # a projection without its stage
        stage = random_stage(experts, scales, 2, "mcg", generator=g)
    return experts, stage, x, ids, weights


def stage_on(stage, experts):
    """`stage` with its residual trellises on the device of `experts`, on their suh / svh."""
    from exl3moe import EXL3Weight, ResidualStage

    def moved(residuals, bases):
        return None if residuals is None else [EXL3Weight(r.trellis.to(b.device), b.suh, b.svh, r.codebook, name=r.name)
                                                for r, b in zip(residuals, bases)]
    return ResidualStage(moved(stage.gate, experts.gate), moved(stage.up, experts.up),
                         moved(stage.down, experts.down), stage.scales.to(experts.device))


def run_moe(case: Case, device) -> float:
    import torch
    from exl3moe import ExpertSet
    from exl3moe.ops.moe import moe_plan
    from exl3moe.reference import moe as moe_reference
    experts, stage, x, ids, weights = moe_data(case)
    staged = ExpertSet(experts.gate, experts.up, experts.down, experts.activation, stages=[stage] if stage else [])
    ref = reference(case, lambda: moe_reference(x, staged, ids, weights))
    on_device = experts.to(device)
    plan = moe_plan(on_device, x.shape[0], ids.shape[1], out_dtype=torch.float16,
                    stage_capacity=1 if case.stages else 0, max_stage_bits=2 if case.stages else 0)
    if stage is not None:
        plan.load_stages([stage_on(stage, on_device)])
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float16, device=device)
    plan.bind(plan.allocate()).run(x.to(device), ids.to(device), weights.to(device), out)
    torch.cuda.synchronize()
    return rel_l2(out, ref)


def run_route_pack(case: Case, device) -> float:
    import torch
    from test_route_pack import CHUNKED, check_route_pack, random_ids
    s = case.shape
    ids = random_ids(s["tokens"], s["top_k"], s["E"], torch.int32, torch.Generator().manual_seed(3), 0.2)
    check_route_pack(ids.to(device), s["E"], block_m=16, **(CHUNKED if s["chunked"] else {}))
    torch.cuda.synchronize()
    return 0.0   # check_route_pack compares every buffer exactly


RUNNERS = {"linear": run_linear, "moe": run_moe, "route_pack": run_route_pack}


def run_case(case: Case) -> dict:
    """Run `case` on cuda:0 with its environment: {"ok", "rel_l2", "launched", "error"}."""
    os.environ.update(case.env)
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    result = {"ok": False, "rel_l2": None, "launched": [], "error": None}
    launches = Launches()
    try:
        with launches:
            err = RUNNERS[case.run](case, "cuda")
        missing = launches.missing(case)
        result.update(rel_l2=err, ok=err < TOLERANCE and not missing,
                      error=f"missing launches: {missing}" if missing else None)
        if err >= TOLERANCE:
            result["error"] = f"relative L2 {err:.3g} against float64 (tolerance {TOLERANCE})"
    except Exception as exc:   # an assertion of route packing's check, a CUDA error, a refused plan
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["launched"] = sorted({name for name, _ in getattr(launches, "launched", [])})
    return result


def list_cases() -> str:
    return "\n".join(f"{c.name} {c.family} {'ws' if c.ws else '-'} "
                     + (" ".join(f"{k}={v}" for k, v in c.env.items()) or "-") for c in CASES.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", nargs="?", choices=sorted(CASES), metavar="CASE")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--result", help="write the case's verdict here as JSON")
    parser.add_argument("--summarize", metavar="DIR")
    parser.add_argument("--out", help="with --summarize: the JSON rows")
    args = parser.parse_args(argv)
    if args.list:
        print(list_cases())
        return 0
    if args.summarize:
        sys.path.insert(0, HERE)
        from sanitize_report import decides, summarize
        rows, text = summarize(args.summarize, args.out or os.path.join(args.summarize, "sanitizers.json"))
        print(text)
        return int(any(decides(r) and r["status"] != "clean" for r in rows))
    if args.case is None:
        parser.error("give a CASE, --list or --summarize")
    result = run_case(CASES[args.case])
    if args.result:
        with open(args.result + ".part", "w") as fh:
            json.dump(result, fh)
        os.replace(args.result + ".part", args.result)
    print(json.dumps(result))
    return 0 if result["ok"] else 3


if __name__ == "__main__":
    sys.exit(main())
