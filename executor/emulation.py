"""Emulated device speeds, decided in one place.

On one machine every device of a cluster is the same CPU. A spec still describes types of
different speeds, and the executor **emulates** them: a type ``k`` times slower than the
spec's fastest (:func:`slowdown`: ``k = headroom x fastest flops / its flops``, the spec's
``emulation: {headroom: H}``, 1 by default) makes each forward and backward of a stage
worker last ``k x`` the CPU time it took, sleeping the rest (:func:`emulation_sleep`). A
cluster is emulated when some type is slowed at all (:func:`is_emulated`), and every number
measured on it says so (:data:`EMULATED_NOTE`).

A profile meant to predict such a run is timed in CPU time too (:func:`profile_clock`),
once, its whole-model calls each after a pause, as an emulated stage's operations start on a
core that has just idled (:func:`profile_pause`), and each type's timings are the measured
ones scaled by that type's factor (:func:`emulated_timings`, :func:`scaled_timings`).

A spec with a real accelerator (a device type with ``accelerator: cuda``) describes real
devices: nothing of it is emulated (every factor is 1, :func:`is_real`), since its CPU types
are real CPUs too and slowing them by a GPU's flops would time a cluster that does not exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pipeplan.core.cluster import ClusterSpec, parse_device_id
from pipeplan.core.errors import PipeplanError, PlanError
from pipeplan.core.profile import LayerTiming, ModelProfile

if TYPE_CHECKING:  # a name for annotations: this module needs no torch
    from pipeplan.models.layer_timing import Clock

__all__ = [
    "EMULATED_NOTE",
    "device_slowdowns",
    "emulated_timings",
    "emulation_sleep",
    "is_emulated",
    "is_real",
    "profile_clock",
    "profile_pause",
    "scaled_timings",
    "slowdown",
]

EMULATED_NOTE = (
    "EMULATED: every device is this machine's CPU; a type k times slower than the fastest "
    "makes each forward and backward last k x its CPU time (sleeping the rest)"
)


def _factor(spec: ClusterSpec, base_flops: float, device_type: str) -> float:
    if device_type not in spec.device_types:
        raise PipeplanError(
            f"device type {device_type!r}: not in cluster {spec.name!r} "
            f"(types: {', '.join(spec.device_types)})"
        )
    return spec.emulation_headroom * base_flops / spec.device_types[device_type].flops


def is_real(spec: ClusterSpec) -> bool:
    """Whether ``spec`` has a real accelerator type, so that nothing of it is emulated."""
    return any(t.accelerator is not None for t in spec.device_types.values())


def slowdown(spec: ClusterSpec, device_type: str) -> float:
    """Emulation factor of a device type: ``headroom x fastest flops / its flops`` (the
    spec's ``emulation_headroom`` for the fastest type, usually 1); 1 on a spec of real
    devices (:func:`is_real`)."""
    factor = _factor(spec, spec.fastest_flops(), device_type)
    return 1.0 if is_real(spec) else factor


def is_emulated(spec: ClusterSpec, device_types: Iterable[str] | None = None) -> bool:
    """Whether running on ``spec`` slows some device type down (of ``device_types``, default
    every type of the spec)."""
    types = spec.device_types if device_types is None else device_types
    return any(slowdown(spec, t) > 1.0 for t in types)


def device_slowdowns(spec: ClusterSpec, devices: Sequence[str]) -> dict[str, float]:
    """The emulation factor of each device id (``NODE/TYPE:INDEX``) of a plan."""
    out = {}
    for d in devices:
        _, dtype, _ = parse_device_id(d)
        if dtype not in spec.device_types:
            raise PlanError(
                f"device {d!r}: type {dtype!r} is not in cluster spec {spec.name!r} "
                "(its flops set the emulated slowdown)"
            )
        out[d] = slowdown(spec, dtype)
    return out


def emulation_sleep(slowdown: float, wall_s: float, cpu_s: float) -> float:
    """How long to sleep after a compute of ``cpu_s`` CPU seconds that took ``wall_s`` so
    that it lasts ``slowdown x cpu_s`` in all (never negative).

    The base is CPU time, not wall time: on a machine with fewer cores than busy actors, the
    time a compute waited for a core is absorbed into the slowdown instead of being
    multiplied by it (sleeping ``(k - 1) x wall`` would stretch every scheduling delay ``k``
    times). On an idle core ``cpu == wall`` and both rules agree."""
    if slowdown <= 1.0:
        return 0.0
    return max(0.0, slowdown * cpu_s - wall_s)


def profile_clock(emulated: bool) -> Clock:
    """The clock to time a profile with: CPU time for an emulated cluster (its devices last
    ``slowdown x`` the CPU time of each compute, and other processes' load on a shared
    machine does not inflate it), the wall clock for real devices."""
    return "cpu" if emulated else "wall"


IDLE_PAUSE_S = 0.03
"""The pause before each of the profiler's whole-model calls on an emulated cluster: as long
as ``bench/idle_slowdown.py``'s pauses, about what a fast type's stage operation sleeps."""


def profile_pause(emulated: bool) -> float:
    """Seconds the profiler sleeps before each whole-model call it times
    (:func:`models.profiler.profile_model`, ``pause_s``): :data:`IDLE_PAUSE_S` for an emulated
    cluster, whose stage workers sleep the rest of every operation's slowed time or wait for
    their inputs, so that each operation starts on a core that has just idled and costs more
    CPU than the same call back to back (``bench/idle_slowdown.py``); 0 for real devices,
    timed by the wall clock, which do not idle that way between operations."""
    return IDLE_PAUSE_S if emulated else 0.0


def scaled_timings(timings: Sequence[LayerTiming], factor: float) -> list[LayerTiming]:
    """Every part (fixed and per sample, forward and backward) times ``factor``."""
    return [
        LayerTiming(
            t.fwd_s * factor, t.bwd_s * factor, t.fwd_fixed_s * factor, t.bwd_fixed_s * factor
        )
        for t in timings
    ]


def emulated_timings(profile: ModelProfile, spec: ClusterSpec, measured_type: str) -> ModelProfile:
    """Timings for every device type of ``spec`` (with devices) from the ones measured as
    ``measured_type``: each scaled by ``headroom x measured flops / type flops`` (by the
    fastest flops when ``measured_type`` is not a type of the spec)."""
    base = (
        spec.device_types[measured_type].flops
        if measured_type in spec.device_types
        else spec.fastest_flops()
    )
    measured = [layer.timings[measured_type] for layer in profile.layers]
    for t in sorted(spec.counts_by_type()):
        profile = profile.with_timings(t, scaled_timings(measured, _factor(spec, base, t)))
    return profile
