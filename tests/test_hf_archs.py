"""Every supported architecture on a synthetic EXL3 checkpoint (random trellises at tiny shapes): the modules
exl3moe swaps in, logits against the dequantized float32 transformers model, and the architecture refusals."""

import json
import os

import pytest
import torch

import transformers  # noqa: E402  (the hf extra; make test installs it)

import exl3moe.hf as hf  # noqa: E402
from exl3moe import FormatError  # noqa: E402
from exl3moe.format.checkpoint import open_checkpoint  # noqa: E402
from exl3moe.hf.moe_dispatch import EXL3MoEByTokens  # noqa: E402
from exl3moe.hf.synthetic import write_synthetic_checkpoint  # noqa: E402
from exl3moe.ops.modules import EXL3Linear  # noqa: E402
from exl3moe.ops.moe_module import EXL3MoE  # noqa: E402
from helpers import synthetic_checkpoints  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_path_one_thread")

COMMON = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, head_dim=64, max_position_embeddings=256)
CONFIGS = {
    "qwen3_moe": dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=256, attention_bias=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                     n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True),
    "llama": {},
    "qwen3": {},
}
# (MoE layers, what the shared expert is) per architecture.
MOE_LAYERS = {"qwen3_moe": (2, "none"), "qwen2_moe": (2, "gated"), "mixtral": (2, "none"),
              "glm4_moe": (1, "always-on"), "llama": (0, None), "qwen3": (0, None)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return synthetic_checkpoints(tmp_path_factory, CONFIGS, COMMON, K=4)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_architecture_logits_match_dense(checkpoints, model_type):
    path = checkpoints[model_type]
    model = hf.from_pretrained(path, device="cpu")
    dense = hf.dense_model(path, torch.float32)
    moe = [m for m in model.modules() if isinstance(m, EXL3MoEByTokens)]
    layers, shared = MOE_LAYERS[model_type]
    assert len(moe) == layers
    assert all(isinstance(m.decode, EXL3MoE) and f"shared={shared}" in m.decode.extra_repr() for m in moe)
    assert isinstance(model.lm_head, EXL3Linear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, reference = model(ids).logits, dense(ids).logits
    assert rel_l2(logits, reference) < 5e-3


def test_mixtral_original_names(checkpoints):
    """Converters keep Mixtral's block_sparse_moe / w1 w3 w2 names; transformers 5 calls the block mlp."""
    reader = open_checkpoint(checkpoints["mixtral"])
    assert reader.moe_layers() == ["model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.trellis" in reader


def test_glm4_router_rule(checkpoints):
    router = hf.from_pretrained(checkpoints["glm4_moe"], device="cpu").model.layers[1].mlp.decode.router
    assert (router.kind, router.n_group, router.topk_group, router.routed_scaling_factor) == ("sigmoid", 2, 1, 2.5)
    assert router.correction_bias is not None


def _edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        doc = json.load(f)
    doc.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(doc, f)


def test_shared_expert_the_architecture_lacks_refused(tmp_path):
    """A qwen2_moe checkpoint relabelled qwen3_moe stores a shared expert transformers' block does not have."""
    path = str(tmp_path / "ckpt")
    write_synthetic_checkpoint(path, dict(model_type="qwen2_moe", **COMMON, **CONFIGS["qwen2_moe"]))
    _edit_config(path, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], attention_bias=True)
    with pytest.raises(FormatError, match="shared_expert"):
        hf.from_pretrained(path, device="cpu")


def test_bias_disagreeing_with_config_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    write_synthetic_checkpoint(path, dict(model_type="llama", attention_bias=True, **COMMON))
    _edit_config(path, attention_bias=False)
    with pytest.raises(FormatError, match=r"q_proj\.bias: stored"):
        hf.from_pretrained(path, device="cpu")


def test_unsupported_architecture_refused_by_synthetic_writer(tmp_path):
    with pytest.raises(FormatError, match="phi3"):
        write_synthetic_checkpoint(str(tmp_path / "x"), dict(model_type="phi3", **COMMON))
