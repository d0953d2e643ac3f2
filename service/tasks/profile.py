"""The ``profile`` use-case: a zoo model profiled into a profile document.

- analytic (no ``device_type``, no ``cluster``): FLOPs and sizes; layer times come from each
  device type's FLOP/s in the cost model;
- ``device_type``: layer times measured on this machine under that type's name;
- ``cluster`` (an EMULATED one): measured here in CPU time as its fastest type, and derived
  for every other type by its slowdown (:func:`executor.emulation.emulated_timings`);
- ``measure``: the cluster is started (or joined at ``address``) and every layer is timed on
  each of its device types by actors pinned to them.

A PipeDream ``graph.txt`` is imported by :func:`import_pipedream` (the CLI's ``--pipedream``).
"""

from __future__ import annotations

from pathlib import Path

from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.emulation import emulated_timings
from pipeplan.executor.model import timing_loss
from pipeplan.models import layer_timing, profiler
from pipeplan.service.tasks.common import Request, RequestError, cluster_spec
from pipeplan.service.tasks.live import live_cluster, measure_on_cluster, source_of
from pipeplan.service.tasks.progress import QUIET, Reporter
from pipeplan.service.tasks.requests import ProfileRequest


class PipedreamRequest(Request):
    """A PipeDream ``graph.txt`` on this machine, the minibatch and GPU it was taken on."""

    path: Path
    batch_size: int
    device_type: str
    name: str | None = None


def _measured(request: ProfileRequest, reporter: Reporter) -> ModelProfile:
    if request.device_type is not None:
        raise RequestError("device_type: not with measure (every type of the cluster is timed)")
    if request.cluster is None and request.address is None:
        raise RequestError("measure: needs cluster (the cluster to start and time on)")
    source = source_of(request)
    spec = cluster_spec(request.cluster) if request.cluster is not None else None
    with live_cluster(spec, request.address, reporter) as live:
        return measure_on_cluster(source, live, reporter)


def _timed_here(request: ProfileRequest, reporter: Reporter) -> ModelProfile:
    """Analytic, timed as ``device_type``, or timed and derived for an emulated cluster.
    The profile of an emulated cluster is timed in CPU time, calibrated to the whole model,
    as the stage actors compute (:mod:`executor.emulation`); the last layer carries the
    training loss."""
    module, example = source_of(request).build()
    spec = cluster_spec(request.cluster) if request.cluster is not None else None
    measure_as = request.device_type
    if spec is not None and measure_as is None:
        measure_as = max(spec.counts_by_type(), key=lambda t: spec.device_types[t].flops)
    clock: layer_timing.Clock = "cpu" if spec is not None else "wall"
    timing = f" (timing as {measure_as})" if measure_as else ""
    with reporter.step(f"profiling {request.model}{timing}"):
        prof = profiler.profile_model(
            module,
            example,
            name=request.model,
            device_type=measure_as,
            clock=clock,
            calibrate=spec is not None,
            loss=timing_loss,
        )
    if spec is not None and measure_as is not None:
        prof = emulated_timings(prof, spec, measure_as)
        reporter.note(
            f"note: timings for {', '.join(sorted(spec.counts_by_type()))} are EMULATED: "
            f"measured here as {measure_as} (CPU time) and scaled by each type's slowdown"
        )
    return prof


def profile(request: ProfileRequest, reporter: Reporter = QUIET) -> ModelProfile:
    """The model's profile (its ``to_dict()`` is the profile document)."""
    if request.address is not None and not request.measure:
        raise RequestError("address: only applies with measure")
    if request.measure:
        return _measured(request, reporter)
    return _timed_here(request, reporter)


def import_pipedream(request: PipedreamRequest) -> ModelProfile:
    """A PipeDream profile as a pipeplan profile."""
    return load_pipedream(request.path, request.batch_size, request.device_type, request.name)
