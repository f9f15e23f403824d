"""Cold start on a GPU: wall-clock latency of the first call (plan, kernel compilation, run) of a linear (4096x14336
K4 mcg at 1 and 300 rows), of an MoE layer (Qwen3-30B-A3B: 128 experts, hidden 2048, intermediate 768, top-8, K4 mcg,
at 1 and 1024 tokens) and of loading plus one forward of every module of a tiny Qwen3-MoE checkpoint whose experts
use eight (K, codebook) formats; then the second call; then `warmup` for the same layers and the first call after it.
Every case runs in a fresh process on fresh, empty caches (EXL3MOE_CACHE_DIR and TRITON_CACHE_DIR in a temporary
directory). Usage: python scripts/cold_start.py --out cold_start.json [--workers N]"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

CASES = ("linear_1", "linear_300", "moe_1", "moe_1024", "checkpoint")
MIXED_FORMATS = [(2, "mcg"), (3, "mul1"), (4, "3inst"), (5, "mcg"), (6, "mul1"), (8, "3inst"), (2.5, "mul1"),
                 (3.5, "mul1")]
LINEAR = (4096, 14336, 4, "mcg")
MOE = (128, 2048, 768, 8, 4, "mcg")   # experts, hidden, intermediate, top-k, K, codebook
CHECKPOINT_TOKENS = 4


def random_weight(k, n, K, codebook, device, g):
    from exl3moe import EXL3Weight
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), generator=g, dtype=torch.int32,
                            device=g.device).to(torch.int16)
    scale = lambda m: (torch.rand(m, generator=g, device=g.device) + 0.5).half()  # noqa: E731
    return EXL3Weight(trellis, scale(k), scale(n), codebook).to(device)


DEVICE = "cuda"   # --device cpu runs the cases on the torch path (a smoke test of this script without a GPU)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(call) -> float:
    sync()
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def linear_case(rows: int) -> dict:
    from exl3moe import linear
    g = torch.Generator(device=DEVICE).manual_seed(0)
    k, n, K, codebook = LINEAR
    w = random_weight(k, n, K, codebook, DEVICE, g)
    x = torch.randn(rows, k, generator=g, device=DEVICE).half()
    return {"first_s": timed(lambda: linear(x, w)), "second_s": timed(lambda: linear(x, w))}


def moe_case(tokens: int) -> dict:
    from exl3moe import ExpertSet, fused_experts
    g = torch.Generator(device=DEVICE).manual_seed(0)
    E, H, inter, top_k, K, codebook = MOE
    proj = lambda k, n: [random_weight(k, n, K, codebook, DEVICE, g) for _ in range(E)]  # noqa: E731
    experts = ExpertSet(proj(H, inter), proj(H, inter), proj(inter, H), "silu")
    x = (torch.randn(tokens, H, generator=g, device=DEVICE) * 0.5).half()
    weights, ids = torch.softmax(torch.randn(tokens, E, generator=g, device=DEVICE), -1).topk(top_k, dim=-1)
    call = lambda: fused_experts(x, experts, ids, weights / weights.sum(-1, keepdim=True))  # noqa: E731
    return {"first_s": timed(call), "second_s": timed(call)}


def checkpoint_case(path: str) -> dict:
    from exl3moe import EXL3Linear, EXL3MoE, open_checkpoint
    modules = []

    def load():
        reader = open_checkpoint(path)
        experts = {key for key in (i.key for i in reader.linears()) if ".experts." in key}
        modules.extend(EXL3Linear.from_checkpoint(reader, i.key, DEVICE) for i in reader.linears()
                       if i.key not in experts)
        modules.extend(EXL3MoE.from_checkpoint(reader, prefix, DEVICE, max_tokens=CHECKPOINT_TOKENS)
                       for prefix in reader.moe_layers())

    def forward():
        for module in modules:
            width = module.in_features if isinstance(module, EXL3Linear) else module.hidden_size
            module(torch.ones(CHECKPOINT_TOKENS, width, device=DEVICE, dtype=torch.float16))

    load_s = timed(load)
    first = timed(forward)
    return {"load_s": load_s, "first_forward_s": first, "first_s": load_s + first, "second_s": timed(forward),
            "modules": len(modules)}


def warmup_case(case: str, path: str, workers: int) -> dict:
    from exl3moe.rows import report_console
    from exl3moe.warmup import MoESpec, Specs, WeightSpec, checkpoint_specs, warm
    from exl3moe import open_checkpoint
    if case.startswith("linear"):
        specs = Specs(linears={WeightSpec(*LINEAR)})
    elif case.startswith("moe"):
        E, H, inter, top_k, K, codebook = MOE
        up, down = (WeightSpec(H, inter, K, codebook),) * E, (WeightSpec(inter, H, K, codebook),) * E
        specs = Specs(moes={MoESpec(up, up, down, "silu", top_k)})
    else:
        specs = checkpoint_specs(open_checkpoint(path))
    start = time.perf_counter()
    summary = warm(specs, torch.device(DEVICE), report_console(), workers)
    return {**summary, "warmup_s": time.perf_counter() - start}


def write_mixed_checkpoint(path: str) -> None:
    """A Qwen3-MoE checkpoint of the fixture's shapes (hidden 256, 2 layers, 16 experts of 128, top-4) whose experts
    cycle through MIXED_FORMATS, shifted per layer and projection."""
    from exl3moe import write_checkpoint
    g = torch.Generator().manual_seed(0)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
              "num_hidden_layers": 2, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
              "norm_topk_prob": True, "hidden_act": "silu", "tie_word_embeddings": False,
              "quantization_config": {"quant_method": "exl3"}}
    linears, tensors = {}, {}
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        for proj, (k, n) in (("q_proj", (256, 256)), ("k_proj", (256, 128)), ("v_proj", (256, 128)),
                             ("o_proj", (256, 256))):
            linears[f"{prefix}.self_attn.{proj}"] = random_weight(k, n, 4, "mul1", "cpu", g)
        for e in range(16):
            for p, (proj, (k, n)) in enumerate((("gate_proj", (256, 128)), ("up_proj", (256, 128)),
                                               ("down_proj", (128, 256)))):
                K, codebook = MIXED_FORMATS[(e + p + 3 * layer) % len(MIXED_FORMATS)]
                linears[f"{prefix}.mlp.experts.{e}.{proj}"] = random_weight(k, n, K, codebook, "cpu", g)
        tensors[f"{prefix}.mlp.gate.weight"] = torch.randn(16, 256, generator=g).half()
    linears["lm_head"] = random_weight(256, 1024, 6, "mul1", "cpu", g)
    write_checkpoint(path, linears, tensors, config)


def run_child(args: list, root: str, tag: str) -> dict:
    """One case in a fresh process whose caches are root/tag/{cubins,triton}; its JSON line and wall time."""
    env = {**os.environ, "EXL3MOE_CACHE_DIR": os.path.join(root, tag, "cubins"),
           "TRITON_CACHE_DIR": os.path.join(root, tag, "triton")}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="warmup compiler processes")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="cases to run (default all)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.case:   # a child: one measurement, one JSON line
        if args.warmup:
            result = warmup_case(args.case, args.checkpoint, args.workers)
        elif args.case == "checkpoint":
            result = checkpoint_case(args.checkpoint)
        else:
            kind, size = args.case.split("_")
            result = (linear_case if kind == "linear" else moe_case)(int(size))
        print(json.dumps(result))
        return
    if not args.out:
        parser.error("--out is required")
    from exl3moe.kernels import nvrtc
    root = tempfile.mkdtemp(prefix="exl3moe_cold_")
    checkpoint = os.path.join(root, "mixed_checkpoint")
    write_mixed_checkpoint(checkpoint)
    results = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "nvrtc": nvrtc.nvrtc_version(),
               "cpus": os.cpu_count(), "workers": args.workers, "linear": LINEAR, "moe": MOE,
               "checkpoint_formats": MIXED_FORMATS, "cases": {}}
    for case in args.cases:
        child = ["--case", case, "--checkpoint", checkpoint, "--workers", str(args.workers), "--device", DEVICE]
        cold = run_child(child, root, f"cold_{case}")
        warmup = run_child(child + ["--warmup"], root, f"warm_{case}")
        after = run_child(child, root, f"warm_{case}")   # the warmed kernel cache; Triton's still cold
        results["cases"][case] = {"cold": cold, "warmup": warmup, "after_warmup": after}
        print(f"{case}: first {cold['first_s']:.2f} s, second {cold['second_s'] * 1e3:.1f} ms; warmup "
              f"{warmup['warmup_s']:.1f} s ({warmup['compiled']} variants); first after warmup "
              f"{after['first_s']:.2f} s", flush=True)
        with open(args.out, "w") as f:   # after every case: a run cut short keeps what it measured
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
