"""A user's code for ``--data`` and ``--loss`` references in the tests
(``tests.executor.user_code:NAME``): data sets, batch iterables and losses, good and bad."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from pipeplan.executor.model import Batch

SAMPLES = 10
"""Samples of :func:`dataset`: 1 x 4 x 4 images, labels 0..3."""
NOT_CALLABLE = 3


def dataset() -> Dataset[tuple[torch.Tensor, torch.Tensor]]:
    """A map-style data set of ``SAMPLES`` samples, sample ``i`` filled with ``i``."""
    x = torch.arange(SAMPLES, dtype=torch.float32).reshape(-1, 1, 1, 1).expand(-1, 1, 4, 4)
    return TensorDataset(x.contiguous(), torch.arange(SAMPLES) % 4)


def batches() -> list[Batch]:
    """Three batches of 2, as a list (sized, read again every epoch)."""
    return [(torch.full((2, 1, 4, 4), float(k)), torch.tensor([k % 4, 0])) for k in range(3)]


def generator() -> Iterator[Batch]:
    """Two batches of 2 from a generator (unsized, read once)."""
    for k in range(2):
        yield torch.full((2, 1, 4, 4), float(k)), torch.tensor([k, 0])


def nothing() -> int:
    return 3


def mean_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus a penalty on the outputs: a mean over the samples."""
    return F.cross_entropy(outputs, targets) + 0.1 * outputs.pow(2).mean()


def vector_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Wrong: one loss per sample instead of their mean."""
    return F.cross_entropy(outputs, targets, reduction="none")


def int_loss(outputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Wrong: not a tensor."""
    return 0


READ: list[int] = []
"""The indices :func:`counted`'s data sets have read, in order."""


class _Counted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        READ.append(i)
        return torch.full((1, 4, 4), float(i)), torch.tensor(i % 4)


def counted() -> Dataset[tuple[torch.Tensor, torch.Tensor]]:
    """40 samples that log every read into ``READ``."""
    return _Counted()


def singles() -> list[torch.Tensor]:
    """Wrong: inputs without targets."""
    return [torch.zeros(2, 1, 4, 4)]


def empty() -> list[Batch]:
    """Wrong: no batches at all."""
    return []


def wide() -> list[Batch]:
    """Wrong for a 1 x 4 x 4 model: 1 x 4 x 5 inputs."""
    return [(torch.zeros(2, 1, 4, 5), torch.zeros(2, dtype=torch.long))]


def regression() -> list[Batch]:
    """Float targets of 3 values a sample, for a user's loss."""
    return [(torch.zeros(2, 1, 4, 4), torch.linspace(0, 1, 6).reshape(2, 3))]


def count_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Wrong: an integer tensor (no gradient)."""
    return (outputs.argmax(dim=1) == targets).sum()
