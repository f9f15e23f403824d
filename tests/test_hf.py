"""exl3moe.hf on the tiny Qwen3-MoE fixture: loading, logits and greedy tokens against the dequantized float32
transformers model, generate(), the AutoModelForCausalLM path, and every refusal (before any tensor is read)."""

import json
import os
import shutil

import pytest
import torch

import transformers  # noqa: E402  (the hf extra; make test installs it)

from safetensors.torch import load_file, save_file  # noqa: E402

import exl3moe.hf as hf  # noqa: E402
from exl3moe import FormatError  # noqa: E402
from exl3moe.format.checkpoint import CheckpointReader  # noqa: E402
from exl3moe.hf import graphs  # noqa: E402
from exl3moe.ops.modules import EXL3Linear  # noqa: E402
from exl3moe.hf.moe_dispatch import EXL3MoEByTokens  # noqa: E402
from exl3moe.ops.moe_module import EXL3MoE  # noqa: E402

CHECKPOINT = "tiny_qwen3_moe_exl3"
PROMPT_TOKENS, NEW_TOKENS = 16, 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def path(fixtures_dir):
    return os.path.join(fixtures_dir, CHECKPOINT)


@pytest.fixture(scope="module")
def dense(path):
    """The float32 transformers model with every quantized weight dequantized (built on the torch path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        return hf.dense_model(path, torch.float32)


@pytest.fixture(scope="module")
def greedy(dense):
    """A 16-token prompt and the dense model's 8 greedy tokens after it: [1, 24]."""
    prompt = torch.randint(2, 1024, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return dense.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm())


def test_modules_replaced_and_tensors_loaded(path):
    model = hf.from_pretrained(path, device="cpu", max_batch_tokens=48)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    layer = model.model.layers[1]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer.self_attn, proj), EXL3Linear)
    assert isinstance(model.lm_head, EXL3Linear) and model.lm_head.weight.K == 6
    assert isinstance(layer.mlp, EXL3MoEByTokens) and layer.mlp.prefill is None
    assert isinstance(layer.mlp.decode, EXL3MoE) and layer.mlp.decode.max_tokens == 48
    assert layer.mlp.decode.router.top_k == 4
    assert model.lm_head.max_rows == 48
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    stored = load_file(os.path.join(path, "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"].half())
    assert torch.equal(layer.self_attn.k_norm.weight, stored["model.layers.1.self_attn.k_norm.weight"].half())
    assert torch.equal(layer.mlp.decode.router.weight, stored["model.layers.1.mlp.gate.weight"].float())
    assert model.generation_config.eos_token_id == json.load(open(os.path.join(path, "generation_config.json")))[
        "eos_token_id"]
    assert not model.training


def test_logits_and_greedy_tokens_match_dense_float32(path, dense, greedy):
    """16-token prompt + 8 greedy tokens, one teacher-forced call: runs the Triton kernels under the interpreter."""
    model = hf.from_pretrained(path, device="cpu", max_batch_tokens=32)
    with torch.no_grad():
        logits = model(greedy).logits
        reference = dense(greedy).logits
    assert logits.dtype == torch.float16
    assert rel_l2(logits, reference) < 5e-3
    predicted = logits[0, PROMPT_TOKENS - 1:-1].argmax(-1)
    assert torch.equal(predicted, greedy[0, PROMPT_TOKENS:])


def test_decode_and_large_calls_plan_apart_over_one_set_of_weights(path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = hf.from_pretrained(path, device="cpu", max_batch_tokens=40, decode_tokens=4)
    block = model.model.layers[0].mlp
    assert (block.decode.max_tokens, block.prefill.max_tokens) == (4, 40)
    assert block.prefill.experts is block.decode.experts and block.prefill.router is block.decode.router
    hidden = torch.randn(2, 3, 256, dtype=torch.float16)
    with torch.no_grad():
        for tokens in (3, 6):
            chosen = block.decode if tokens <= 4 else block.prefill
            x = hidden.reshape(-1, 256)[:tokens]
            assert torch.equal(block(x), chosen(x))
    assert block.decode.max_tokens == 4 and block.prefill.max_tokens == 40   # neither re-planned


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_matches_dense_greedy(path, greedy, cache, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = hf.from_pretrained(path, device="cpu")
    prompt = greedy[:, :PROMPT_TOKENS]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation=cache)
    assert torch.equal(out, greedy)


def test_automodel_from_pretrained_is_the_same_model(path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    auto = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    ours = hf.from_pretrained(path, device="cpu")
    assert isinstance(auto.config.quantization_config, hf.Exl3Config)
    assert isinstance(auto.model.layers[0].mlp, EXL3MoEByTokens) and isinstance(auto.lm_head, EXL3Linear)
    assert sorted(auto.state_dict()) == sorted(ours.state_dict())
    ids = torch.arange(5, 5 + PROMPT_TOKENS).view(1, -1)
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, ours(ids).logits)


# Refusals: each checkpoint below is the fixture with one thing broken; nothing may be read before the FormatError.

def _copy(src, dst, drop=(), edit=None, config=None):
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), dst)
    tensors = {k: v for k, v in load_file(os.path.join(src, "model.safetensors")).items() if k not in drop}
    tensors.update(edit or {})
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    if config:
        with open(os.path.join(src, "config.json")) as f:
            doc = json.load(f)
        doc.update(config)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(doc, f)
    return dst


@pytest.fixture
def no_reads(monkeypatch):
    def refuse(self, key, *args, **kwargs):
        raise AssertionError(f"{key} read before the refusal")
    monkeypatch.setattr(CheckpointReader, "tensor", refuse)
    monkeypatch.setattr(CheckpointReader, "linear", refuse)


BROKEN = {
    "missing norm": (dict(drop=["model.layers.1.post_attention_layernorm.weight"]),
                     "model.layers.1.post_attention_layernorm.weight"),
    "missing router": (dict(drop=["model.layers.0.mlp.gate.weight"]), "model.layers.0.mlp.gate.weight"),
    "missing expert": (dict(drop=[f"model.layers.1.mlp.experts.15.down_proj.{s}" for s in ("trellis", "suh", "svh", "mul1")]),
                       "model.layers.1.mlp.experts.15.down_proj"),
    "missing projection": (dict(drop=[f"model.layers.0.self_attn.v_proj.{s}" for s in ("trellis", "suh", "svh", "mul1")]),
                           "model.layers.0.self_attn.v_proj"),
    "vocabulary size": (dict(config={"vocab_size": 2048}), "lm_head.trellis"),
    "embedding shape": (dict(edit={"model.embed_tokens.weight": torch.zeros(1024, 128, dtype=torch.bfloat16)}),
                        "model.embed_tokens.weight"),
    "expert shape": (dict(config={"moe_intermediate_size": 256}), "model.layers.0.mlp.experts.0"),
    "expert count": (dict(config={"num_experts": 32, "num_local_experts": 32}), "model.layers.0.mlp.experts"),
    "router config": (dict(config={"num_experts": 32}), "model.layers.0.mlp.experts.16"),
    "top k": (dict(config={"num_experts_per_tok": 17}), "config.json:num_experts_per_tok"),
    "attention shape": (dict(config={"num_attention_heads": 8}), "model.layers.0.self_attn.q_proj.trellis"),
    "router shape": (dict(edit={"model.layers.1.mlp.gate.weight": torch.zeros(16, 128, dtype=torch.float16)}),
                     "model.layers.1.mlp.gate.weight"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_checkpoint_refused_before_reading(path, tmp_path, case, no_reads):
    changes, name = BROKEN[case]
    broken = _copy(path, str(tmp_path / "ckpt"), **changes)
    with pytest.raises(FormatError) as err:
        hf.from_pretrained(broken, device="cpu")
    assert err.value.name.startswith(name), str(err.value)


@pytest.mark.parametrize("case", ["missing router", "expert shape"])
def test_automodel_refuses_broken_checkpoint(path, tmp_path, case, no_reads):
    changes, name = BROKEN[case]
    broken = _copy(path, str(tmp_path / "ckpt"), **changes)
    with pytest.raises(FormatError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(broken)
    assert err.value.name.startswith(name), str(err.value)


def test_unsupported_architecture_named(path, tmp_path, no_reads):
    broken = _copy(path, str(tmp_path / "ckpt"), config={"model_type": "deepseek_v3",
                                                         "architectures": ["DeepseekV3ForCausalLM"]})
    with pytest.raises(FormatError, match="deepseek_v3.*DeepseekV3ForCausalLM"):
        hf.from_pretrained(broken, device="cpu")


def test_malformed_header_refused(path, tmp_path):
    broken = _copy(path, str(tmp_path / "ckpt"))
    shard = os.path.join(broken, "model.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[8:9] = b"["
    open(shard, "wb").write(bytes(data))
    with pytest.raises(FormatError, match="model.safetensors"):
        hf.from_pretrained(broken, device="cpu")


def test_load_arguments_refused(path):
    with pytest.raises(ValueError, match="dtype"):
        hf.from_pretrained(path, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        hf.from_pretrained(path, device="cpu", max_batch_tokens=0)
    with pytest.raises(ValueError, match="decode_tokens"):
        hf.from_pretrained(path, device="cpu", decode_tokens=True)


def test_decode_graphs_hook_and_step_layout(path, greedy, monkeypatch):
    """generate() with a static cache asks get_compiled_call for the decode forward; DecodeGraphs gets every
    one-token step with one layout and one cache (so one graph would serve them) and runs CPU steps eagerly."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = hf.from_pretrained(path, device="cpu")
    assert model.generation_config.disable_compile          # no torch.compile of the kernels' launchers
    runner = hf.install_decode_graphs(model)
    keys = []

    def spy(**kwargs):
        keys.append((graphs.step_key(kwargs), graphs.capturable(kwargs), kwargs["input_ids"].shape))
        return runner(**kwargs)
    model.get_compiled_call = lambda compile_config=None: spy
    model.generation_config.disable_compile = False
    compile_config = transformers.CompileConfig()
    compile_config._compile_all_devices = True               # the CPU stands in for the GPU here
    with torch.no_grad():
        out = model.generate(greedy[:, :PROMPT_TOKENS], max_new_tokens=NEW_TOKENS, do_sample=False,
                             cache_implementation="static", compile_config=compile_config)
    assert torch.equal(out, greedy)
    assert len(keys) == NEW_TOKENS - 1 and all(shape == (1, 1) for _, _, shape in keys)
    assert len({key for key, _, _ in keys}) == 1 and not any(ok for _, ok, _ in keys)
    assert (runner.captures, runner.replays) == (0, 0)


def test_step_tensors_inside_mask_dicts():
    mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    kwargs = {"input_ids": torch.ones(2, 1, dtype=torch.long), "attention_mask": {"full_attention": mask},
              "use_cache": True}
    found = graphs.step_tensors(kwargs)
    assert set(found) == {("input_ids",), ("attention_mask", "full_attention")}
    fresh = {path: t.clone() for path, t in found.items()}
    rebuilt = graphs.with_tensors(kwargs, fresh)
    assert rebuilt["attention_mask"]["full_attention"] is fresh[("attention_mask", "full_attention")]
    assert kwargs["attention_mask"]["full_attention"] is mask                # the caller's dict is left alone
    other = {**kwargs, "attention_mask": {"full_attention": torch.ones_like(mask)}}
    assert graphs.step_key(other) == graphs.step_key(kwargs)               # values are not part of the layout
    assert graphs.step_key({**kwargs, "input_ids": torch.ones(3, 1, dtype=torch.long)}) != graphs.step_key(kwargs)
