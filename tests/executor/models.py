"""Small models for executor tests (Ray workers get them pickled by value)."""

from __future__ import annotations

import torch
from torch import nn


class SkipNet(nn.Module):
    """A DAG with 8 profile layers, like ``digits_cnn``, so both fit one set of stage actors.

    Layers: c1, relu, c2, c3, relu_1, mul (a bare ``nn.Parameter`` gate, read with
    ``get_attr``), add (+ flatten), fc. Cut ``[0, 3) [3, 5) [5, 8)``, the skip ``relu``
    crosses from stage 0 to stage 2 and is relayed by stage 1, and the gate belongs to
    stage 2.
    """

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.c3 = nn.Conv2d(4, 4, 3, padding=1)
        self.gate = nn.Parameter(torch.full((1,), 0.5))
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        c = torch.relu(self.c3(self.c2(a)))
        return self.fc(torch.flatten(c + a * self.gate, 1))


def skipnet(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SkipNet(), torch.randn(1, 1, 8, 8)


class TinyLM(nn.Module):
    """A token model with 8 profile layers whose position embedding has no batch dimension.

    Layers: wte, fc, wpe (with its ``arange``), add, relu, add_1, ln, head. Cut
    ``[0, 3) [3, 5) [5, 8)``, the *shared* value ``wpe`` (shape ``(T, d)``) crosses from
    stage 0 to stage 1, and ``fc`` is relayed to stage 2.
    """

    def __init__(self, vocab: int = 16, context: int = 6, width: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, width)
        self.wpe = nn.Embedding(context, width)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.fc(self.wte(idx))
        x = t + self.wpe(torch.arange(idx.size(1), device=idx.device))
        return self.head(self.ln(torch.relu(x) + t))


def tiny_lm(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM(), torch.randint(16, (1, 6))
