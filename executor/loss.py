"""The training loss: cross-entropy over every prediction, or a user's mean loss.

Stage workers and the single-process reference call the same functions, so a pipelined
step and a whole-batch step compute the same update: :func:`loss_terms` sums the loss of
some samples, :func:`batch_loss` turns that sum into the piece's share of the global-batch
mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeplan.core.errors import PipeplanError


@dataclass(frozen=True)
class LossTerms:
    """Cross-entropy of some samples: the sum, how many predictions, how many were right."""

    loss_sum: torch.Tensor
    predictions: int
    correct: int


def loss_terms(logits: torch.Tensor, labels: torch.Tensor) -> LossTerms:
    """Summed cross-entropy over every prediction (``(..., classes)`` logits, ``(...)`` labels)."""
    flat = logits.reshape(-1, logits.shape[-1])
    target = labels.reshape(-1).long()
    if flat.shape[0] != target.shape[0]:
        raise PipeplanError(
            f"labels: shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}"
        )
    loss = F.cross_entropy(flat, target, reduction="sum")
    correct = int((flat.detach().argmax(dim=1) == target).sum())
    return LossTerms(loss, int(target.shape[0]), correct)


def batch_loss(terms: LossTerms, samples: int, global_batch: int) -> torch.Tensor:
    """This piece's share of the global-batch mean: ``loss_sum / (B x predictions per sample)``.

    Summed over every piece of the batch it is exactly the mean over the whole batch, so
    accumulated gradients equal single-process gradients.
    """
    per_sample = terms.predictions / samples
    return terms.loss_sum / (global_batch * per_sample)
