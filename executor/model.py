"""What the pipeline trains, and the single-process reference it must agree with.

The optimizer lives here and the loss in :mod:`pipeplan.executor.loss` (re-exported), so
that stage workers and :func:`train_single_process` compute the same update: cross-entropy
averaged over every prediction of the global batch (one per sample for classifiers, one per
token for the GPT), then one SGD or Adam step.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeplan.core.errors import PipeplanError
from pipeplan.executor.config import OPTIMIZERS as OPTIMIZERS
from pipeplan.executor.config import OptimizerConfig as OptimizerConfig
from pipeplan.executor.loss import LossTerms as LossTerms
from pipeplan.executor.loss import batch_loss as batch_loss
from pipeplan.executor.loss import loss_terms as loss_terms
from pipeplan.models.spec import InputDtype, build_model

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(inputs, labels)`` of one global batch."""


@dataclass(frozen=True, eq=False)
class ModelSource:
    """How every stage worker (and the reference) builds the same model with the same weights.

    A referenced model is rebuilt from its reference, options and seed inside each worker
    (nothing large is shipped; the forms of a reference: :mod:`models.spec`); a ``module``
    given directly is pickled to the workers instead.
    """

    name: str
    """The model's reference: a zoo name, ``package.module:factory`` or ``hf:ClassName``."""
    input_size: int | None = None
    """Image side or sequence length (zoo and ``hf:`` models)."""
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the zoo builder, the factory or the ``hf:`` config."""
    module: nn.Module | None = None
    example: torch.Tensor | None = None
    """The example input of a ``module`` given directly (:meth:`custom`)."""
    input_shape: tuple[int, ...] | None = None
    """A factory's input shape without the batch dimension."""
    input_dtype: InputDtype | None = None
    """A factory's input dtype with ``input_shape`` (default ``float32``)."""
    example_ref: str | None = None
    """A factory's example function, ``package.module:function`` (instead of a shape)."""

    @classmethod
    def custom(cls, module: nn.Module, example: torch.Tensor, name: str = "custom") -> ModelSource:
        """A ready model and an example input of batch 1."""
        if example.dim() < 1 or example.shape[0] != 1:
            raise PipeplanError(
                f"model {name!r}: example input needs batch size 1, "
                f"got shape {tuple(example.shape)}"
            )
        return cls(name=name, module=module, example=example)

    def build(self) -> tuple[nn.Module, torch.Tensor]:
        """``(model, example_input)``; the same weights on every call."""
        if self.module is not None:
            if self.example is None:
                raise PipeplanError(f"model {self.name!r}: a custom module needs an example input")
            return copy.deepcopy(self.module), self.example.clone()
        return build_model(
            self.name,
            self.input_size,
            seed=self.seed,
            options=self.options,
            input_shape=self.input_shape,
            input_dtype=self.input_dtype,
            example=self.example_ref,
        )


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout module's probability to 0, so training is deterministic."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0


def timing_loss(logits: torch.Tensor) -> torch.Tensor:
    """The last stage's loss work on ``logits`` against labels of class 0, for profiling: a
    profile timed with it (:func:`models.profiler.profile_model`, ``loss``) costs what a
    stage worker computes (:meth:`executor.stage.StageWorker.forward`)."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return loss_terms(logits, labels).loss_sum


@dataclass(frozen=True)
class ReferenceResult:
    """Parameters after training single-process, and the loss and accuracy of every step."""

    parameters: dict[str, torch.Tensor]
    losses: tuple[float, ...]
    accuracies: tuple[float, ...]


SGD = OptimizerConfig()
"""The default optimizer (a frozen value, shared)."""


def train_single_process(
    source: ModelSource,
    batches: Sequence[Batch],
    optimizer: OptimizerConfig = SGD,
    *,
    deterministic: bool = False,
    device: torch.device | str = "cpu",
) -> ReferenceResult:
    """Train the model in this process on whole batches: what a pipeline must reproduce.

    ``deterministic`` disables dropout, as the pipeline's option of the same name does.
    ``device``: where to train (a GPU, to compare with stages of a CUDA type); the
    parameters come back on the CPU.
    """
    model, _ = source.build()
    if deterministic:
        disable_dropout(model)
    model.to(device).train()
    opt = optimizer.make(model.parameters())
    losses, accuracies = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        x, y = x.to(device), y.to(device)
        terms = loss_terms(model(x), y)
        batch_loss(terms, x.shape[0], x.shape[0]).backward()
        opt.step()
        losses.append(float(terms.loss_sum.detach()) / terms.predictions)
        accuracies.append(terms.correct / terms.predictions)
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return ReferenceResult(params, tuple(losses), tuple(accuracies))
