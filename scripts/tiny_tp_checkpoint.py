"""Write the tiny fixture's architecture with experts two 128-wide blocks wide (random MCG K4 trellises), so that
`exl3moe verify --tp 2` can split its MoE layers (the fixture's experts are one block: TP2 refuses them).

  PYTHONPATH=src python3 scripts/tiny_tp_checkpoint.py DIR
"""

import json
import os
import sys

from exl3moe.hf.synthetic import write_synthetic_checkpoint

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "tiny_qwen3_moe_exl3", "config.json")
KEPT = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "norm_topk_prob", "vocab_size",
        "max_position_embeddings", "rms_norm_eps")

if __name__ == "__main__":
    with open(FIXTURE) as fh:
        fixture = json.load(fh)
    config = {k: fixture[k] for k in KEPT if k in fixture}
    config["moe_intermediate_size"] = 256
    os.makedirs(sys.argv[1], exist_ok=False)
    write_synthetic_checkpoint(sys.argv[1], config, K=4, codebook="mcg")
    print(f"wrote {sys.argv[1]}: {config}")
