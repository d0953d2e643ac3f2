"""Profile a torch model into a :class:`ModelProfile` at the granularity of its torch.fx graph.

:func:`profile_model` is the entry point; the work is done in three steps, each in its module:

- **Layers** (:mod:`models.fx_layers`): the model is traced with torch.fx (or, where that
  fails, torch.export on the example input: :mod:`models.exported`); every compute node
  (a leaf module call, a function or method such as ``torch.cat``) opens a layer, and trivial
  nodes (views, shape queries, attributes, constructors) fold into a neighbour, so every edge
  goes from a layer to the same or a later one and any contiguous grouping of layers is a
  ``split_module`` cut the executor reproduces from its own trace.
- **Sizes, per sample** (:mod:`models.layer_sizes`): shapes propagated at batch 1 in eval
  mode give each layer's FLOPs, parameter bytes and the bytes of the activations it sends.
  A profile with these only (``device_type=None``) is *analytic*.
- **Timings** (:mod:`models.layer_timing`): the layers run as a chain in train mode, as a
  stage worker runs a slice of them, one torch thread, forward in order then backward in
  reverse; fixed and per-sample seconds fitted from two batch sizes, optionally with the
  training loss timed in the last layer and calibrated to the whole model's time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import ModelProfile
from pipeplan.models.fx_layers import trace
from pipeplan.models.layer_sizes import analytic_layers
from pipeplan.models.layer_timing import Clock, Loss, check_one_output, measure_timings


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Restore train/eval flags, buffers (BatchNorm statistics) and ``.grad`` afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def _check_options(
    example_input: Any, batch_sizes: Sequence[int], warmup: int, repeats: int
) -> None:
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise PipeplanError(
            f"example_input: expected a tensor with a batch dimension, got {example_input!r}"
        )
    sizes = list(batch_sizes)
    valid = len(sizes) == 2 and all(isinstance(n, int) and n >= 1 for n in sizes)
    if not valid or sizes[0] >= sizes[1]:
        raise PipeplanError(
            f"batch_sizes: expected two increasing integers >= 1, got {batch_sizes!r}"
        )
    if warmup < 0:
        raise PipeplanError(f"warmup: must be >= 0, got {warmup!r}")
    if repeats < 1:
        raise PipeplanError(f"repeats: must be >= 1, got {repeats!r}")


def _check_pause(pause_s: Any, calibrate: bool) -> None:
    if isinstance(pause_s, bool) or not isinstance(pause_s, int | float) or not 0 <= pause_s < 60:
        raise PipeplanError(f"pause_s: expected seconds from 0 to under 60, got {pause_s!r}")
    if pause_s > 0 and not calibrate:
        raise PipeplanError(
            f"pause_s: {pause_s!r} pauses the whole model's calls, which only calibrate=True "
            "times (the layers' chain runs back to back)"
        )


def profile_model(
    model: nn.Module,
    example_input: torch.Tensor,
    name: str,
    device_type: str | None = "cpu",
    batch_sizes: tuple[int, int] = (2, 8),
    warmup: int = 2,
    repeats: int = 5,
    clock: Clock = "wall",
    calibrate: bool = False,
    loss: Loss | None = None,
    pause_s: float = 0.0,
) -> ModelProfile:
    """Profile ``model`` layer by layer (what a layer is: :mod:`models.fx_layers`).

    ``example_input`` has a batch dimension (shape ``(1, ...)``; a larger batch is cut to its
    first sample); the profile's ``input_shape`` is its shape without the batch dimension.
    ``device_type`` names the timings (``timings[device_type]``); they are measured where the
    model's parameters and the input live. ``None`` skips timing: an analytic profile.
    The model is left as it was (train/eval flags, buffers, gradients). ``clock``: see
    :mod:`models.layer_timing`. ``calibrate``: also time the whole model's forward and
    backward in one call each at both batch sizes and scale the layers' times so that they
    sum to it -- a layer timed alone misses part of what running in a chain costs (caches,
    allocation, autograd bookkeeping); the shares between layers stay measured.
    ``loss``: the training loss of the model's output (one tensor) to time with the last
    layer, forward and backward (``None``: the output's backward starts from random
    gradients, as every other layer's).
    ``pause_s``: with ``calibrate``, sleep this long before each of the whole model's timed
    forward and backward calls, so that each starts on a core that has just idled, as a
    stage worker's operations do on an emulated cluster (each follows the emulation's sleep
    or a wait for its inputs); such a compute costs more than one run back to back
    (``bench/idle_slowdown.py``), and the layers' shares, timed back to back in the chain, are
    scaled to it.
    """
    _check_options(example_input, batch_sizes, warmup, repeats)
    if clock not in ("wall", "cpu"):
        raise PipeplanError(f"clock: expected 'wall' or 'cpu', got {clock!r}")
    _check_pause(pause_s, calibrate)
    sample = example_input[:1]
    gm = trace(model, sample)
    with _preserved(model), torch.no_grad():
        gm.eval()
        ShapeProp(gm).propagate(sample)
    layers = analytic_layers(gm)
    profile = ModelProfile(name, tuple(sample.shape[1:]), tuple(layers))
    if device_type is None:
        return profile
    if loss is not None:
        check_one_output(gm)
    with _preserved(model):
        timings = measure_timings(
            gm,
            sample,
            (batch_sizes[0], batch_sizes[1]),
            warmup,
            repeats,
            clock,
            calibrate,
            loss,
            pause_s,
        )
    return profile.with_timings(device_type, timings)
