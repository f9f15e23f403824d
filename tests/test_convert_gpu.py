"""exl3moe quantize on the GPU: Qwen3-30B-A3B layer dimensions (2 layers, random init) at 4.0 bpw, seconds per layer
written to the JSON file named by EXL3MOE_BENCH_OUT; a tiny model's logits KL at K2 / K3 / K4."""

import json
import os
import sys

import pytest
import torch

from convert_models import save_tiny_model, tiny_config
from exl3moe.convert import quantize_model
from exl3moe.format.checkpoint import open_checkpoint
from exl3moe.hf.dense import dense_model

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))


def test_qwen3_30b_a3b_layers_at_4_bpw(tmp_path):
    from convert import run   # bench/convert.py

    out = os.environ.get("EXL3MOE_BENCH_OUT") or str(tmp_path / "convert.json")
    result = run(out, layers=2, bits=4.0, rows=2048, work=str(tmp_path))
    with open(out) as f:
        assert json.load(f)["seconds_per_layer"] == result["seconds_per_layer"]
    assert len(result["seconds_per_layer"]) == 2 and all(s > 0 for s in result["seconds_per_layer"])
    assert all(e is not None and 0 < e < 0.01 for u, e in result["proxy_error"].items())
    print(json.dumps(result, indent=2))


def test_kl_falls_with_k(tmp_path):
    src = str(tmp_path / "in")
    model = save_tiny_model(src, tiny_config(layers=2, tied=False))
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(5))
    kl = {}
    for K in (2, 3, 4):
        out = str(tmp_path / f"k{K}")
        quantize_model(src, out, bits=K, head_bits=6, rows=1024, device="cuda")
        open_checkpoint(out)
        with torch.no_grad():
            p = model(ids).logits.log_softmax(-1)
            q = dense_model(out)(ids).logits.log_softmax(-1)
        kl[K] = float((p.exp() * (p - q)).sum(-1).mean())
    print(f"mean KL per K: {kl}")
    assert kl[2] > kl[3] > kl[4] > 0 and kl[4] < 2e-3
