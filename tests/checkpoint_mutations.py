"""Copies of the exllamav3 fixture checkpoint with one thing changed: tensors deleted or replaced, manifest or config
edited (safetensors load_file / save_file and plain JSON), for the completeness and CLI tests."""

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

FIXTURE = "tiny_qwen3_moe_exl3"
SHARD = "model.safetensors"
MANIFEST = "quantization_config.json"
Q_PROJ = "model.layers.0.self_attn.q_proj"
K_PROJ = "model.layers.0.self_attn.k_proj"
EXPERT_DOWN = "model.layers.1.mlp.experts.5.down_proj"


def mutated(fixtures_dir, dst, drop=(), add=None, manifest=None, config=None):
    """The fixture copied to dst with the tensors in `drop` deleted and `add` ({name: tensor}) stored; `manifest` and
    `config` are functions that edit the parsed JSON in place (manifest=False deletes the manifest)."""
    shutil.copytree(os.path.join(fixtures_dir, FIXTURE), dst)
    tensors = load_file(os.path.join(dst, SHARD))
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, os.path.join(dst, SHARD))
    if manifest is False:
        os.remove(os.path.join(dst, MANIFEST))
    elif manifest is not None:
        edit_json(os.path.join(dst, MANIFEST), manifest)
    if config is not None:
        edit_json(os.path.join(dst, "config.json"), config)
    return dst


def edit_json(path, edit):
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def plain_bf16(fixtures_dir, dst, manifest=None):
    """The fixture with every quantized linear replaced by a plain (random) bf16 nn.Linear weight [out, in]."""
    from exl3moe import open_checkpoint

    reader = open_checkpoint(os.path.join(fixtures_dir, FIXTURE))
    g = torch.Generator().manual_seed(0)
    drop, add = [], {}
    for info in reader.linears():
        drop += [f"{info.key}.{s}" for s in ("trellis", "suh", "svh", "mul1")]
        add[f"{info.key}.weight"] = torch.randn(info.out_features, info.in_features, generator=g).bfloat16()
    return mutated(fixtures_dir, dst, drop, add, manifest)


def record_plain(doc):
    """Edit a manifest so that every EXL3 module is recorded as a plain bf16 `.weight`."""
    for module, record in doc["tensor_storage"].items():
        if record.get("quant_format") != "exl3":
            continue
        stored = record["stored_tensors"]
        k, n = stored[f"{module}.suh"]["shape"][0], stored[f"{module}.svh"]["shape"][0]
        doc["tensor_storage"][module] = {"stored_tensors": {f"{module}.weight": {
            "shape": [n, k], "n_bytes": 2 * n * k, "dtype": "torch.bfloat16"}}}
