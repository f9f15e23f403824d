"""The converter's output folder: one shard per decoder layer written as it finishes, a progress marker, and at the end
config.json, quantization_config.json (tensor_storage), the shard index and the tokenizer files.

Progress marker `exl3moe_progress.json`: the conversion's options, the layers finished (each with its shard's
manifest records and summary row); the hidden states after the last finished layer are kept in
`exl3moe_states.safetensors`. A run finding a marker with the same options resumes after its last layer; anything
else in OUT_DIR is refused unless `force`, which empties it first.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from ..errors import ContractError
from ..format.checkpoint import INDEX_FILE, _tensor_storage
from ..format.completeness import CONFIG_FILE, QUANT_CONFIG_FILE
from ..format.safetensors_io import tensor_nbytes, write_shard

PROGRESS_FILE = "exl3moe_progress.json"
STATES_FILE = "exl3moe_states.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
PROGRESS_VERSION = 1


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05}-of-{count:05}.safetensors"


class OutputFolder:
    """OUT_DIR of one conversion: opened (resumed, refused or emptied) before any work."""

    def __init__(self, path: str, options: dict, shards: int, force: bool = False):
        self.path, self.options, self.shards = os.fspath(path), options, shards
        self.progress = {"version": PROGRESS_VERSION, "options": options, "done": {}}
        marker = os.path.join(self.path, PROGRESS_FILE)
        if os.path.isdir(self.path) and os.listdir(self.path) and not force:
            if not os.path.isfile(marker):
                raise ContractError(self.path, "exists and is not empty; pass --force to overwrite it")
            with open(marker, encoding="utf-8") as f:
                old = json.load(f)
            if old.get("version") != PROGRESS_VERSION or old.get("options") != options:
                raise ContractError(self.path, "holds an unfinished conversion with other options; rerun with those "
                                    "options to resume, or pass --force to start over")
            self.progress = old
        elif os.path.exists(self.path) and force:
            if not os.path.isdir(self.path):
                raise ContractError(self.path, "is a file; OUT_DIR must be a folder")
            shutil.rmtree(self.path)
        elif os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ContractError(self.path, "is a file; OUT_DIR must be a folder")

    def done(self, unit: int) -> bool:
        return str(unit) in self.progress["done"]

    def summary(self, unit: int) -> dict:
        return self.progress["done"][str(unit)]["summary"]

    def states(self) -> torch.Tensor | None:
        from safetensors.torch import load_file

        file = os.path.join(self.path, STATES_FILE)
        return load_file(file)["states"] if self.progress["done"] and os.path.isfile(file) else None

    def write_unit(self, unit: int, linears: dict, tensors: dict, summary: dict, states: torch.Tensor | None) -> None:
        """One finished shard: tensors first, then the states, then the marker (a crash leaves the unit undone)."""
        os.makedirs(self.path, exist_ok=True)
        groups = [(key, {f"{key}.{s}": t for s, t in w.stored_tensors().items()}) for key, w in linears.items()]
        groups += [(key.rsplit(".", 1)[0], {key: t}) for key, t in tensors.items()]
        shard = shard_name(unit, self.shards)
        write_shard(os.path.join(self.path, shard), {k: t for _, g in groups for k, t in g.items()})
        if states is not None:
            from safetensors.torch import save_file

            tmp = os.path.join(self.path, STATES_FILE + ".tmp")
            save_file({"states": states.contiguous()}, tmp)
            os.replace(tmp, os.path.join(self.path, STATES_FILE))
        linear_sizes = {key: [w.K, w.in_features * w.out_features, w.codebook] for key, w in linears.items()}
        self.progress["done"][str(unit)] = {"shard": shard, "storage": _tensor_storage(groups, linears),
                                            "linears": linear_sizes, "summary": summary,
                                            "bytes": sum(tensor_nbytes(t) for _, g in groups for t in g.values())}
        tmp = os.path.join(self.path, PROGRESS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.progress, f)
        os.replace(tmp, os.path.join(self.path, PROGRESS_FILE))

    def finish(self, config: dict, source_path: str, codebook: str) -> None:
        """config.json, quantization_config.json, index and tokenizer files; the marker and states removed."""
        done = [self.progress["done"][str(u)] for u in range(self.shards)]
        storage, weight_map = {}, {}
        for unit in done:
            storage.update(unit["storage"])
            for record in unit["storage"].values():
                weight_map.update(dict.fromkeys(record["stored_tensors"], unit["shard"]))
        linears = {k: v for unit in done for k, v in unit["linears"].items()}
        qc = quantization_config(linears, codebook)
        out = {k: v for k, v in config.items() if k != "quantization_config"}
        out["quantization_config"] = qc
        if "lm_head" in linears:
            out["tie_word_embeddings"] = False
        _write_json(os.path.join(self.path, INDEX_FILE),
                    {"metadata": {"total_size": sum(u["bytes"] for u in done)}, "weight_map": weight_map})
        _write_json(os.path.join(self.path, QUANT_CONFIG_FILE), {**qc, "tensor_storage": storage})
        _write_json(os.path.join(self.path, CONFIG_FILE), out)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source_path, name)):
                shutil.copyfile(os.path.join(source_path, name), os.path.join(self.path, name))
        for name in (PROGRESS_FILE, STATES_FILE):
            if os.path.exists(os.path.join(self.path, name)):
                os.remove(os.path.join(self.path, name))


def quantization_config(linears: dict, codebook: str) -> dict:
    """exllamav3's quantization_config: quant_method, bits (weighted mean K of the body), head_bits, codebook."""
    body = [(K, n) for key, (K, n, _) in linears.items() if key != "lm_head"]
    qc = {"quant_method": "exl3", "bits": round(sum(K * n for K, n in body) / sum(n for _, n in body), 2)}
    if "lm_head" in linears:
        qc["head_bits"] = linears["lm_head"][0]
    qc["codebook"] = codebook
    return qc


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=4))
