"""Router logits: fp32 within rounding of float64, and a token's bytes whatever tokens are beside it, on the Triton
kernel (interpreter) and the torch path."""

import pytest
import torch

from exl3moe.ops.router import router_logits


@pytest.mark.parametrize("dtype, hidden_size", [(torch.float16, 200), (torch.bfloat16, 200), (torch.float32, 200),
                                                (torch.float16, 1100)])
def test_logits_match_float64_and_do_not_depend_on_the_batch(kernel_path, dtype, hidden_size):
    g = torch.Generator().manual_seed(1)
    # hidden sizes no multiple of the k chunk (1100: three k splits summed in order), nor experts of the expert block
    hidden = torch.randn(70, hidden_size, generator=g).to(dtype)
    weight = torch.randn(71, hidden_size, generator=g).to(dtype)
    full = router_logits(hidden, weight)
    assert full.dtype == torch.float32 and full.shape == (70, 71)
    ref = hidden.double() @ weight.double().t()
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-6
    for rows in (1, 2, 17, 33, 69):
        assert torch.equal(router_logits(hidden[:rows], weight), full[:rows]), rows
    assert torch.equal(router_logits(hidden[5:9], weight), full[5:9])


def test_a_transposed_column_gate_gives_the_same_logits(kernel_path):
    g = torch.Generator().manual_seed(2)
    hidden, gate = torch.randn(9, 256, generator=g).half(), torch.randn(256, 1, generator=g)
    assert torch.equal(router_logits(hidden, gate.t()), router_logits(hidden, gate.t().contiguous()))
