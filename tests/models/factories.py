"""Model factories and example functions that tests name by reference
(``tests.models.factories:mlp``), as a user names their own."""

from __future__ import annotations

import torch
from torch import nn


def mlp(width: int = 8, depth: int = 2, classes: int = 4, bias: bool = True) -> nn.Module:
    """``depth`` linear layers with ReLUs between them, ``width`` features in."""
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes, bias=bias))


def mlp_example() -> torch.Tensor:
    """A batch-1 input of :func:`mlp`'s default width."""
    return torch.randn(1, 8)


def two_examples() -> torch.Tensor:
    """Not an example: a batch of 2."""
    return torch.randn(2, 8)


def token_model(vocab: int = 16, width: int = 8) -> nn.Module:
    """Token ids ``(B, T)`` -> logits ``(B, T, vocab)``."""
    return nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, vocab))


def not_a_module() -> int:
    return 3


class ShapeBranch(nn.Module):
    """Branches on a shape: torch.fx cannot trace it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if x.shape[-1] > 4:
            h = h * 2
        return self.fc2(h)


class ValueBranch(nn.Module):
    """Branches on a value: neither torch.fx nor torch.export can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:
            return y * 2
        return y
