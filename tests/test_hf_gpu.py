"""exl3moe.hf on the GPU: the fixture's logits against the dequantized float32 model, greedy generation with
CUDA-graph decode steps (replays, tokens equal to eager), batch invariance of a sequence's logits, a synthetic
model at real Qwen3-30B-A3B widths (two layers) through the same path."""

import os

import pytest
import torch

import transformers  # noqa: E402  (the hf extra; make test installs it)

import exl3moe.hf as hf  # noqa: E402
from exl3moe.hf.synthetic import write_synthetic_checkpoint  # noqa: E402

pytestmark = pytest.mark.gpu
CHECKPOINT = "tiny_qwen3_moe_exl3"
PROMPT_TOKENS, NEW_TOKENS = 16, 8


@pytest.fixture(scope="module")
def path(fixtures_dir):
    return os.path.join(fixtures_dir, CHECKPOINT)


@pytest.fixture(scope="module")
def dense(path):
    return hf.dense_model(path, torch.float32, device="cuda")


@pytest.fixture(scope="module")
def greedy(dense):
    prompt = torch.randint(2, 1024, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        return dense.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


def rel_l2(actual, expected) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm())


def _generate(model, prompt, new_tokens, cache="static"):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, cache_implementation=cache, pad_token_id=0)


def test_logits_match_dense_float32(path, dense, greedy):
    model = hf.from_pretrained(path, device="cuda")
    with torch.no_grad():
        logits, reference = model(greedy).logits, dense(greedy).logits
    assert rel_l2(logits, reference) < 5e-3
    assert torch.equal(logits[0, PROMPT_TOKENS - 1:-1].argmax(-1), greedy[0, PROMPT_TOKENS:])


def test_graph_decode_replays_and_matches_eager(path, greedy):
    model = hf.from_pretrained(path, device="cuda")
    eager = hf.from_pretrained(path, device="cuda", cuda_graphs=False)
    prompt = greedy[:, :PROMPT_TOKENS]
    graphs = model.decode_graphs
    first = _generate(model, prompt, NEW_TOKENS)
    assert (graphs.captures, graphs.replays) == (1, NEW_TOKENS - 2)   # token 1 prefills, token 2 runs and captures
    again = _generate(model, prompt, NEW_TOKENS)        # a new static cache (or the same one, reset)
    assert graphs.captures in (1, 2) and graphs.captures + graphs.replays == 2 * (NEW_TOKENS - 1)
    assert len(graphs.graphs) == 1                      # an older cache's graph is dropped, not kept
    assert torch.equal(first, greedy) and torch.equal(again, greedy)
    assert torch.equal(_generate(eager, prompt, NEW_TOKENS), greedy)
    assert torch.equal(_generate(eager, prompt, NEW_TOKENS, cache=None), greedy)


@pytest.mark.parametrize("batch", [8, 64])
def test_graph_decode_batches(path, batch):
    model = hf.from_pretrained(path, device="cuda")
    prompt = torch.randint(2, 1024, (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(batch)).cuda()
    graphed = _generate(model, prompt, 6)
    assert (model.decode_graphs.captures, model.decode_graphs.replays) == (1, 4)
    model.decode_graphs.enabled = False
    assert torch.equal(_generate(model, prompt, 6), graphed)


def test_sequence_logits_invariant_to_batch_size(path):
    """A sequence's logits are the same bytes alone and among 7 others: prefills of 16 and 128 rows and decode steps
    of 1 and 8 rows all run the 1-128-row linears and one MoE plan (decode_tokens=128)."""
    model = hf.from_pretrained(path, device="cuda", max_batch_tokens=128, decode_tokens=128)
    prompts = torch.randint(2, 1024, (8, PROMPT_TOKENS), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        single = model.generate(prompts[:1], max_new_tokens=4, do_sample=False, cache_implementation="static",
                                output_logits=True, return_dict_in_generate=True)
        batched = model.generate(prompts, max_new_tokens=4, do_sample=False, cache_implementation="static",
                                 output_logits=True, return_dict_in_generate=True)
    assert model.decode_graphs.replays > 0
    for step in range(4):             # step 0: the prefill's last position; then graph-replayed decode steps
        assert torch.equal(single.logits[step][0], batched.logits[step][0]), step


def test_synthetic_qwen3_30b_widths_two_layers(tmp_path):
    from exl3moe.hf_commands import SYNTHETIC

    config = {**SYNTHETIC["qwen3-30b-a3b"], "num_hidden_layers": 2}
    path = str(tmp_path / "ckpt")
    write_synthetic_checkpoint(path, config, K=4, codebook="mcg", device="cuda")
    model = hf.from_pretrained(path, device="cuda", max_batch_tokens=256)
    dense = hf.dense_model(path, torch.float32, device="cuda")
    ids = torch.randint(0, config["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(5)).cuda()
    with torch.no_grad():
        assert rel_l2(model(ids).logits, dense(ids).logits) < 5e-3
        prompt = ids[:1, :8]
        graphed = _generate(model, prompt, 5)
        model.decode_graphs.enabled = False
        assert torch.equal(_generate(model, prompt, 5), graphed)
