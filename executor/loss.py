"""The training loss: cross-entropy over every prediction, or a user's mean loss.

Stage workers and the single-process reference call the same functions, so a pipelined
step and a whole-batch step compute the same update: :meth:`Loss.terms` (or
:func:`loss_terms` for cross-entropy) sums the loss of some samples, :func:`batch_loss`
turns that sum into the piece's share of the global-batch mean.

``--loss`` is parsed into a :class:`LossSpec` (:mod:`executor.loss_spec`: a picklable value,
read without torch; nothing is imported), which each worker turns into a :class:`Loss` with
:func:`load_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeplan.core.code import load_callable
from pipeplan.core.errors import PipeplanError
from pipeplan.executor.loss_spec import CROSS_ENTROPY as CROSS_ENTROPY
from pipeplan.executor.loss_spec import LossSpec as LossSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A user's loss: ``(outputs, targets) -> scalar``, the mean over the samples given."""


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


@dataclass(frozen=True)
class Loss:
    """A loaded :class:`LossSpec`: what the last stage and the single-process reference call.

    A user's function must return the *mean* over the samples it is given: its terms count
    ``mean x samples`` as the sum, so that :func:`batch_loss` summed over microbatches is the
    mean over the global batch, and pipelined training equals single-process training. A sum
    (or any loss that is not a per-sample mean) would weigh microbatches differently from the
    whole batch. Accuracy is not measured for it (``correct`` is 0).
    """

    spec: LossSpec
    fn: LossFn | None = None

    def terms(self, outputs: torch.Tensor, targets: torch.Tensor) -> LossTerms:
        """The summed loss of these samples, for :func:`batch_loss`."""
        if self.fn is None:
            return loss_terms(outputs, targets)
        value = self.fn(outputs, targets)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = (
                f"a tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else f"a {type(value).__name__}"
            )
            raise PipeplanError(f"loss: {self.spec.ref!r} must return a scalar tensor, got {got}")
        if not value.is_floating_point():
            raise PipeplanError(
                f"loss: {self.spec.ref!r} must return a floating tensor, got {value.dtype}"
            )
        samples = int(outputs.shape[0])
        return LossTerms(value.reshape(()) * samples, samples, 0)


def load_loss(spec: LossSpec) -> Loss:
    """The :class:`Loss` of ``spec``, importing a user's function (in the worker that calls)."""
    if spec.kind == "code":
        return Loss(spec, load_callable(str(spec.ref), "loss"))
    return Loss(spec)
