"""Calibration: tokens, a decoder layer run on them, and each linear's input Hessian X^T X / rows.

Routed experts get the Hessian of the tokens routed to them (gate/up: the block input of those tokens, down: the
expert's own intermediate activation). An expert that received fewer than `min_rows` tokens gets a regularised
Hessian: its rows plus (min_rows - rows) rows' worth of a prior (gate/up: the block input over all tokens; down:
the identity at the expert's mean diagonal, or 1), and is counted. Each expert projection's importance, the
routing-weighted output energy sum_t w_t^2 ||x_t W||^2 / tokens, weights its error in the width allocation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ContractError, FormatError
from .source import linear_modules, moe_blocks

DEFAULT_MIN_ROWS = 32
DEFAULT_SEQ_LEN = 256
EXPERT_ARGS = ("hidden_states", "top_k_index", "top_k_weights")   # transformers' experts forward


def calibration_tokens(spec: str, source_path: str, rows: int, vocab_size: int, seed: int = 0,
                       seq_len: int = DEFAULT_SEQ_LEN) -> torch.Tensor:
    """[sequences, seq_len] token ids: `spec` 'random' (seeded uniform ids) or a text file tokenized with the
    checkpoint's tokenizer, cut into sequences; `rows` tokens in all (rounded down to whole sequences, at least 1)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ContractError("rows", f"must be a positive number of calibration tokens, got {rows!r}")
    seq_len = min(seq_len, rows)
    count = max(1, rows // seq_len)
    if spec == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (count, seq_len), generator=g)
    if not os.path.isfile(spec):
        raise FormatError(spec, "calibration must be 'random' or a text file")
    from transformers import AutoTokenizer

    with open(spec, encoding="utf-8") as f:
        text = f.read()
    ids = AutoTokenizer.from_pretrained(source_path, local_files_only=True)(text)["input_ids"]
    if len(ids) < seq_len:
        raise FormatError(spec, f"holds {len(ids)} tokens, fewer than one sequence of {seq_len}")
    count = min(count, len(ids) // seq_len)
    return torch.tensor(ids[: count * seq_len]).reshape(count, seq_len)


class HessianSum:
    """Running X^T X (float64) and row count of one linear's input."""

    def __init__(self, k: int, device):
        self.sum = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum += (x.T @ x).double()
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor | None:
        return None if self.rows == 0 else self.sum / self.rows


@dataclass
class ExpertCalibration:
    """One routed-expert block: per-expert Hessian sums, token counts and per-projection importance."""

    gate_up: list
    down: list
    block: HessianSum
    tokens: torch.Tensor            # [E] rows routed to each expert
    importance: torch.Tensor        # [E, 3] routing-weighted output energy of gate, up, down
    total_tokens: int = 0
    regularised: list = field(default_factory=list)

    def hessians(self, e: int, min_rows: int) -> tuple:
        """(gate/up H, down H) of expert e, regularised below min_rows rows."""
        n = int(self.tokens[e])
        gu, down = self.gate_up[e], self.down[e]
        if n >= min_rows:
            return gu.hessian(), down.hessian()
        if e not in self.regularised:
            self.regularised.append(e)
        missing = min_rows - n
        prior = self.block.hessian()
        gu_h = (gu.sum + missing * prior) / min_rows
        k = down.sum.shape[0]
        level = float(down.sum.diagonal().mean()) / n if n else 1.0
        eye = torch.eye(k, dtype=torch.float64, device=down.sum.device)
        return gu_h, (down.sum + missing * max(level, 1e-6) * eye) / min_rows


def _expert_hook(cal: ExpertCalibration, experts: nn.Module):
    def hook(module, args, kwargs):
        hidden, ids, weights = list(args[:3]) + [kwargs[k] for k in EXPERT_ARGS[len(args[:3]):]]
        hidden = hidden.reshape(-1, hidden.shape[-1]).float()
        cal.block.add(hidden)
        cal.total_tokens += hidden.shape[0]
        for e in range(len(cal.gate_up)):
            token, slot = torch.where(ids == e)
            if token.numel() == 0:
                continue
            x = hidden[token]
            w2 = weights[token, slot].float().square()
            gate, up = (x @ experts.gate_up_proj[e].float().T).chunk(2, dim=-1)
            h = experts.act_fn(gate) * up
            out = h @ experts.down_proj[e].float().T
            cal.gate_up[e].add(x)
            cal.down[e].add(h)
            cal.tokens[e] += token.numel()
            for p, y in enumerate((gate, up, out)):
                cal.importance[e, p] += float((w2 * y.square().sum(-1)).sum())
    return hook


class LayerCalibration:
    """Hooks on one materialised decoder layer collecting every linear's Hessian while it runs."""

    def __init__(self, layer: nn.Module, device):
        self.linears = {n: HessianSum(m.in_features, device) for n, m in linear_modules(layer).items()}
        self.experts = {}
        self._handles = []
        for name, module in linear_modules(layer).items():
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, s=self.linears[name]: s.add(args[0])))
        for name, block in moe_blocks(layer).items():
            E, two_i, hidden = block.experts.gate_up_proj.shape
            cal = ExpertCalibration([HessianSum(hidden, device) for _ in range(E)],
                                    [HessianSum(two_i // 2, device) for _ in range(E)], HessianSum(hidden, device),
                                    torch.zeros(E, dtype=torch.int64), torch.zeros(E, 3, dtype=torch.float64))
            self.experts[name] = cal
            self._handles.append(block.experts.register_forward_pre_hook(_expert_hook(cal, block.experts),
                                                                         with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.no_grad()
def run_layer(layer: nn.Module, states: torch.Tensor, rotary: nn.Module, device, batch: int = 8) -> torch.Tensor:
    """The layer's output for `states` [sequences, seq_len, hidden] (CPU float32), `batch` sequences at a time."""
    out = torch.empty_like(states)
    seq_len = states.shape[1]
    for first in range(0, states.shape[0], batch):
        h = states[first:first + batch].to(device)
        pos = torch.arange(seq_len, device=device).expand(h.shape[0], seq_len)
        y = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rotary(h, pos))
        out[first:first + batch] = (y[0] if isinstance(y, tuple) else y).to("cpu", torch.float32)
    return out
