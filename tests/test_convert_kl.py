"""KL of a converted model's next-token distributions against the original's per K, on one tiny qwen3 (dense, one
layer, random init of std 0.1, tied embeddings): each K's conversion read back strictly, every tensor written, run by
exl3moe.hf.from_pretrained, its KL inside a band whose top is the stated bound and whose floor lies above the next
K's top, so that the KL falls as K rises."""

import pytest
import torch

from convert_models import FAST_ENCODE, INIT, check_written, next_token_kl, save_tiny_model, tiny_config
from exl3moe.convert import quantize_model
from exl3moe.format.checkpoint import open_checkpoint
import exl3moe.hf as hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# K -> (floor, stated bound) of the mean next-token KL(original || converted); measured figures: docs/convert.md.
KL_BAND = {2: (0.15, 0.4), 4: (0.01, 0.03), 6: (8e-4, 3e-3)}


@pytest.fixture(scope="module")
def source(tmp_path_factory, one_torch_thread):
    src = str(tmp_path_factory.mktemp("kl") / "in")
    return src, save_tiny_model(src, tiny_config("qwen3", initializer_range=INIT))


def test_bands_fall_as_k_rises():
    Ks = sorted(KL_BAND)
    assert all(KL_BAND[k][0] < KL_BAND[k][1] for k in Ks)
    assert all(KL_BAND[hi][1] < KL_BAND[lo][0] for lo, hi in zip(Ks, Ks[1:]))


@pytest.mark.parametrize("K", sorted(KL_BAND))
def test_kl_per_k(tmp_path, source, K):
    src, original = source
    out = str(tmp_path / "out")
    quantize_model(src, out, bits=K, rows=256, device="cpu", log=lambda *_: None, **FAST_ENCODE)
    check_written(src, open_checkpoint(out, strict=True), set(), K)
    model = hf.from_pretrained(out, device="cpu", dtype=torch.float16)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        kl = next_token_kl(original(ids).logits, model(ids).logits)
    print(f"qwen3: mean KL at K{K} {kl:.3g}")
    floor, bound = KL_BAND[K]
    assert floor < kl < bound
