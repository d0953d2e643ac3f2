"""Models the benchmarks name by reference (``bench.models:small_resnet``), as a user's
factory would be: a callable returning an ``nn.Module``, its options as keyword arguments.

- :func:`small_resnet`: a ResNet-like convolutional net for 32 x 32 images -- a stem, residual
  blocks at two widths, global average pooling and a linear head. Its normalisation is
  ``GroupNorm`` (per sample), not batch norm, so a step's loss does not depend on how the
  pipeline splits the batch into microbatches: deterministic training on any plan must give
  single-process training's losses.

Input: ``--input-shape 3,32,32`` (float32); output: ``classes`` logits.
"""

from __future__ import annotations

import torch
from torch import nn


class Residual(nn.Module):
    """``relu(x + norm(conv(relu(norm(conv(x))))))``: a basic block at one width."""

    def __init__(self, width: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(y)))


def small_resnet(
    width: int = 16, blocks: int = 2, classes: int = 10, channels: int = 3, groups: int = 4
) -> nn.Module:
    """``blocks`` residual blocks at ``width``, a strided convolution to ``2 * width``,
    ``blocks`` more, then pooling and a linear layer to ``classes`` logits."""
    if width < 1 or blocks < 1 or classes < 2 or width % groups:
        raise ValueError(
            f"small_resnet: width ({width}) and blocks ({blocks}) must be >= 1, classes "
            f"({classes}) >= 2 and width divisible by groups ({groups})"
        )
    wide = 2 * width
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1, bias=False),
        nn.GroupNorm(groups, width),
        nn.ReLU(),
        *(Residual(width, groups) for _ in range(blocks)),
        nn.Conv2d(width, wide, 3, stride=2, padding=1, bias=False),
        nn.GroupNorm(groups, wide),
        nn.ReLU(),
        *(Residual(wide, groups) for _ in range(blocks)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(wide, classes),
    )
