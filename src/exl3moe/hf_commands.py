"""`exl3moe generate` and `exl3moe bench-model`: parsers and entry points for cli.py to register (transformers is
imported only when a command runs).

    from .hf_commands import add_generate_parser, add_bench_model_parser
    add_generate_parser(sub); add_bench_model_parser(sub)      # each sets func=generate_main / bench_model_main
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

from .errors import ContractError, FormatError

# Real dimensions of models a synthetic checkpoint can stand in for (config.json fields).
SYNTHETIC = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
                          bos_token_id=151643, eos_token_id=151645, hidden_act="silu"),
}


def transformers_installed() -> bool:
    """Whether transformers can be imported; else one line saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        return True
    print("error: this command needs transformers: pip install 'exl3moe[hf]'", file=sys.stderr)
    return False


def _dtype(name: str):
    import torch
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]


class _TimingStreamer:
    """A TextStreamer that also notes when the prompt went in, the first new token came and the last one."""

    def __init__(self, tokenizer):
        from transformers import TextStreamer

        self.text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.times, self.new_tokens = [], 0

    def put(self, value):
        self.times.append(time.perf_counter())
        if len(self.times) > 1:
            self.new_tokens += value.numel()
        self.text.put(value)

    def end(self):
        self.text.end()


def add_generate_parser(sub):
    p = sub.add_parser("generate", help="generate text from an EXL3 checkpoint with transformers on exl3moe's kernels")
    p.add_argument("path", help="checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="activations (default float16)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="rows the EXL3 modules plan for")
    p.set_defaults(func=generate_main)
    return p


def generate_main(args) -> int:
    if not transformers_installed():
        return 2
    import torch
    from transformers import AutoTokenizer

    from .hf.loader import from_pretrained

    if args.max_new_tokens < 1 or args.temperature < 0:
        print("error: --max-new-tokens must be >= 1 and --temperature >= 0", file=sys.stderr)
        return 2
    try:
        model = from_pretrained(args.path, device=args.device, dtype=_dtype(args.dtype),
                                max_batch_tokens=args.max_batch_tokens)
        tokenizer = AutoTokenizer.from_pretrained(args.path, local_files_only=True)
    except (FormatError, ContractError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(model.device)
    streamer = _TimingStreamer(tokenizer)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                       cache_implementation="static", streamer=streamer, **sampling)
    print()
    first = streamer.times[1] if len(streamer.times) > 1 else time.perf_counter()
    prefill_s, decode_s = first - start, streamer.times[-1] - first
    decoded = max(0, streamer.new_tokens - 1)
    print(f"prefill: {ids.shape[1]} tokens in {prefill_s:.3f} s ({ids.shape[1] / max(prefill_s, 1e-9):.1f} tokens/s)")
    rate = decoded / decode_s if decode_s > 0 else float("nan")
    print(f"decode: {decoded} tokens in {decode_s:.3f} s ({rate:.1f} tokens/s)")
    return 0


def add_bench_model_arguments(p):
    p.add_argument("path", nargs="?", default=None, help="EXL3 checkpoint directory (or --synthetic NAME)")
    p.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                   help="write a random-trellis checkpoint at this model's real dimensions and measure it")
    p.add_argument("--layers", type=int, default=None, help="synthetic: decoder layers (default: the model's)")
    p.add_argument("--K", type=float, default=4, help="synthetic: bits per weight (codebook mcg)")
    p.add_argument("--workdir", default=None, help="synthetic: where to write the checkpoint (default: a temp dir)")
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048],
                   help="prompt lengths timed (default 512 2048)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes (default 1 8 32)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the decode steps")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="exl3moe activations")
    p.add_argument("--no-baseline", action="store_true", help="skip the bf16 transformers model")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


def add_bench_model_parser(sub):
    p = sub.add_parser("bench-model", help="prefill / decode tokens per second of a model on this GPU vs bf16")
    add_bench_model_arguments(p)
    p.set_defaults(func=bench_model_main)
    return p


def _write_synthetic(args) -> tuple:
    from .hf.synthetic import write_synthetic_checkpoint

    config = dict(SYNTHETIC[args.synthetic])
    full_layers = config["num_hidden_layers"]
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    path = args.workdir or tempfile.mkdtemp(prefix="exl3moe_bench_")
    path = os.path.join(path, f"{args.synthetic}-K{args.K:g}-L{config['num_hidden_layers']}")
    start = time.perf_counter()
    write_synthetic_checkpoint(path, config, K=args.K, codebook="mcg", device="cuda")
    info = {"synthetic": args.synthetic, "layers": config["num_hidden_layers"], "full_layers": full_layers,
            "K": args.K, "codebook": "mcg", "write_s": time.perf_counter() - start}
    return path, info


def _free_gpu_memory() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def bench_model_main(args) -> int:
    if not transformers_installed():
        return 2
    import torch
    import transformers

    from .timing import run_info
    from .hf.benchmark import measure
    from .hf.loader import from_pretrained

    if not torch.cuda.is_available():
        print("exl3moe bench-model: needs a CUDA GPU", file=sys.stderr)
        return 2
    if (args.path is None) == (args.synthetic is None):
        print("error: give a checkpoint PATH or --synthetic NAME (one of them)", file=sys.stderr)
        return 2
    try:
        path, info = _write_synthetic(args) if args.synthetic else (args.path, {"path": args.path})
        # The bf16 baseline first: its random init draws on the CUDA generator, which no graph capture may precede.
        baseline = None if args.no_baseline else _measure_baseline(path, args)
        start = time.perf_counter()
        model = from_pretrained(path, device="cuda", dtype=_dtype(args.dtype), max_batch_tokens=max(args.prefill))
    except (FormatError, ContractError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    info["load_s"] = time.perf_counter() - start
    config = model.config
    vocab = config.vocab_size
    report = {**run_info(), "transformers": transformers.__version__, "model": {**info, "dtype": args.dtype},
              "context": args.context, "steps": args.steps}
    report["exl3moe"] = measure(model, vocab, args.prefill, args.batches, args.context, args.steps)
    _print_summary("exl3moe", report["exl3moe"])
    del model
    _free_gpu_memory()
    if baseline is not None:
        report["bf16"] = baseline
        _print_summary("bf16", report["bf16"])
        report["ratios"] = _ratios(report["exl3moe"], report["bf16"])
        print(json.dumps(report["ratios"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _measure_baseline(path: str, args) -> dict:
    """The same transformers model with bf16 weights of the same shapes (random), CUDA-graph decode as exl3moe's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .hf.benchmark import measure
    from .hf.graphs import install_decode_graphs

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval().requires_grad_(False)
    install_decode_graphs(model)
    result = measure(model, config.vocab_size, args.prefill, args.batches, args.context, args.steps)
    del model
    _free_gpu_memory()
    return result


def _ratios(ours: dict, bf16: dict) -> dict:
    out = {}
    for a, b in zip(ours["prefill"], bf16["prefill"]):
        out[f"prefill_{a['tokens']}_vs_bf16"] = a["tokens_per_s"] / b["tokens_per_s"]
    for a, b in zip(ours["decode"], bf16["decode"]):
        out[f"decode_b{a['batch']}_vs_bf16"] = a["tokens_per_s"] / b["tokens_per_s"]
    return out


def _print_summary(name: str, result: dict) -> None:
    prefill = ", ".join(f"{r['tokens']}: {r['tokens_per_s']:.0f}" for r in result["prefill"])
    decode = ", ".join(f"b{r['batch']}: {r['tokens_per_s']:.1f}" for r in result["decode"])
    print(f"{name}: prefill tokens/s {prefill}; decode tokens/s {decode}; peak {result['peak_memory_gib']:.1f} GiB")
