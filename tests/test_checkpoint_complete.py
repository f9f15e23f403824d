"""Complete checkpoints: the exllamav3 fixture against its own manifest, config codebook and architecture."""

import os

import pytest
import torch

from checkpoint_mutations import (EXPERT_DOWN, FIXTURE, K_PROJ, MANIFEST, Q_PROJ, SHARD, edit_json, mutated,
                                  plain_bf16, record_plain)
from exl3moe import EXL3Weight, FormatError, open_checkpoint
from exl3moe.format import write_checkpoint
from exl3moe.format.architecture import expected

MUL1_MARKER = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)
MCG_MARKER = torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32)


def refused(path, name, *words):
    with pytest.raises(FormatError) as info:
        open_checkpoint(path)
    assert info.value.name == name, str(info.value)
    assert all(w in str(info.value) for w in words), str(info.value)
    return info.value


def test_fixture_is_complete(fixtures_dir):
    reader = open_checkpoint(os.path.join(fixtures_dir, FIXTURE), strict=False)
    assert reader.problems == [] and len(reader.linears()) == 105


@pytest.mark.parametrize("manifest", [None, False])
def test_deleted_attention_trellis_is_named(fixtures_dir, tmp_path, manifest):
    path = mutated(fixtures_dir, tmp_path / "c", drop=[f"{Q_PROJ}.trellis"], manifest=manifest)
    refused(path, f"{Q_PROJ}.trellis", "missing")
    reader = open_checkpoint(path, strict=False)
    assert [p.name for p in reader.problems] == [f"{Q_PROJ}.trellis"] and len(reader.linears()) == 104


def test_deleted_attention_linear_is_named_by_the_architecture(fixtures_dir, tmp_path):
    drop = [f"{Q_PROJ}.{s}" for s in ("trellis", "suh", "svh", "mul1")]
    path = mutated(fixtures_dir, tmp_path / "c", drop=drop, manifest=False)
    refused(path, f"{Q_PROJ}.trellis", "qwen3_moe defines the linear")


def test_deleted_expert_trellis_is_named(fixtures_dir, tmp_path):
    path = mutated(fixtures_dir, tmp_path / "c", drop=[f"{EXPERT_DOWN}.trellis"])
    refused(path, f"{EXPERT_DOWN}.trellis", "missing")


@pytest.mark.parametrize("manifest", [None, False])
def test_deleted_marker_contradicts_the_config(fixtures_dir, tmp_path, manifest):
    path = mutated(fixtures_dir, tmp_path / "c", drop=[f"{K_PROJ}.mul1"], manifest=manifest)
    refused(path, f"{K_PROJ}.mul1", "codebook is mul1", "contradicts itself")


def test_other_marker_contradicts_the_config(fixtures_dir, tmp_path):
    path = mutated(fixtures_dir, tmp_path / "c", drop=[f"{K_PROJ}.mul1"], add={f"{K_PROJ}.mcg": MCG_MARKER},
                   manifest=False)
    refused(path, f"{K_PROJ}.mcg", "mcg codebook", "mul1")


def test_plain_bf16_weights_under_an_exl3_config(fixtures_dir, tmp_path):
    refused(plain_bf16(fixtures_dir, tmp_path / "a"), f"{Q_PROJ}.suh", "missing", "more problems")
    refused(plain_bf16(fixtures_dir, tmp_path / "b", manifest=False), f"{Q_PROJ}.weight", "stored unquantized")
    refused(plain_bf16(fixtures_dir, tmp_path / "c", manifest=record_plain), "config.json",
            "no tensor is EXL3-quantized", "not an EXL3 checkpoint")


def test_manifest_disagreements_are_named(fixtures_dir, tmp_path):
    def shape(doc):
        doc["tensor_storage"][K_PROJ]["stored_tensors"][f"{K_PROJ}.svh"]["shape"] = [256]
    refused(mutated(fixtures_dir, tmp_path / "a", manifest=shape), f"{K_PROJ}.svh", "F16 [128]", "[256]")

    def dtype(doc):
        doc["tensor_storage"]["model.norm"]["stored_tensors"]["model.norm.weight"]["dtype"] = "torch.float16"
    refused(mutated(fixtures_dir, tmp_path / "b", manifest=dtype), "model.norm.weight", "BF16", "torch.float16")

    def bits(doc):
        doc["tensor_storage"][EXPERT_DOWN]["bits_per_weight"] = 3
    refused(mutated(fixtures_dir, tmp_path / "c", manifest=bits), f"{EXPERT_DOWN}.trellis", "K=2.5", "3")

    def multiplier(doc):
        doc["tensor_storage"]["lm_head"]["mul1_multiplier"] = 12345
    refused(mutated(fixtures_dir, tmp_path / "d", manifest=multiplier), "lm_head.mul1", "12345")

    extra = mutated(fixtures_dir, tmp_path / "e", add={"model.layers.0.extra.weight": torch.zeros(4)})
    refused(extra, "model.layers.0.extra.weight", "not listed")


def test_plain_linear_is_accepted_where_the_manifest_records_it(fixtures_dir, tmp_path):
    """lm_head stored as a plain fp16 weight, the manifest recording it so: complete."""
    def plain_head(doc):
        doc["tensor_storage"]["lm_head"] = {"stored_tensors": {"lm_head.weight": {
            "shape": [1024, 256], "n_bytes": 1024 * 256 * 2, "dtype": "torch.float16"}}}
    drop = [f"lm_head.{s}" for s in ("trellis", "suh", "svh", "mul1")]
    path = mutated(fixtures_dir, tmp_path / "c", drop=drop, add={"lm_head.weight": torch.zeros(1024, 256).half()},
                   manifest=plain_head)
    assert len(open_checkpoint(path).linears()) == 104
    edit_json(os.path.join(path, MANIFEST), lambda doc: doc["tensor_storage"].pop("lm_head"))
    refused(path, "lm_head.weight", "not listed")


def test_missing_router_is_named(fixtures_dir, tmp_path):
    path = mutated(fixtures_dir, tmp_path / "c", drop=["model.layers.1.mlp.gate.weight"], manifest=False)
    refused(path, "model.layers.1.mlp.gate.weight", "router tensor")


def test_truncated_shard_says_so(fixtures_dir, tmp_path):
    path = mutated(fixtures_dir, tmp_path / "c")
    blob = (path / SHARD).read_bytes()
    (path / SHARD).write_bytes(blob[:len(blob) // 2])
    with pytest.raises(FormatError, match="the file is truncated"):
        open_checkpoint(path)


def test_not_a_directory_says_what_to_pass(fixtures_dir, tmp_path):
    for path in (tmp_path / "absent", os.path.join(fixtures_dir, FIXTURE, SHARD)):
        with pytest.raises(FormatError, match="pass the checkpoint directory"):
            open_checkpoint(path)
    with pytest.raises(FormatError, match="pass the checkpoint directory") as info:
        open_checkpoint(tmp_path)
    assert info.value.name == "config.json"


def weight(k, n, K=2, codebook="mcg", seed=0):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), generator=g, dtype=torch.int32)
    return EXL3Weight(trellis.to(torch.int16), torch.ones(k).half(), torch.ones(n).half(), codebook)


MIXTRAL = {"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
           "hidden_act": "silu", "tie_word_embeddings": True, "quantization_config": {"quant_method": "exl3"}}


def mixtral_contents(experts=2):
    linears = {f"model.layers.0.self_attn.{p}": weight(128, 128) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for e in range(experts):
        for p, (k, n) in (("w1", (128, 256)), ("w3", (128, 256)), ("w2", (256, 128))):
            linears[f"model.layers.0.block_sparse_moe.experts.{e}.{p}"] = weight(k, n, seed=e)
    return linears, {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(2, 128).half()}


def test_written_mixtral_is_complete_and_a_missing_expert_is_named(tmp_path):
    linears, tensors = mixtral_contents()
    write_checkpoint(tmp_path / "a", linears, tensors, MIXTRAL)
    assert open_checkpoint(tmp_path / "a").problems == []
    linears, tensors = mixtral_contents(experts=1)
    write_checkpoint(tmp_path / "b", linears, tensors, MIXTRAL)
    refused(tmp_path / "b", "model.layers.0.block_sparse_moe.experts.1.w1.trellis", "mixtral defines")
    write_checkpoint(tmp_path / "c", *mixtral_contents(), {**MIXTRAL, "tie_word_embeddings": False})
    refused(tmp_path / "c", "lm_head.trellis", "missing")
    write_checkpoint(tmp_path / "d", *mixtral_contents(), {**MIXTRAL, "num_hidden_layers": "2"})
    refused(tmp_path / "d", "config.json:num_hidden_layers", "int")


def test_writer_drops_a_stale_codebook(tmp_path):
    linears = {"a": weight(128, 128, 2, "mcg"), "b": weight(128, 128, 2, "mul1")}
    config = {"quantization_config": {"quant_method": "exl3", "codebook": "mcg"}}
    write_checkpoint(tmp_path, linears, {}, config)
    reader = open_checkpoint(tmp_path)
    assert "codebook" not in reader.config["quantization_config"] and reader.problems == []


def names(config):
    return set(expected(config).linears), set(expected(config).tensors)


def test_architecture_rules():
    base = {"num_hidden_layers": 2, "tie_word_embeddings": False}
    attention = {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj",
                                                                              "o_proj")}
    dense = lambda i: {f"model.layers.{i}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}  # noqa: E731
    linears, tensors = names({**base, "model_type": "llama"})
    assert linears == attention | dense(0) | dense(1) | {"lm_head"} and not tensors
    linears, _ = names({**base, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True})
    assert linears == attention | dense(0) | dense(1)
    qwen3 = {**base, "model_type": "qwen3_moe", "num_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    linears, tensors = names(qwen3)
    routed = {f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    assert linears == attention | dense(0) | routed | {"lm_head"} and tensors == {"model.layers.1.mlp.gate.weight"}
    linears, tensors = names({**qwen3, "model_type": "qwen2_moe", "mlp_only_layers": []})
    assert {f"model.layers.{i}.mlp.shared_expert.up_proj" for i in range(2)} <= linears
    assert "model.layers.0.mlp.shared_expert_gate.weight" in tensors
    glm = {**base, "model_type": "glm4_moe", "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1}
    linears, tensors = names(glm)
    assert dense(0) <= linears and "model.layers.1.mlp.shared_experts.down_proj" in linears
    assert "model.layers.1.mlp.experts.3.gate_proj" in linears
    assert "model.layers.0.mlp.experts.0.gate_proj" not in linears
    assert tensors == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    linears, _ = names({**base, "model_type": "mixtral", "num_local_experts": 2})
    assert "model.layers.1.block_sparse_moe.experts.1.w2" in linears and not linears & dense(0)
    assert expected({"model_type": "deepseek_v3"}) is None
    with pytest.raises(FormatError, match="num_experts"):
        expected({**base, "model_type": "qwen3_moe"})
