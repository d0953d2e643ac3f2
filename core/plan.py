"""Pipeline plans: contiguous stages of layers, devices per stage, microbatch per stage.

A stage's microbatch need not divide the global batch: the stage runs ``ceil(B / b)``
microbatches, the last one holding the remainder (:mod:`core.schedules`). Unequal
microbatches are allowed under both schedules.

A stage may recompute its activations (``recompute``): it keeps only its inputs between a
microbatch's forward and backward and runs the forward again, with autograd, right before
the backward. That trades one more forward per microbatch for the memory of every
activation inside the stage (rule 9r, :mod:`core.costmodel`). A plan document carries the
flag only where it is on, so a plan without recomputation reads and writes as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeplan.core import _io
from pipeplan.core.cluster import ClusterSpec, DeviceId, parse_device_id
from pipeplan.core.errors import FormatError, PlanError
from pipeplan.core.limits import MAX_GLOBAL_BATCH, MAX_MICROBATCHES, check_limit
from pipeplan.core.profile import ModelProfile
from pipeplan.core.schedules import Schedule, microbatch_count, microbatch_samples


@dataclass(frozen=True)
class Stage:
    """Layers ``[start, end)`` on ``devices`` (replicas), ``microbatch`` samples per op;
    ``recompute``: keep only the stage's inputs and rerun its forward before each backward."""

    layers: tuple[int, int]
    devices: tuple[DeviceId, ...]
    microbatch: int
    recompute: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def end(self) -> int:
        return self.layers[1]

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "layers": list(self.layers),
            "devices": list(self.devices),
            "microbatch": self.microbatch,
        }
        if self.recompute:
            doc["recompute"] = True
        return doc


@dataclass(frozen=True)
class Plan:
    """A whole plan. Constructing one checks everything that needs no profile or cluster."""

    global_batch: int
    stages: tuple[Stage, ...]
    schedule: Schedule = Schedule.GPIPE

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        _check_plan(self)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end

    @property
    def devices(self) -> tuple[DeviceId, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    @property
    def recomputing(self) -> tuple[int, ...]:
        """Indices of the stages that recompute their activations."""
        return tuple(i for i, s in enumerate(self.stages) if s.recompute)

    def microbatches(self, s: int) -> int:
        """M_s = ceil(B / b_s)."""
        return microbatch_count(self.global_batch, self.stages[s].microbatch)

    def samples(self, s: int, j: int) -> int:
        """Samples of stage ``s``'s microbatch ``j``: ``b_s``, or the remainder for the last."""
        return microbatch_samples(j, self.stages[s].microbatch, self.global_batch)

    def validate(
        self, profile: ModelProfile | None = None, cluster: ClusterSpec | None = None
    ) -> None:
        """Check the plan against a profile (layer count) and a cluster (device ids)."""
        if profile is not None and self.num_layers != len(profile):
            raise PlanError(
                f"stages[{self.num_stages - 1}].layers: ends at {self.num_layers} but profile "
                f"{profile.name!r} has {len(profile)} layers"
            )
        if cluster is not None:
            known = set(cluster.device_ids)
            for i, stage in enumerate(self.stages):
                for d in stage.devices:
                    if d not in known:
                        raise PlanError(
                            f"stages[{i}].devices: unknown device {d!r} in cluster "
                            f"{cluster.name!r} (devices: {', '.join(cluster.device_ids)})"
                        )

    # --- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "schedule": self.schedule.value,
            "stages": [s.to_dict() for s in self.stages],
        }

    @classmethod
    def from_dict(cls, doc: Any) -> Plan:
        batch = _io.integer(doc, "global_batch", "plan", minimum=1)
        sched = _io.field(doc, "schedule", "plan", "gpipe")
        try:
            schedule = Schedule(sched)
        except ValueError:
            raise FormatError(
                f"plan.schedule: unknown schedule {sched!r} (one of "
                f"{', '.join(s.value for s in Schedule)})"
            ) from None
        stages_doc = _io.field(doc, "stages", "plan")
        if not isinstance(stages_doc, list):
            raise FormatError(f"plan.stages: expected a list, got {stages_doc!r}")
        stages = [_stage_from_dict(d, f"stages[{i}]") for i, d in enumerate(stages_doc)]
        return cls(batch, tuple(stages), schedule)

    def save(self, path: str | Path) -> None:
        _io.write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(_io.read_document(path))


def _stage_from_dict(doc: Any, where: str) -> Stage:
    layers = _io.field(doc, "layers", where)
    if (
        not isinstance(layers, list | tuple)
        or len(layers) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    ):
        raise FormatError(f"{where}.layers: expected [start, end] integers, got {layers!r}")
    devices = _io.field(doc, "devices", where)
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise FormatError(f"{where}.devices: expected a list of device ids, got {devices!r}")
    mb = _io.field(doc, "microbatch", where)
    if isinstance(mb, bool) or not isinstance(mb, int):
        raise FormatError(f"{where}.microbatch: expected an integer, got {mb!r}")
    recompute = _io.field(doc, "recompute", where, False)
    if not isinstance(recompute, bool):
        raise FormatError(f"{where}.recompute: expected true or false, got {recompute!r}")
    return Stage((layers[0], layers[1]), tuple(devices), mb, recompute)


def _check_plan(plan: Plan) -> None:
    if (
        isinstance(plan.global_batch, bool)
        or not isinstance(plan.global_batch, int)
        or plan.global_batch < 1
    ):
        raise PlanError(f"plan.global_batch: must be an integer >= 1, got {plan.global_batch!r}")
    check_limit("plan.global_batch", plan.global_batch, MAX_GLOBAL_BATCH, "samples", PlanError)
    if not plan.stages:
        raise PlanError("plan.stages: empty; a plan needs >= 1 stage")
    seen: dict[str, int] = {}
    expected_start = 0
    for i, stage in enumerate(plan.stages):
        start, end = stage.layers
        if start < 0 or end < 0:
            raise PlanError(f"stages[{i}].layers: negative index in [{start}, {end}]")
        if start != expected_start:
            kind = "gap" if start > expected_start else "overlap"
            raise PlanError(
                f"stages[{i}].layers: starts at {start} but the previous stage ends at "
                f"{expected_start} ({kind}); stages must cover the layers contiguously"
            )
        if end <= start:
            raise PlanError(f"stages[{i}].layers: [{start}, {end}) holds no layer (end <= start)")
        expected_start = end
        if not stage.devices:
            raise PlanError(f"stages[{i}].devices: empty; a stage needs >= 1 device")
        for d in stage.devices:
            try:
                parse_device_id(d)
            except FormatError as e:
                raise PlanError(f"stages[{i}].devices: {e}") from None
            if d in seen:
                raise PlanError(
                    f"stages[{i}].devices: device {d!r} already used by stages[{seen[d]}]"
                    if seen[d] != i
                    else f"stages[{i}].devices: device {d!r} listed twice"
                )
            seen[d] = i
        _check_microbatch(i, stage.microbatch, plan.global_batch)
        if not isinstance(stage.recompute, bool):
            raise PlanError(
                f"stages[{i}].recompute: must be true or false, got {stage.recompute!r}"
            )


def _check_microbatch(i: int, mb: Any, global_batch: int) -> None:
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise PlanError(f"stages[{i}].microbatch: must be an integer >= 1, got {mb!r}")
    if mb > global_batch:
        raise PlanError(f"stages[{i}].microbatch: {mb} exceeds global_batch {global_batch}")
    where = f"stages[{i}].microbatch"
    count = microbatch_count(global_batch, mb)
    check_limit(where, count, MAX_MICROBATCHES, "microbatches per step", PlanError)


def uniform_stages(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_stages`` contiguous ranges of (nearly) equal length."""
    if not 1 <= n_stages <= n_layers:
        raise PlanError(
            f"n_stages: must be in [1, {n_layers}] for {n_layers} layers, got {n_stages}"
        )
    bounds = [round(k * n_layers / n_stages) for k in range(n_stages + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(n_stages)]
