"""Activation recomputation of one stage replica (a plan stage's ``recompute``).

A recomputing stage runs each microbatch's forward without autograd, sends its outputs on
and keeps only the microbatch's inputs (:class:`Replay`); right before the microbatch's
backward it runs the forward again with autograd and back-propagates through that graph.
Between the two, the stage holds its inputs instead of every activation inside it, which is
what the cost model's rule 9r counts (:mod:`core.costmodel`); the second forward is what
rule 2r adds to the backward.

The second forward must compute what the first did, dropout masks included: the worker
captures the random state before the first (:meth:`RngState.capture`) and replays it for
the second (:func:`replayed`), after which the stream goes on where it was, as
``torch.utils.checkpoint`` does by default. Training with recomputation therefore equals
training without it (``tests/executor``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RngState:
    """The random state a forward starts from: the CPU generator's, and the GPU's when the
    stage computes on one."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda)


@contextlib.contextmanager
def replayed(state: RngState, device: torch.device) -> Iterator[None]:
    """Run the block from ``state``'s random state; the generators are put back as they
    were when it ends."""
    devices = [device] if state.cuda is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state(state.cuda, device)
        yield


def without_graph(recompute: bool) -> contextlib.AbstractContextManager[Any]:
    """The first forward of a recomputing stage builds no autograd graph (so it keeps no
    activation); any other forward does."""
    return torch.no_grad() if recompute else contextlib.nullcontext()


@dataclass(frozen=True)
class Replay:
    """What a recomputing stage keeps of one microbatch between its forward and backward:
    the forward's inputs (the leaves, which collect the gradients sent back, among them),
    the last stage's labels and sample count, and the random state it started from."""

    values: Mapping[str, Any]
    labels: torch.Tensor | None
    samples: int
    rng: RngState
