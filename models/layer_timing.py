"""Time the layers of a traced model as a chain: fixed and per-sample forward and backward
seconds.

Each layer (:mod:`models.fx_layers`) is a small GraphModule cut from the fx graph; the layers
run as a chain, in train mode, as a stage worker runs a slice of them: every layer's forward
in order on the previous layers' outputs (detached at each layer: fresh leaves), then every
layer's backward in reverse order on the gradients its consumers returned (input gradients
included, except for the model input). So each layer is timed in the company it runs in --
its inputs just computed, its neighbours' weights and activations in the caches -- rather
than alone, over and over. Warm-up passes, then the median of ``repeats``; one torch thread
(as in a one-thread Ray actor). Every pass starts from no parameter gradients, so a backward
stores them; adding them into a step's earlier microbatches' is the cost model's accumulation
term (rule 2, :mod:`core.costmodel`; measured by ``bench/grad_accumulation.py``).

With ``calibrate``, the whole model is also timed in one call per direction at both sizes,
the sizes taking turns call after call (a drift of a shared machine's speed then moves both
alike), optionally each call after a pause (``pause_s``: as a stage operation starts after
an emulated device's sleep or a wait), and the layers are scaled to those totals.

Fixed and per-sample parts are fitted from two batch sizes. The fit is linear in the batch
size, CPU kernels are not always (oneDNN's 1x1 convolutions on 2x2 maps can make ResNet-50 at
32x32 slower at 8 samples than at 16), so time the sizes a plan's operations will see. With a
``loss`` (the training loss of the model's output), the last layer's forward and backward
include it, as the last stage of a pipeline computes it (a cross-entropy over a language
model's vocabulary costs as much as a block). The clock is the wall clock (``clock="wall"``,
synchronised on CUDA) or, on CPU, this thread's CPU time (``clock="cpu"``): the cost of the
compute itself, unaffected by other processes' load on a shared machine -- what an emulated
device is slowed from (:mod:`executor.stage`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import LayerTiming
from pipeplan.models.fx_layers import (
    Assignment,
    Node,
    assign_layers,
    external_inputs,
    layer_groups,
    leaving_nodes,
)


@dataclass(frozen=True)
class _Piece:
    """One layer as a callable GraphModule of its external inputs."""

    module: fx.GraphModule
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]


def _piece(gm: fx.GraphModule, group: Sequence[Node], layer_of: Assignment, index: int) -> _Piece:
    inputs = external_inputs(group, layer_of, index)
    outputs = leaving_nodes(group, layer_of, index) or [group[-1]]
    graph = fx.Graph()
    env: dict[Node, Node] = {a: graph.placeholder(a.name) for a in inputs}
    for n in group:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    return _Piece(fx.GraphModule(gm, graph), tuple(inputs), tuple(outputs))


Clock = Literal["wall", "cpu"]


def _clock(device: torch.device, clock: Clock = "wall") -> Callable[[], float]:
    if clock == "cpu":
        if device.type != "cpu":
            raise PipeplanError(f"clock: 'cpu' times CPU compute only, not {device.type!r}")
        return time.thread_time
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


Loss = Callable[[torch.Tensor], torch.Tensor]
"""The training loss of a model's output (a scalar), as the last pipeline stage computes it."""


def check_one_output(gm: fx.GraphModule) -> None:
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    count = len([v for v in tree_leaves(output.args[0]) if isinstance(v, Node)])
    if count != 1:
        raise PipeplanError(f"loss: needs a model with one output tensor, this one gives {count}")


def _with_loss(forward: Callable[..., Any], loss: Loss | None) -> Callable[..., Any]:
    """``forward``, followed by ``loss`` of its one tensor output when a loss is given."""
    if loss is None:
        return forward

    def forward_and_loss(*args: Any) -> Any:
        (out,) = [t for t in tree_leaves(forward(*args)) if isinstance(t, torch.Tensor)]
        return loss(out)

    return forward_and_loss


_Run = tuple[dict[Node, torch.Tensor], list[torch.Tensor | None]]
"""One layer's forward in a chain: its fresh input leaves by node, its outputs."""


def _chain_inputs(
    piece: _Piece, values: dict[Node, Any], env: dict[Node, Any]
) -> tuple[dict[Node, torch.Tensor], list[Any]]:
    """A layer's arguments in a chain, and the leaves they were cloned from: the floating
    outputs of earlier layers become fresh leaves (fed as clones, so that their gradients
    are the layer's input gradients); the other inputs come from ``env``."""
    leaves: dict[Node, torch.Tensor] = {}
    args = []
    for a in piece.inputs:
        value = values.get(a, env[a])
        if a in values and isinstance(value, torch.Tensor) and value.is_floating_point():
            leaves[a] = value.detach().requires_grad_()
            value = leaves[a].clone()
        args.append(value)
    return leaves, args


def _chain_forward(
    pieces: Sequence[_Piece], env: dict[Node, Any], now: Callable[[], float], loss: Loss | None
) -> tuple[list[_Run], list[float]]:
    """Every layer's forward in order, each on the previous layers' outputs: the runs the
    backward needs and the forward seconds of every layer."""
    last = len(pieces) - 1
    values: dict[Node, Any] = {}
    runs: list[_Run] = []
    seconds: list[float] = []
    for i, piece in enumerate(pieces):
        leaves, args = _chain_inputs(piece, values, env)
        forward = _with_loss(piece.module, loss if i == last else None)
        t0 = now()
        outs = forward(*args)
        t1 = now()
        results = list(outs) if isinstance(outs, tuple) else [outs]
        if i < last:
            values.update(zip(piece.outputs, results, strict=True))
        runs.append((leaves, results))
        seconds.append(t1 - t0)
    return runs, seconds


def _chain_backward(
    pieces: Sequence[_Piece], runs: list[_Run], now: Callable[[], float]
) -> list[float]:
    """Every layer's backward in reverse order on the gradients its consumers returned (the
    last layer's from ones), consuming ``runs``: the backward seconds of every layer."""
    last = len(pieces) - 1
    seconds = [0.0] * len(pieces)
    grads: dict[Node, torch.Tensor] = {}
    for i in range(last, -1, -1):
        leaves, results = runs.pop()
        nodes = pieces[i].outputs if i < last else (None,) * len(results)
        pairs = [
            (t, grads.pop(n) if n is not None else torch.ones_like(t))
            for n, t in zip(nodes, results, strict=True)
            if isinstance(t, torch.Tensor) and t.requires_grad and (n is None or n in grads)
        ]
        t2 = now()
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        t3 = now()
        for a, leaf in leaves.items():
            if leaf.grad is not None:
                grads[a] = grads[a] + leaf.grad if a in grads else leaf.grad
        seconds[i] = t3 - t2
        del leaves, results, pairs
    return seconds


def _time_chain(
    pieces: Sequence[_Piece],
    env: dict[Node, Any],
    params: Sequence[nn.Parameter],
    warmup: int,
    repeats: int,
    now: Callable[[], float],
    loss: Loss | None = None,
) -> list[tuple[float, float]]:
    """Median forward and backward seconds of every layer, the layers run as a chain.

    Each repeat runs every layer's forward in order, each on the previous layers' outputs
    (detached: fresh leaves, fed as clones), then every layer's backward in reverse order on
    the gradients its consumers returned -- what a stage worker does over a slice of
    layers. Inputs no layer produces (the model input, attributes) come from ``env``, a
    captured forward pass. ``loss``: the last layer's, timed with it.
    """
    fwd: list[list[float]] = [[] for _ in pieces]
    bwd: list[list[float]] = [[] for _ in pieces]
    for r in range(warmup + repeats):
        runs, forward_seconds = _chain_forward(pieces, env, now, loss)
        for p in params:
            p.grad = None
        backward_seconds = _chain_backward(pieces, runs, now)
        if r >= warmup:
            for i in range(len(pieces)):
                fwd[i].append(forward_seconds[i])
                bwd[i].append(backward_seconds[i])
    return [(statistics.median(f), statistics.median(b)) for f, b in zip(fwd, bwd, strict=True)]


def _time_whole(
    gm: fx.GraphModule,
    batches: Sequence[torch.Tensor],
    params: Sequence[nn.Parameter],
    warmup: int,
    repeats: int,
    now: Callable[[], float],
    loss: Loss | None = None,
    pause_s: float = 0.0,
) -> list[tuple[float, float]]:
    """Median forward and backward seconds of the whole model (and ``loss``) in one call
    each, for every batch of ``batches``, after ``warmup`` calls of each.

    The batch sizes take turns, call after call, so that a change of the machine's speed
    while they are timed (a shared machine drifts within seconds) moves every size alike:
    it shifts the fitted fixed and per-sample parts together instead of tilting the line
    between them. The backward starts from random output gradients, drawn once per size.
    The thread sleeps ``pause_s`` before each forward and each backward (untimed), so that
    each starts on a core that has just been idle."""
    forward = _with_loss(gm, loss)
    fwd: list[list[float]] = [[] for _ in batches]
    bwd: list[list[float]] = [[] for _ in batches]
    grads: dict[int, list[torch.Tensor]] = {}
    for r in range(warmup + repeats):
        for i, batch in enumerate(batches):
            if pause_s > 0:
                time.sleep(pause_s)
            t0 = now()
            outs = forward(batch)
            t1 = now()
            tensors = [
                t for t in tree_leaves(outs) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if i not in grads:
                grads[i] = [torch.randn_like(t) for t in tensors]
            for p in params:
                p.grad = None
            if pause_s > 0:
                time.sleep(pause_s)
            t2 = now()
            if tensors:
                torch.autograd.backward(tensors, grads[i])
            t3 = now()
            if r >= warmup:
                fwd[i].append(t1 - t0)
                bwd[i].append(t3 - t2)
            del outs, tensors
    return [(statistics.median(f), statistics.median(b)) for f, b in zip(fwd, bwd, strict=True)]


def calibrated(
    layers: Sequence[tuple[float, float]], whole: tuple[float, float]
) -> list[tuple[float, float]]:
    """Layer (forward, backward) times scaled so that each direction sums to the whole
    model's time in one call (unchanged where the layers sum to 0)."""
    sums = [sum(t[k] for t in layers) for k in (0, 1)]
    ratio = [whole[k] / sums[k] if sums[k] > 0 else 1.0 for k in (0, 1)]
    return [(f * ratio[0], b * ratio[1]) for f, b in layers]


def _timing_input(sample: torch.Tensor, n: int) -> torch.Tensor:
    """A batch of n: standard-normal for floating inputs, the sample repeated otherwise."""
    shape = (n, *sample.shape[1:])
    if sample.is_floating_point():
        gen = torch.Generator().manual_seed(0)
        return torch.randn(shape, generator=gen, dtype=sample.dtype).to(sample.device)
    return sample[:1].expand(shape).contiguous()


def _capture(gm: fx.GraphModule, batch: torch.Tensor) -> dict[Node, Any]:
    """Every node's value for one train-mode forward pass of the whole graph."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(batch)
    return interp.env


def fit_fixed_per_sample(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """``(fixed, per_sample)`` through two measurements, both clipped at >= 0."""
    per_sample = max(0.0, (t2 - t1) / (n2 - n1))
    return max(0.0, t1 - n1 * per_sample), per_sample


def fit_layers(
    n1: int, t1: Sequence[float], n2: int, t2: Sequence[float]
) -> list[tuple[float, float]]:
    """Every layer's ``(fixed, per_sample)`` through its times at ``n1`` and ``n2`` samples,
    such that the layers still sum to the measured totals at both sizes.

    Each layer's own fit is clipped at >= 0 (:func:`fit_fixed_per_sample`), and a clipped
    layer no longer passes through its two times: a layer slower at the smaller size (oneDNN
    picks other kernels: ResNet-50's 1x1 convolutions on 2x2 maps) keeps its small-size
    time as a fixed cost, so the fit over-predicts it at the larger size, and over a whole
    model those clips add up (ResNet-50 at 32 samples: README, ``bench.fidelity``). So the
    layers' fixed
    parts are scaled to sum to the total's fixed part, and their per-sample parts to the
    total's per-sample part (the total's own fit, clipped the same way): the layers keep
    their measured shares of each part and sum to the whole model's time at both sizes."""
    fits = [fit_fixed_per_sample(n1, a, n2, b) for a, b in zip(t1, t2, strict=True)]
    fixed_total, per_total = fit_fixed_per_sample(n1, sum(t1), n2, sum(t2))
    fixed_sum, per_sum = sum(f for f, _ in fits), sum(p for _, p in fits)
    out = []
    for fixed, per in fits:
        # a part no layer has (every fit clipped it) is shared by the other part's weights
        f = fixed / fixed_sum if fixed_sum > 0 else (per / per_sum if per_sum > 0 else 0.0)
        p = per / per_sum if per_sum > 0 else (fixed / fixed_sum if fixed_sum > 0 else 0.0)
        out.append((f * fixed_total, p * per_total))
    return out


def measure_timings(
    gm: fx.GraphModule,
    sample: torch.Tensor,
    batch_sizes: tuple[int, int],
    warmup: int,
    repeats: int,
    clock: Clock = "wall",
    calibrate: bool = False,
    loss: Loss | None = None,
    pause_s: float = 0.0,
) -> list[LayerTiming]:
    """Fixed + per-sample forward/backward seconds of every layer, one torch thread
    (``calibrate``, ``loss``, ``pause_s``: see :func:`models.profiler.profile_model`)."""
    layer_of, anchors = assign_layers(gm)
    groups = layer_groups(gm, layer_of, len(anchors))
    pieces = [_piece(gm, g, layer_of, i) for i, g in enumerate(groups)]
    params = list(gm.parameters())
    now = _clock(sample.device, clock)
    medians: list[list[tuple[float, float]]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gm.train()
        batches = [_timing_input(sample, n) for n in batch_sizes]
        for batch in batches:
            env = _capture(gm, batch)
            medians.append(_time_chain(pieces, env, params, warmup, repeats, now, loss))
            del env
        if calibrate:
            wholes = _time_whole(gm, batches, params, warmup, repeats, now, loss, pause_s)
            medians = [calibrated(m, w) for m, w in zip(medians, wholes, strict=True)]
    finally:
        torch.set_num_threads(threads)
        for p in params:
            p.grad = None
    (n1, n2), (small, large) = batch_sizes, medians
    fwd = fit_layers(n1, [f for f, _ in small], n2, [f for f, _ in large])
    bwd = fit_layers(n1, [b for _, b in small], n2, [b for _, b in large])
    return [
        LayerTiming(f_ps, b_ps, f_fixed, b_fixed)
        for (f_fixed, f_ps), (b_fixed, b_ps) in zip(fwd, bwd, strict=True)
    ]
