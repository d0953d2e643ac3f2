"""Measured plans as a calibration fit reads them, and the documents they travel in.

An :class:`Observation` is one measured plan with the profile it was predicted from: the
measured batch time and, per stage, the busiest replica's forward and backward **per call**
(per microbatch), the replicas' ring all-reduce per step and the busiest replica's optimizer
update per step (both empty when the run did not record them).

It is read from two documents, and every number of either is checked by :func:`seconds`:

- an **observation document** (:meth:`Observation.to_doc`, :meth:`Observation.from_doc`):
  ``batch_time_s`` and the per-stage lists ``forward_s``, ``backward_s`` and, optionally,
  ``allreduce_s`` and ``update_s``: what an evaluation event carries to the service and what
  its fit worker is sent;
- a **run document** (:func:`observation_of_run`): ``pipeplan run --json``'s ``plan`` and
  ``measured`` (a measurement as a dict: per stage the forward and backward of a whole step).

Pure: no torch, no Ray; the fit is :mod:`executor.calibrate`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile


class MeasuredStage(Protocol):
    """What :meth:`Observation.of` reads of a measured stage (seconds per step)."""

    @property
    def forward_s(self) -> float: ...
    @property
    def backward_s(self) -> float: ...
    @property
    def allreduce_s(self) -> float: ...
    @property
    def update_s(self) -> float: ...


class MeasuredRun(Protocol):
    """What :meth:`Observation.of` reads of a measured run (``executor.measure.Measurement``)."""

    @property
    def plan(self) -> Plan: ...
    @property
    def batch_time_s(self) -> float: ...
    @property
    def stages(self) -> Sequence[MeasuredStage]: ...


@dataclass(frozen=True)
class Observation:
    """One measured plan: what the fit reads of it."""

    plan: Plan
    profile: ModelProfile
    batch_time_s: float
    forward_s: tuple[float, ...]
    """Per stage, the busiest replica's mean forward per call."""
    backward_s: tuple[float, ...]
    allreduce_s: tuple[float, ...] = ()
    """Per stage, the replicas' measured ring all-reduce per step (0 without replicas); empty
    when the run did not record it (runs measured before it was)."""
    update_s: tuple[float, ...] = ()
    """Per stage, the busiest replica's measured optimizer update per step; empty when the
    run did not record it."""

    @classmethod
    def of(cls, run: MeasuredRun, profile: ModelProfile) -> Observation:
        """The observation of a measured run (its per-step forwards and backwards divided by
        each stage's microbatches)."""
        plan = run.plan
        m = [plan.microbatches(s) for s in range(plan.num_stages)]
        return cls(
            plan=plan,
            profile=profile,
            batch_time_s=run.batch_time_s,
            forward_s=tuple(st.forward_s / k for st, k in zip(run.stages, m, strict=True)),
            backward_s=tuple(st.backward_s / k for st, k in zip(run.stages, m, strict=True)),
            allreduce_s=tuple(st.allreduce_s for st in run.stages),
            update_s=tuple(st.update_s for st in run.stages),
        )

    def to_doc(self) -> dict[str, Any]:
        """The observation document (module docstring): the numbers, not the plan or profile."""
        return {
            "batch_time_s": self.batch_time_s,
            "forward_s": list(self.forward_s),
            "backward_s": list(self.backward_s),
            "allreduce_s": list(self.allreduce_s),
            "update_s": list(self.update_s),
        }

    @classmethod
    def from_doc(
        cls, doc: Mapping[str, Any], plan: Plan, profile: ModelProfile, where: str = "observation"
    ) -> Observation:
        """The observation of ``plan`` from its document (module docstring); a
        :class:`~core.errors.PlanError` naming the field and the value when a number is
        missing, not a number >= 0 (> 0 for the batch time) or a list of the wrong length."""
        stages = plan.num_stages

        def optional(key: str) -> tuple[float, ...]:
            return per_stage(doc, key, where, stages) if key in doc else ()

        return cls(
            plan,
            profile,
            seconds(doc.get("batch_time_s"), f"{where}.batch_time_s", positive=True),
            per_stage(doc, "forward_s", where, stages),
            per_stage(doc, "backward_s", where, stages),
            optional("allreduce_s"),
            optional("update_s"),
        )


def seconds(value: Any, where: str, positive: bool = False) -> float:
    """A measured duration: a finite number >= 0 (> 0 with ``positive``); a
    :class:`~core.errors.PlanError` naming ``where`` and the value otherwise."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise PlanError(f"{where}: must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def per_stage(doc: Mapping[str, Any], key: str, where: str, stages: int) -> tuple[float, ...]:
    """``doc[key]``: a list of one duration per stage of a plan of ``stages`` stages."""
    value = doc.get(key)
    if not isinstance(value, list):
        raise PlanError(f"{where}.{key}: expected a list of seconds, got {value!r}")
    if len(value) != stages:
        raise PlanError(
            f"{where}.{key}: {len(value)} values for a plan of {stages} stages, got {value!r}"
        )
    return tuple(seconds(v, f"{where}.{key}[{i}]") for i, v in enumerate(value))


def observation_of_run(doc: Any, profile: ModelProfile, where: str = "run") -> Observation:
    """An :class:`Observation` from a measured run's document (``pipeplan run --json``: its
    ``plan`` and ``measured``, a measurement as a dict); errors name the field and the value."""
    if not isinstance(doc, dict):
        raise PlanError(f"{where}: expected a run document (an object), got {type(doc).__name__}")
    if "plan" not in doc or "measured" not in doc:
        raise PlanError(
            f"{where}: needs 'plan' and 'measured' (the output of `pipeplan run --json`)"
        )
    plan = Plan.from_dict(doc["plan"])
    measured = doc["measured"]
    stages = measured.get("stages") if isinstance(measured, dict) else None
    if not isinstance(stages, list) or len(stages) != plan.num_stages:
        raise PlanError(
            f"{where}.measured.stages: expected {plan.num_stages} stages (one per stage of the "
            f"plan), got {stages!r:.80}"
        )
    batch_time = seconds(measured.get("batch_time_s"), f"{where}.measured.batch_time_s", True)
    per_call: list[tuple[float, float]] = []
    rings: list[float] = []
    updates: list[float] = []
    for s, st in enumerate(stages):
        at, m = f"{where}.measured.stages[{s}]", plan.microbatches(s)
        try:
            per_call.append((float(st["forward_s"]) / m, float(st["backward_s"]) / m))
        except (KeyError, TypeError, ValueError):
            raise PlanError(
                f"{at}: needs numbers forward_s and backward_s, got {st!r:.80}"
            ) from None
        # absent from runs measured before they were recorded: 0, not fitted
        rings.append(seconds(st.get("allreduce_s", 0.0), f"{at}.allreduce_s"))
        updates.append(seconds(st.get("update_s", 0.0), f"{at}.update_s"))
    plan.validate(profile, None)
    return Observation(
        plan,
        profile,
        batch_time,
        tuple(f for f, _ in per_call),
        tuple(b for _, b in per_call),
        tuple(rings),
        tuple(updates),
    )
