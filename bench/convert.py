"""Convert a random-init model with Qwen3-30B-A3B layer dimensions (2 layers by default) at 4.0 bpw on the GPU and
record seconds per layer. Run from the repository root: PYTHONPATH=src:bench python bench/convert.py --out FILE."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

QWEN3_30B_A3B_LAYER = dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                           num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           vocab_size=151936, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
                           intermediate_size=6144, hidden_act="silu")


def save_random_model(path: str, layers: int, seed: int = 0) -> None:
    """A random-init bf16 Hugging Face checkpoint with Qwen3-30B-A3B layer dimensions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in QWEN3_30B_A3B_LAYER.items() if k != "model_type"}
    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, **rest)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)


def run(out: str | None, layers: int, bits: float, rows: int, work: str | None) -> dict:
    from exl3moe.convert import quantize_model

    with tempfile.TemporaryDirectory(dir=work) as tmp:
        src, dst = os.path.join(tmp, "in"), os.path.join(tmp, "out")
        save_random_model(src, layers)
        start = time.perf_counter()
        report = quantize_model(src, dst, bits=bits, head_bits=6, rows=rows, device="cuda")
        total = time.perf_counter() - start
    result = {"case": "qwen3-30b-a3b layer dims, random init", "layers": layers, "bits": bits, "rows": rows,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "seconds_per_layer": [r["seconds"] for r in report.rows if r["unit"] != "head"],
              "head_seconds": report.rows[-1]["seconds"], "total_seconds": total,
              "proxy_error": {r["unit"]: r["proxy_error"] for r in report.rows},
              "regularised_experts": report.regularised_experts}
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench/results/convert_h200.json", help="JSON result file")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bits", type=float, default=4.0)
    parser.add_argument("--rows", type=int, default=2048, help="calibration tokens")
    parser.add_argument("--work", default=None, help="folder for the temporary checkpoints (default: the system's)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.out, args.layers, args.bits, args.rows, args.work), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
