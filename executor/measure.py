"""What a run measured: batch times, per-stage compute and transfer, loss and accuracy.

Every operation's record carries its start (its inputs had arrived and the worker was free)
and end. An operation's **transfer** time is the gap between the moment it could have
started had its inputs been delivered instantly (its worker's previous operation ended and
every operation it reads from ended) and the moment it did start: packing the message,
the process group's send and receive, unpacking. It is charged to the receiving stage.
``comm_fraction`` is total transfer / (that + total forward and backward compute), the cost
model's definition (rule 10); updates and the replicas' gradient exchange are not counted.

:class:`Comparison` holds a measured run beside the cost model's prediction for the same plan
("predicted vs measured"), with :func:`relative_error` as the one definition of the error;
:func:`publish_errors` puts those errors in Ray's metrics (:mod:`executor.metrics`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pipeplan.core.costmodel import Estimate
from pipeplan.core.held_out import relative_error
from pipeplan.core.plan import Plan
from pipeplan.executor import metrics
from pipeplan.executor.emulation import EMULATED_NOTE
from pipeplan.executor.microbatch import Layout
from pipeplan.executor.stage import OpRecord


@dataclass(frozen=True)
class Placement:
    """Where one stage replica ran."""

    stage: int
    replica: int
    device: str
    node: str
    node_id: str
    pid: int


@dataclass(frozen=True)
class StepResult:
    """One training step as the driver saw it."""

    step: int
    start: float
    batch_time_s: float
    loss: float
    accuracy: float
    records: tuple[OpRecord, ...]


@dataclass(frozen=True)
class StageMeasurement:
    """One stage, per batch (mean over measured steps; the busiest replica)."""

    index: int
    layers: tuple[int, int]
    devices: tuple[str, ...]
    microbatch: int
    forward_s: float
    backward_s: float
    update_s: float
    compute_s: float
    """Forward plus backward (as the cost model's ``compute_s``)."""
    transfer_s: float
    """Waiting for inputs that had been produced: packing, sending, receiving."""
    wait_s: float
    """Batch time not spent computing (forward, backward, update): transfer and bubbles."""
    emulated_s: float
    """Part of forward + backward that is emulation sleep."""
    cpu_s: float = 0.0
    """CPU time of the real forward + backward (without the sleep and core waits)."""
    allreduce_s: float = 0.0
    """The replicas' all-reduce (0 without replicas): from the moment the last replica began
    it to the moment the last one ended, so not the wait for a slower replica's backward."""


@dataclass(frozen=True)
class Measurement:
    """A measured run of one plan. Times in seconds."""

    plan: Plan
    steps: int
    warmup: int
    batch_times_s: tuple[float, ...]
    """Every measured step (after warm-up)."""
    batch_time_s: float
    batch_time_std_s: float
    batch_time_min_s: float
    batch_time_max_s: float
    throughput: float
    """Samples per second at the mean batch time."""
    comm_fraction: float
    stages: tuple[StageMeasurement, ...]
    losses: tuple[float, ...]
    """Mean cross-entropy of every step, warm-up included."""
    accuracies: tuple[float, ...]
    emulated: bool
    placement: tuple[Placement, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        d["note"] = EMULATED_NOTE if self.emulated else "measured on real devices"
        return d

    def summary(self) -> str:
        """A few lines for people (ms), flagged when emulated."""
        head = (
            f"batch time {self.batch_time_s * 1e3:.1f} ms "
            f"(std {self.batch_time_std_s * 1e3:.1f}, {self.steps} steps after "
            f"{self.warmup} warm-up), throughput {self.throughput:.1f} samples/s, "
            f"comm fraction {self.comm_fraction:.2f}"
        )
        lines = [f"[{EMULATED_NOTE}]" if self.emulated else "[real devices]", head]
        for st in self.stages:
            lines.append(
                f"  stage {st.index} {list(st.layers)} on {', '.join(st.devices)}: "
                f"fwd {st.forward_s * 1e3:.1f} ms, bwd {st.backward_s * 1e3:.1f} ms, "
                f"update {st.update_s * 1e3:.1f} ms, transfer {st.transfer_s * 1e3:.1f} ms, "
                f"idle {st.wait_s * 1e3:.1f} ms"
            )
        lines.append(f"  loss {self.losses[-1]:.4f}, accuracy {self.accuracies[-1]:.3f}")
        return "\n".join(lines)


RecordKey = tuple[int, int, str, int]  # stage, replica, kind, microbatch


def transfers(
    layout: Layout, records: Sequence[OpRecord], step_start: float
) -> dict[RecordKey, float]:
    """Transfer time of each forward and backward of one step (module docstring)."""
    end = {(r.stage, r.replica, r.kind, r.microbatch): r.end for r in records}
    previous: dict[tuple[int, int], float] = {}
    out: dict[RecordKey, float] = {}
    for r in sorted(records, key=lambda r: r.start):
        free = previous.get((r.stage, r.replica), step_start)
        previous[(r.stage, r.replica)] = r.end
        if r.kind not in ("F", "B"):
            continue
        s, j, k = r.stage, r.microbatch, r.replica
        if r.kind == "F" and s > 0:
            deps = [
                end[(p.stage, p.replica, "F", p.microbatch)] for p in layout.forward_pieces(s, j, k)
            ]
        elif r.kind == "B" and s < layout.num_stages - 1:
            deps = [
                end[(p.stage, p.replica, "B", p.microbatch)]
                for p in layout.backward_pieces(s, j, k)
            ]
        else:
            deps = []
        out[(s, k, r.kind, j)] = max(0.0, r.start - max([free, *deps]))
    return out


def summarise(
    plan: Plan,
    results: Sequence[StepResult],
    warmup: int,
    *,
    emulated: bool,
    placement: Sequence[Placement],
) -> Measurement:
    """Fold the steps of a run into a :class:`Measurement` (warm-up steps: loss only)."""
    measured = list(results[warmup:]) or list(results[-1:])
    layout = Layout.of(plan.global_batch, [(s.microbatch, s.replicas) for s in plan.stages])
    per_stage: list[list[dict[str, float]]] = [[] for _ in plan.stages]
    for res in measured:
        moved = transfers(layout, res.records, res.start)
        for s, stage in enumerate(plan.stages):
            reps = [_replica(res, s, k, moved) for k in range(stage.replicas)]
            busiest = max(reps, key=lambda d: d["forward"] + d["backward"])
            row = dict(busiest)
            row["transfer"] = max(d["transfer"] for d in reps)
            row["wait"] = res.batch_time_s - (row["forward"] + row["backward"] + row["update"])
            row["allreduce"] = _allreduce(res, s)
            per_stage[s].append(row)
    stages = tuple(_stage(plan, s, rows) for s, rows in enumerate(per_stage))
    times = tuple(r.batch_time_s for r in measured)
    mean = statistics.fmean(times)
    moved_total = sum(st.transfer_s for st in stages)
    compute_total = sum(st.compute_s for st in stages)
    return Measurement(
        plan=plan,
        steps=len(measured),
        warmup=min(warmup, len(results) - len(measured)),
        batch_times_s=times,
        batch_time_s=mean,
        batch_time_std_s=statistics.pstdev(times) if len(times) > 1 else 0.0,
        batch_time_min_s=min(times),
        batch_time_max_s=max(times),
        throughput=plan.global_batch / mean,
        comm_fraction=moved_total / (moved_total + compute_total) if compute_total else 0.0,
        stages=stages,
        losses=tuple(r.loss for r in results),
        accuracies=tuple(r.accuracy for r in results),
        emulated=emulated,
        placement=tuple(placement),
    )


def _replica(res: StepResult, s: int, k: int, moved: dict[RecordKey, float]) -> dict[str, float]:
    mine = [r for r in res.records if r.stage == s and r.replica == k]
    return {
        "forward": sum(r.compute_s for r in mine if r.kind == "F"),
        "backward": sum(r.compute_s for r in mine if r.kind == "B"),
        "update": sum(r.compute_s for r in mine if r.kind == "U"),
        "emulated": sum(r.emulated_s for r in mine),
        "cpu": sum(r.cpu_s for r in mine if r.kind in ("F", "B")),
        "transfer": sum(v for (st, rep, _, _), v in moved.items() if st == s and rep == k),
    }


def _allreduce(res: StepResult, s: int) -> float:
    """Stage ``s``'s all-reduce in one step (a ``G`` record per replica): the last end less
    the latest start."""
    ring = [r for r in res.records if r.stage == s and r.kind == "G"]
    if not ring:
        return 0.0
    began: dict[int, float] = {}
    for r in ring:
        began[r.replica] = min(began.get(r.replica, r.start), r.start)
    return max(r.end for r in ring) - max(began.values())


def _stage(plan: Plan, s: int, rows: list[dict[str, float]]) -> StageMeasurement:
    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    stage = plan.stages[s]
    return StageMeasurement(
        index=s,
        layers=stage.layers,
        devices=stage.devices,
        microbatch=stage.microbatch,
        forward_s=mean("forward"),
        backward_s=mean("backward"),
        update_s=mean("update"),
        compute_s=mean("forward") + mean("backward"),
        transfer_s=mean("transfer"),
        wait_s=mean("wait"),
        emulated_s=mean("emulated"),
        cpu_s=mean("cpu"),
        allreduce_s=mean("allreduce"),
    )


def publish_errors(estimate: Estimate, measurement: Measurement, source: str) -> None:
    """The prediction's relative errors -- batch time, each stage's compute and transfer --
    in Ray's metrics, tagged with ``source`` (who measured: ``run``, ``measured``).
    A quantity measured as zero has no relative error and is left out."""
    if not metrics.enabled():
        return
    metrics.prediction_error(
        "batch_time", source, relative_error(estimate.batch_time_s, measurement.batch_time_s)
    )
    for p, q in zip(estimate.stages, measurement.stages, strict=True):
        metrics.prediction_error("stage_compute", source, relative_error(p.compute_s, q.compute_s))
        metrics.prediction_error(
            "stage_transfer", source, relative_error(p.transfer_s, q.transfer_s)
        )


@dataclass(frozen=True)
class Comparison:
    """A measured run beside the cost model's prediction for the same plan."""

    model: str
    cluster: str
    profile_from: str
    """Where the profile the prediction used came from (for people)."""
    estimate: Estimate
    measurement: Measurement

    @property
    def error(self) -> float:
        """Relative error of the predicted batch time."""
        return relative_error(self.estimate.batch_time_s, self.measurement.batch_time_s)

    def to_dict(self) -> dict[str, Any]:
        est, m = self.estimate, self.measurement
        return {
            "model": self.model,
            "cluster": self.cluster,
            "profile": self.profile_from,
            "emulated": m.emulated,
            "plan": m.plan.to_dict(),
            "predicted": est.to_dict(),
            "measured": m.to_dict(),
            "error": {
                "definition": "(predicted - measured) / measured; comm_fraction: difference",
                "batch_time": self.error,
                "throughput": relative_error(est.throughput, m.throughput),
                "comm_fraction": est.comm_fraction - m.comm_fraction,
                "stages": [
                    {
                        "compute": relative_error(p.compute_s, q.compute_s),
                        "transfer": relative_error(p.transfer_s, q.transfer_s),
                    }
                    for p, q in zip(est.stages, m.stages, strict=True)
                ],
            },
        }
