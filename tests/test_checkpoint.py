"""Checkpoint reader and writer: the real exllamav3 fixture, round trips, expert grouping."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from exl3moe import EXL3Weight, ExpertSet, FormatError, open_checkpoint
from exl3moe.format import checkpoint as checkpoint_module
from exl3moe.format import write_checkpoint

FIXTURE = "tiny_qwen3_moe_exl3"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXL3_CONFIG = {"architectures": ["Test"], "quantization_config": {"quant_method": "exl3"}}


def random_weight(k, n, K, codebook="mul1", seed=0, bias=False, name="w"):
    """A valid EXL3Weight with random trellis bits and scales."""
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, int(16 * K)), generator=g, dtype=torch.int32)

    def scale(m):
        return (torch.rand(m, generator=g) + 0.5) * (torch.randint(0, 2, (m,), generator=g) * 2 - 1)

    b = scale(n).half() if bias else None
    return EXL3Weight(trellis.to(torch.int16), scale(k).half(), scale(n).half(), codebook, b, name)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def same_weight(a: EXL3Weight, b: EXL3Weight) -> bool:
    parts = [same_bits(a.trellis, b.trellis), same_bits(a.suh, b.suh), same_bits(a.svh, b.svh)]
    if a.bias is None or b.bias is None:
        bias = a.bias is None and b.bias is None
    else:
        bias = same_bits(a.bias, b.bias)
    return all(parts) and bias and a.codebook == b.codebook


@pytest.fixture(scope="module")
def fixture_path(fixtures_dir):
    return os.path.join(fixtures_dir, FIXTURE)


@pytest.fixture(scope="module")
def reader(fixture_path):
    return open_checkpoint(fixture_path)


def test_fixture_config_is_exl3(reader):
    assert reader.config["quantization_config"]["quant_method"] == "exl3"
    assert reader.config["quantization_config"]["codebook"] == "mul1"


def test_fixture_linears_have_the_documented_K(reader):
    infos = {i.key: i for i in reader.linears()}
    attention = [i for k, i in infos.items() if k.split(".")[-1] in ATTENTION]
    experts = [i for k, i in infos.items() if ".experts." in k]
    assert len(attention) == 8 and {i.K for i in attention} == {4}
    assert len(experts) == 2 * 16 * 3 and {i.K for i in experts} == {2.5}
    assert infos["lm_head"].K == 6 and (infos["lm_head"].in_features, infos["lm_head"].out_features) == (256, 1024)
    assert len(infos) == 8 + 96 + 1
    assert {i.codebook for i in infos.values()} == {"mul1"}
    q, k = infos["model.layers.0.self_attn.q_proj"], infos["model.layers.0.self_attn.k_proj"]
    assert (q.in_features, q.out_features, k.in_features, k.out_features) == (256, 256, 256, 128)
    assert experts[0].trellis_bytes == 16 * 8 * 40 * 2


def test_fixture_info_matches_loaded_weight(reader):
    for info in reader.linears()[:6]:
        w = reader.linear(info.key)
        assert (w.in_features, w.out_features, w.K, w.codebook) == (info.in_features, info.out_features, info.K,
                                                                    info.codebook)
        assert w.trellis_bytes == info.trellis_bytes


def test_fixture_experts_group_into_an_expert_set(reader):
    assert reader.moe_layers() == ["model.layers.0.mlp", "model.layers.1.mlp"]
    experts = reader.experts("model.layers.0.mlp")
    assert isinstance(experts, ExpertSet)
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (16, 256, 128)
    assert experts.gated and experts.name == "model.layers.0.mlp.experts"
    assert {w.K for ws in experts.projections().values() for w in ws} == {2.5}
    assert same_bits(experts.up[3].trellis, reader.tensor("model.layers.0.mlp.experts.3.up_proj.trellis"))
    assert same_bits(experts.down[3].svh, reader.tensor("model.layers.0.mlp.experts.3.down_proj.svh"))
    assert reader.shared_expert("model.layers.0.mlp") is None
    with pytest.raises(KeyError):
        reader.experts("model.layers.7.mlp")


def test_fixture_experts_reproduce_exllamav3_moe_output(reader, fixtures_dir):
    """Loaded experts, evaluated in float64, land where the fixture README says (6.3e-3 from exllamav3)."""
    from safetensors.torch import load_file

    ref = load_file(os.path.join(fixtures_dir, "tiny_qwen3_moe_exl3_moe_outputs.safetensors"))
    experts = reader.experts("model.layers.0.mlp")
    x, sel, w = ref["layer0.x"].double(), ref["layer0.sel"], ref["layer0.w"].double()
    out = torch.zeros(x.shape[0], experts.hidden_size, dtype=torch.float64)
    for e in sel.unique().tolist():
        h = torch.nn.functional.silu(x @ experts.gate[e].dense()) * (x @ experts.up[e].dense())
        y = h @ experts.down[e].dense()
        out += (w * (sel == e)).sum(dim=1, keepdim=True) * y
    rel = (out - ref["layer0.out"].double()).norm() / ref["layer0.out"].double().norm()
    assert rel < 1e-2


def test_fixture_tensors_match_the_safetensors_library(reader, fixture_path):
    with safe_open(os.path.join(fixture_path, "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(reader.keys())
        for key in reader.keys():
            assert same_bits(reader.tensor(key), f.get_tensor(key)), key


def test_open_reads_headers_only(fixture_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tensor data read")

    monkeypatch.setattr(checkpoint_module, "read_tensor", refuse)
    r = open_checkpoint(fixture_path)
    assert len(r.linears()) == 105 and r.moe_layers()
    with pytest.raises(AssertionError):
        r.tensor("model.norm.weight")


def test_tensor_lookup_errors_and_device(reader):
    with pytest.raises(KeyError):
        reader.tensor("no.such.tensor")
    with pytest.raises(KeyError):
        reader.linear("model.norm")
    t = reader.tensor("model.norm.weight", device="cpu")
    assert t.dtype == torch.bfloat16 and t.shape == (256,)
    assert int(reader.tensor("lm_head.mul1")) & 0xFFFFFFFF == 0x83DCD12D


def fixture_contents(reader):
    linears = {i.key: reader.linear(i.key) for i in reader.linears()}
    subkeys = {f"{k}.{s}" for k, w in linears.items() for s in w.stored_tensors()}
    tensors = {k: reader.tensor(k) for k in reader.keys() if k not in subkeys}
    return linears, tensors


def test_round_trip_of_the_fixture_is_identical(reader, fixture_path, tmp_path):
    linears, tensors = fixture_contents(reader)
    names = write_checkpoint(tmp_path, linears, tensors, reader.config)
    assert names == ["model.safetensors"] and not (tmp_path / "model.safetensors.index.json").exists()
    back = open_checkpoint(tmp_path)
    assert back.keys() == reader.keys()
    for key in reader.keys():
        assert same_bits(back.tensor(key), reader.tensor(key)), key
    assert back.config == reader.config
    qc_ours = json.loads((tmp_path / "quantization_config.json").read_text())
    with open(os.path.join(fixture_path, "quantization_config.json")) as f:
        qc_theirs = json.load(f)
    assert qc_ours == qc_theirs


def test_sharded_round_trip_writes_an_index(reader, tmp_path):
    linears, tensors = fixture_contents(reader)
    names = write_checkpoint(tmp_path, linears, tensors, reader.config, max_shard_bytes=300_000)
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(reader.keys()) and set(index["weight_map"].values()) == set(names)
    assert index["metadata"]["total_size"] == reader.tensor_bytes
    back = open_checkpoint(tmp_path)
    for key in reader.keys():
        assert same_bits(back.tensor(key), reader.tensor(key)), key
        with safe_open(str(tmp_path / index["weight_map"][key]), "pt") as f:
            assert same_bits(f.get_tensor(key), reader.tensor(key)), key
    shard_of = {back.entry(f"{i.key}.{s}").shard for i in back.linears() for s in ("trellis", "suh", "svh")
                if i.key == "model.layers.1.mlp.experts.5.gate_proj"}
    assert len(shard_of) == 1


def test_writer_refuses_a_directory_with_shards(tmp_path):
    write_checkpoint(tmp_path, {}, {"x": torch.zeros(2)}, EXL3_CONFIG)
    with pytest.raises(ValueError, match="empty directory"):
        write_checkpoint(tmp_path, {}, {"x": torch.zeros(2)}, EXL3_CONFIG)


def test_writer_refuses_a_key_given_twice(tmp_path):
    w = random_weight(128, 128, 2)
    with pytest.raises(ValueError, match="p.trellis"):
        write_checkpoint(tmp_path, {"p": w}, {"p.trellis": torch.zeros(1)}, EXL3_CONFIG)


def mixed_moe_contents():
    """Experts with per-expert K and codebook, Mixtral w1/w3/w2 names, a shared expert, a dense layer with bias."""
    linears = {}
    for e in range(4):
        K, codebook = [(2, "mcg"), (3, "3inst"), (2.5, "mul1"), (4, "mul1")][e]
        for proj, (k, n) in (("w1", (128, 256)), ("w3", (128, 256)), ("w2", (256, 128))):
            key = f"model.layers.0.block_sparse_moe.experts.{e}.{proj}"
            linears[key] = random_weight(k, n, K, codebook, seed=10 * e + len(proj), name=key)
    for proj, (k, n) in (("gate_proj", (128, 128)), ("up_proj", (128, 128)), ("down_proj", (128, 128))):
        key = f"model.layers.0.block_sparse_moe.shared_experts.{proj}"
        linears[key] = random_weight(k, n, 3, "mcg", seed=len(proj), name=key)
    linears["model.layers.0.self_attn.o_proj"] = random_weight(128, 128, 5, "3inst", seed=7, bias=True)
    tensors = {"model.layers.0.block_sparse_moe.gate.weight": torch.randn(4, 128).half(),
               "model.norm.weight": torch.randn(128).bfloat16(), "flag": torch.tensor([True, False])}
    return linears, tensors


def test_round_trip_of_mixed_experts_and_naming(tmp_path):
    linears, tensors = mixed_moe_contents()
    write_checkpoint(tmp_path, linears, tensors, EXL3_CONFIG)
    r = open_checkpoint(tmp_path)
    for key, w in linears.items():
        assert same_weight(r.linear(key), w), key
    for key, t in tensors.items():
        assert same_bits(r.tensor(key), t), key
    prefix = "model.layers.0.block_sparse_moe"
    assert r.moe_layers() == [prefix]
    experts = r.experts(prefix)
    assert [w.K for w in experts.gate] == [2, 3, 2.5, 4]
    assert [w.codebook for w in experts.up] == ["mcg", "3inst", "mul1", "mul1"]
    assert same_weight(experts.down[2], linears[f"{prefix}.experts.2.w2"])
    assert same_weight(experts.gate[1], linears[f"{prefix}.experts.1.w1"])
    shared = r.shared_expert(prefix)
    assert shared.num_experts == 1 and shared.name == f"{prefix}.shared_experts"
    assert same_weight(shared.up[0], linears[f"{prefix}.shared_experts.up_proj"])
    qc = r.config["quantization_config"]
    assert qc["quant_method"] == "exl3" and "codebook" not in qc and "head_bits" not in qc
    storage = json.loads((tmp_path / "quantization_config.json").read_text())["tensor_storage"]
    assert storage[f"{prefix}.experts.0.w1"]["mcg_multiplier"] == 0xCBAC1FED
    assert storage[f"{prefix}.experts.2.w1"]["bits_per_weight"] == 2.5
    assert storage["model.norm"]["stored_tensors"]["model.norm.weight"]["dtype"] == "torch.bfloat16"


def test_relu2_experts_without_gate(tmp_path):
    linears = {}
    for e in range(3):
        for proj, (k, n) in (("up_proj", (128, 256)), ("down_proj", (256, 128))):
            linears[f"m.experts.{e}.{proj}"] = random_weight(k, n, 3, "mul1", seed=e)
    write_checkpoint(tmp_path, linears, {}, EXL3_CONFIG)
    experts = open_checkpoint(tmp_path).experts("m", activation="relu2")
    assert experts.gate is None and experts.num_experts == 3 and experts.intermediate_size == 256
    with pytest.raises(FormatError, match="gate"):
        open_checkpoint(tmp_path).experts("m", activation="silu")


def test_legacy_sign_fields_are_read(tmp_path):
    w = random_weight(128, 128, 2, "3inst")
    su = torch.full((8,), 0x5555, dtype=torch.int16)
    tensors = {"p.trellis": w.trellis, "p.su": su, "p.svh": w.svh}
    write_checkpoint(tmp_path, {}, tensors, EXL3_CONFIG)
    loaded = open_checkpoint(tmp_path).linear("p")
    assert loaded.suh[:4].tolist() == [-1.0, 1.0, -1.0, 1.0] and loaded.codebook == "3inst"


def test_expert_gaps_and_naming_are_refused(tmp_path):
    linears, tensors = mixed_moe_contents()
    prefix = "model.layers.0.block_sparse_moe"
    del linears[f"{prefix}.experts.2.w3"]
    write_checkpoint(tmp_path / "a", linears, tensors, EXL3_CONFIG)
    with pytest.raises(FormatError, match=rf"{prefix}.experts.2"):
        open_checkpoint(tmp_path / "a").experts(prefix)
    linears, tensors = mixed_moe_contents()
    for proj in ("w1", "w2", "w3"):
        del linears[f"{prefix}.experts.1.{proj}"]
    write_checkpoint(tmp_path / "b", linears, tensors, EXL3_CONFIG)
    with pytest.raises(FormatError, match=rf"{prefix}.experts.1"):
        open_checkpoint(tmp_path / "b").experts(prefix)
    linears, tensors = mixed_moe_contents()
    linears[f"{prefix}.experts.0.gate_proj"] = linears.pop(f"{prefix}.experts.0.w1")
    write_checkpoint(tmp_path / "c", linears, tensors, EXL3_CONFIG)
    with pytest.raises(FormatError, match="mixes"):
        open_checkpoint(tmp_path / "c").experts(prefix)
    linears, tensors = mixed_moe_contents()
    tensors[f"{prefix}.experts.4.w1.weight"] = torch.zeros(256, 128).half()
    write_checkpoint(tmp_path / "d", linears, tensors, EXL3_CONFIG)
    with pytest.raises(FormatError, match=rf"{prefix}.experts.4.w1.*not EXL3-quantized"):
        open_checkpoint(tmp_path / "d").experts(prefix)


def test_written_config_records_quantization_and_untied_head(tmp_path):
    linears = {"lm_head": random_weight(128, 256, 6, seed=1),
               "model.layers.0.mlp.down_proj": random_weight(128, 128, 2)}
    config = {"tie_word_embeddings": True, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    write_checkpoint(tmp_path, linears, {}, config)
    written = open_checkpoint(tmp_path).config
    assert written["tie_word_embeddings"] is False
    qc = written["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["head_bits"], qc["codebook"]) == ("exl3", 2, 6, "mul1")
    assert qc["original_quantization_config"] == {"quant_method": "gptq", "bits": 4}
