"""torch.distributed.pipelining as the stage engine (``engine="torch-pipelining"``).

For plans it can express -- every stage one device, one microbatch size for all that divides
the global batch, GPipe or 1F1B -- a stage replica may hand its slice of the model to
PyTorch's own pipeline runtime instead of pipeplan's schedule runner: a
:class:`~torch.distributed.pipelining.PipelineStage` on the run's process group (the same
group, ranks and actors as pipeplan's engine), driven by ``ScheduleGPipe`` or
``Schedule1F1B``. PyTorch splits the batch into microbatches on the first stage, sends the
activations and gradients between the stages and scales the accumulated gradients by
``1 / M``, so a microbatch's loss is its mean cross-entropy.

What it cannot run, :func:`unsupported` names before any actor starts: unequal or
non-dividing microbatches, replicated stages (no data-parallel subgroup in its schedules
here), a Python constant crossing a stage boundary (it sends tensors only) and emulation of
slower device types (pipeplan's runner sleeps per operation; PyTorch's schedule has no such
hook).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from pipeplan.core.plan import Schedule
from pipeplan.executor.config import ENGINES as ENGINES
from pipeplan.executor.config import Engine as Engine
from pipeplan.executor.config import unsupported as unsupported
from pipeplan.executor.partition import StageGraph, ValueMeta


class StageModule(nn.Module):
    """One stage's fx slice as PyTorch's pipeline expects it: the tensors the stage receives
    in, the tensors it sends on out (the last stage: the logits). Attributes the slice reads
    with ``get_attr`` (a bare parameter) are registered here, so the schedule's gradient
    scaling and the optimizer see them."""

    def __init__(
        self,
        graph: StageGraph,
        attrs: Mapping[str, Any],
        meta: Mapping[str, ValueMeta],
        last: bool,
    ) -> None:
        super().__init__()
        self.graph = graph
        self.body = graph.module
        self.meta = meta
        self.last = last
        self.extra = nn.ParameterList(
            [v for v in attrs.values() if isinstance(v, nn.Parameter) and v.requires_grad]
        )
        self.attrs = dict(attrs)

    def forward(self, *tensors: torch.Tensor) -> Any:
        g = self.graph
        values: dict[str, Any] = dict(zip(g.inputs, tensors, strict=True))
        # Clones: an in-place op (ReLU(inplace=True)) may not touch a received leaf.
        feed = {
            n: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v
            for n, v in values.items()
        }
        args = [feed[a] if a in feed else self.attrs[a] for a in g.args]
        produced = dict(zip(g.results, self.body(*args), strict=True))
        outputs = tuple(produced[n] if n in produced else values[n] for n in g.outputs)
        return outputs[0] if self.last else outputs


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A microbatch's loss: the mean over its predictions (the schedule scales by 1/M)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long())


class TorchStage:
    """PyTorch's stage and schedule for one stage of a plan (on the default group: rank =
    stage index, as the run's ranks are when no stage is replicated)."""

    def __init__(
        self,
        module: StageModule,
        stage: int,
        stages: int,
        device: torch.device,
        schedule: Schedule,
        microbatches: int,
    ) -> None:
        self.stage = PipelineStage(module, stage, stages, device)
        kind = ScheduleGPipe if schedule is Schedule.GPIPE else Schedule1F1B
        self.schedule = kind(self.stage, microbatches, loss_fn=mean_cross_entropy)
        self.first, self.last = stage == 0, stage == stages - 1

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        """Forward and backward of one global batch (gradients accumulated, not applied);
        the last stage returns the merged logits."""
        args = (x,) if self.first else ()
        if self.last:
            out = self.schedule.step(*args, target=y, losses=[])
            return None if out is None else out.detach()
        self.schedule.step(*args)
        return None
