"""Measured profiles: time every layer of a model through actors pinned to device types.

:func:`measure_profile` feeds the cost model with timings taken on the cluster it plans for
(``pipeplan profile MODEL --cluster C --measure``). It needs a connected Ray cluster (a
:class:`~executor.local_cluster.LocalCluster`, or :func:`~executor.runtime.connect`). For a device
type, one :class:`_Profiler` actor is pinned to a live node that advertises
``device:TYPE`` (the stage workers' placement options, :func:`executor.pinning.actor_options`;
it holds one of the type's devices while it runs, so it waits for a device a running
pipeline holds), builds the model from its :class:`~executor.model.ModelSource` and runs
:func:`models.profiler.profile_model` there, one torch thread, as a stage worker computes.

Two choices, both explicit arguments, whose defaults follow the spec: a spec of **real
devices** (a type with ``accelerator: cuda``, :func:`executor.emulation.is_real`) is timed
type by type on its own devices (``measure_on="each"``, ``emulate=False``, the wall clock),
a CUDA type on the GPU its profiler actor asks Ray for (``num_gpus: 1``: the model and its
inputs are moved there and every clock read follows a ``torch.cuda.synchronize``,
:mod:`models.layer_timing`); any other spec as below.

- ``emulate`` (default ``True``, as :class:`executor.pipeline.RunConfig`): the stage workers
  make each forward and backward last ``slowdown(spec, T)`` times its CPU time on type ``T``
  (:func:`executor.emulation.emulation_sleep`), so a layer *effectively* takes that many times
  its time on an idle core. The measured timings (fixed
  and per-sample parts alike) are multiplied by that factor; the profile then predicts what
  an emulated run measures. ``False``: real times, unscaled (a real heterogeneous cluster, or
  a local run with ``RunConfig(emulate=False)``).
- ``measure_on``: ``"fastest"`` (default) times the model once, on a node of the fastest
  device type, and gives every type those real times (scaled as above). On this machine all
  emulated devices are the same CPU, so per-type measurements differ only by noise (another
  process's load at that moment), and noise that differs between types would be read by the
  planners as a speed difference that an emulated run does not have; one measurement is also
  k times cheaper. ``"each"`` times every type on its own node, one type after the other (so
  the measurements never compete for the CPU): what a cluster of really different devices
  needs, with ``emulate=False``.

- The layers' times are calibrated to the whole model timed in one call
  (:func:`models.profiler.profile_model`, ``calibrate``), as a stage worker runs its slice,
  and the last layer's include the training loss (``loss``,
  :func:`executor.model.timing_loss`), as the last stage computes it.
- ``clock`` (default: ``"cpu"`` when emulating, else ``"wall"``): emulated devices last
  ``slowdown x`` the CPU time of each compute, so their profile is timed in CPU time too,
  which other processes' load on this shared machine does not inflate; a real device is
  timed by the wall clock.
- ``pause_s`` (default: :func:`executor.emulation.profile_pause`, 30 ms when emulating, else
  0): the whole model's timed calls each start after that long asleep, as an emulated stage
  worker's operations start after its emulation sleep or a wait for inputs, on a core that
  has just idled, which costs more CPU than a call run back to back.

Every device type of ``spec`` (or of ``device_types``) must have a live node: otherwise an
:class:`~executor.errors.ExecutorError` names the type before any actor starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from pipeplan.core.cluster import ClusterSpec, device_id
from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import LayerTiming, ModelProfile
from pipeplan.executor.accelerators import accelerator_of, accelerators, check_nodes, local_device
from pipeplan.executor.emulation import (
    is_real,
    profile_clock,
    profile_pause,
    scaled_timings,
    slowdown,
)
from pipeplan.executor.errors import ExecutorError, ExecutorTimeoutError
from pipeplan.executor.live_cluster import LiveNode, live_nodes
from pipeplan.executor.model import ModelSource, timing_loss
from pipeplan.executor.pinning import actor_options
from pipeplan.executor.reservation import claim
from pipeplan.models.layer_timing import Clock
from pipeplan.models.profiler import profile_model

__all__ = [
    "MeasureOn",
    "TypeMeasurement",
    "call_sizes",
    "measure_on_type",
    "measure_profile",
]

MeasureOn = Literal["fastest", "each"]


class _Profiler:
    """A Ray actor that profiles one model where it runs (one torch thread)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    def profile(
        self,
        source: ModelSource,
        device_type: str,
        batch_sizes: tuple[int, int],
        warmup: int,
        repeats: int,
        clock: Clock = "wall",
        calibrate: bool = True,
        accelerator: str | None = None,
        node: str = "?",
        pause_s: float = 0.0,
    ) -> dict[str, Any]:
        """The profile (timed where the model lives: the CPU, or the actor's GPU for a CUDA
        type), where it was taken and how long it took."""
        t0 = time.perf_counter()
        device = local_device(accelerator, device_type, node)
        model, example = source.build()
        model, example = model.to(device), example.to(device)
        profile = profile_model(
            model,
            example,
            source.name,
            device_type,
            batch_sizes,
            warmup,
            repeats,
            clock,
            calibrate,
            loss=timing_loss,
            pause_s=pause_s,
        )
        return {
            "profile": profile.to_dict(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "seconds": time.perf_counter() - t0,
        }


_Actor = ray.remote(_Profiler)


@dataclass(frozen=True)
class TypeMeasurement:
    """One device type's real (unscaled) timings and where they were taken."""

    device_type: str
    node: str
    """The live node (pipeplan name) the profiler ran on."""
    node_id: str
    pid: int
    seconds: float
    """Wall time of building and profiling the model in the actor."""
    profile: ModelProfile
    """Sizes of every layer and ``timings[device_type]``: real seconds, not emulated."""

    @property
    def timings(self) -> list[LayerTiming]:
        return [layer.timings[self.device_type] for layer in self.profile.layers]


def call_sizes(global_batch: int) -> tuple[int, int]:
    """The two batch sizes to profile a model at for plans of ``global_batch``: a quarter of
    it (GPipe's usual 4-way microbatch, a replica's share of a 4-way data-parallel stage)
    and all of it (one microbatch). The profile's fit is linear and CPU kernels are not, so
    the sizes a plan's operations run at predict them best (``bench/fidelity.py``); a global
    batch too small to split gives ``(1, 2)``."""
    if global_batch < 1:
        raise PipeplanError(f"global_batch: must be >= 1, got {global_batch!r}")
    lo = max(global_batch // 4, 1)
    return (lo, global_batch) if lo < global_batch else (1, 2)


def _check_options(batch_sizes: Sequence[int], warmup: int, repeats: int, timeout_s: float) -> None:
    sizes = list(batch_sizes)
    ok = len(sizes) == 2 and all(isinstance(n, int) and n >= 1 for n in sizes)
    if not ok or sizes[0] >= sizes[1]:
        raise PipeplanError(
            f"batch_sizes: expected two increasing integers >= 1, got {batch_sizes!r}"
        )
    if warmup < 0 or repeats < 1:
        raise PipeplanError(f"warmup >= 0 and repeats >= 1 needed, got {warmup}, {repeats}")
    if not timeout_s > 0:
        raise PipeplanError(f"timeout_s: must be > 0, got {timeout_s!r}")


def _node_for(device_type: str, nodes: Sequence[LiveNode]) -> LiveNode:
    for n in nodes:
        if n.devices.get(device_type, 0) > 0:
            return n
    live = sorted({t for n in nodes for t, c in n.devices.items() if c > 0})
    raise ExecutorError(
        f"device type {device_type!r}: no live node of the connected cluster has it "
        f"(live device types: {', '.join(live) or 'none'}; nodes: "
        f"{', '.join(n.name for n in nodes) or 'none'})"
    )


def _answer(ref: Any, what: str, timeout_s: float) -> dict[str, Any]:
    """The profiler actor's answer, or an :class:`ExecutorError` saying why there is none."""
    try:
        got: dict[str, Any] = ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise ExecutorTimeoutError(
            f"{what}: no answer in {timeout_s:g} s (is the device held by a running pipeline?)"
        ) from None
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise ExecutorError(f"{what} failed: {type(cause).__name__}: {cause}") from None
    except RayError as e:
        raise ExecutorError(
            f"{what}: the profiler actor died "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''})"
        ) from None
    return got


def measure_on_type(
    source: ModelSource,
    device_type: str,
    *,
    batch_sizes: tuple[int, int] = (2, 8),
    warmup: int = 2,
    repeats: int = 5,
    timeout_s: float = 600.0,
    nodes: Sequence[LiveNode] | None = None,
    clock: Clock = "wall",
    accelerator: str | None = None,
    pause_s: float = 0.0,
) -> TypeMeasurement:
    """Profile ``source`` in one actor pinned to a live node with ``device:TYPE`` (the first
    such node by name); real timings (``clock``: :func:`models.profiler.profile_model`), under
    ``timings[device_type]``; on the node's GPU when ``accelerator`` is ``cuda`` (a node
    where Ray counts no GPU is refused first). The device is reserved first, as a run's are
    (:func:`executor.reservation.claim`: it waits while another job holds it); the actor is
    killed and the device given back afterwards, whatever happened."""
    _check_options(batch_sizes, warmup, repeats, timeout_s)
    nodes = live_nodes() if nodes is None else nodes
    node = _node_for(device_type, nodes)
    where = f"device type {device_type!r} (node {node.name})"
    device = device_id(node.name, device_type, 0)
    check_nodes({device_type: accelerator}, [device], nodes)
    reservation = claim([device], nodes, [accelerator])
    actor: Any = None
    try:
        options = actor_options(device, nodes, accelerator) | reservation.options(device)
        actor = _Actor.options(**options).remote()
        ref = actor.profile.remote(
            source,
            device_type,
            (batch_sizes[0], batch_sizes[1]),
            warmup,
            repeats,
            clock,
            True,
            accelerator,
            node.name,
            pause_s,
        )
        got = _answer(ref, f"profiling model {source.name!r} on {where}", timeout_s)
    finally:
        if actor is not None:
            with contextlib.suppress(Exception):  # already gone with its node or cluster
                ray.kill(actor, no_restart=True)
        reservation.release()
    if got["node_id"] != node.node_id:
        raise ExecutorError(
            f"profiling on {where}: the actor ran on Ray node {got['node_id']}, not {node.node_id}"
        )
    return TypeMeasurement(
        device_type,
        node.name,
        str(got["node_id"]),
        int(got["pid"]),
        float(got["seconds"]),
        ModelProfile.from_dict(got["profile"]),
    )


def measure_profile(
    source: ModelSource,
    spec: ClusterSpec,
    *,
    batch_sizes: tuple[int, int] = (2, 8),
    warmup: int = 2,
    repeats: int = 5,
    timeout_s: float = 600.0,
    measure_on: MeasureOn | None = None,
    emulate: bool | None = None,
    device_types: Sequence[str] | None = None,
    clock: Clock | None = None,
    pause_s: float | None = None,
) -> ModelProfile:
    """The profile of ``source`` with timings for every device type of ``spec`` (or of
    ``device_types``), measured on the connected cluster (module docstring: ``measure_on``,
    ``emulate``, ``clock`` and ``pause_s``; None: what the spec calls for). ``timeout_s`` bounds the
    whole measurement."""
    real_devices = is_real(spec)
    measure_on = measure_on or ("each" if real_devices else "fastest")
    emulate = (not real_devices) if emulate is None else emulate
    clock = clock or profile_clock(emulate)
    pause_s = profile_pause(emulate) if pause_s is None else pause_s
    _check_options(batch_sizes, warmup, repeats, timeout_s)
    if measure_on not in ("fastest", "each"):
        raise PipeplanError(f"measure_on: 'fastest' or 'each', got {measure_on!r}")
    types = list(dict.fromkeys(spec.counts_by_type() if device_types is None else device_types))
    if not types:
        raise PipeplanError(f"cluster {spec.name!r}: no device types to profile")
    factors = {t: slowdown(spec, t) if emulate else 1.0 for t in types}  # unknown type: error
    nodes = live_nodes()
    for t in types:  # every type must be live (and have its GPUs), before any actor starts
        node = _node_for(t, nodes)
        check_nodes(accelerators(spec), [device_id(node.name, t, 0)], nodes)
    deadline = time.monotonic() + timeout_s
    order = (
        [max(types, key=lambda t: spec.device_types[t].flops)] if measure_on == "fastest" else types
    )
    real: dict[str, TypeMeasurement] = {}
    for t in order:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ExecutorTimeoutError(
                f"profiling model {source.name!r}: {timeout_s:g} s spent before device type {t!r}"
            )
        real[t] = measure_on_type(
            source,
            t,
            batch_sizes=batch_sizes,
            warmup=warmup,
            repeats=repeats,
            timeout_s=left,
            nodes=nodes,
            clock=clock,
            accelerator=accelerator_of(spec, t),
            pause_s=pause_s,
        )
    return _combine([real[t] if measure_on == "each" else real[order[0]] for t in types], factors)


def _combine(measured: Sequence[TypeMeasurement], factors: dict[str, float]) -> ModelProfile:
    """One profile with, for each device type of ``factors`` (in order), the timings of the
    matching measurement scaled by the type's factor."""
    first = measured[0].profile
    profile = ModelProfile(
        first.name,
        first.input_shape,
        tuple(dataclasses.replace(layer, timings={}) for layer in first.layers),
    )
    for (t, factor), m in zip(factors.items(), measured, strict=True):
        profile = profile.with_timings(t, scaled_timings(m.timings, factor))
    return profile
