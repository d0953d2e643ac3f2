"""The cost model: ``simulate(plan, profile, cluster) -> Estimate``.

It follows the ten rules of the contract in DESIGN.md exactly, with one addition to rule 2:
a replica's backward adds into the step's gradients on every microbatch but its first, and
that costs what rule 8 charges an update (``4 x params_bytes / memory_bandwidth``, the
slowest replica's), so each of a stage's ``M_s`` backward ops carries ``(M_s - 1) / M_s`` of
it. A profile times a backward into fresh gradients (:mod:`models.profiler`); on this machine
the accumulating backward of the fidelity models took 1.04-1.27x as long
(``bench/grad_accumulation.py``, which also compares the term with the measured cost).
Every searcher, the env reward and the benchmarks use this module, and ``core.batch_eval``
reproduces it for whole populations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from core.cluster import ClusterSpec, DeviceType
from core.plan import Plan, Schedule
from core.profile import ModelProfile
from core.schedules import stage_order, upstream_microbatch

EventKind = Literal["F", "B", "send", "grad", "update", "allreduce"]


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer forward/backward cost on one device type: ``fixed + n * per_sample``."""

    fwd_fixed: np.ndarray
    fwd_per_sample: np.ndarray
    bwd_fixed: np.ndarray
    bwd_per_sample: np.ndarray


def layer_costs(profile: ModelProfile, dtype: DeviceType) -> LayerCosts:
    """Rule 1: measured timings where the profile has them, else ``flops / device flops``."""
    rows = []
    for layer in profile.layers:
        t = layer.timings.get(dtype.name)
        if t is not None:
            rows.append((t.fwd_fixed_s, t.fwd_s, t.bwd_fixed_s, t.bwd_s))
        else:
            fwd = layer.flops / dtype.flops
            rows.append((0.0, fwd, 0.0, 2.0 * fwd))
    a = np.array(rows, dtype=np.float64).reshape(len(profile), 4)
    return LayerCosts(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy())


def cut_bytes(profile: ModelProfile) -> np.ndarray:
    """Rule 3: ``X[c]`` = activation bytes per sample crossing a cut before layer ``c``.

    A layer ``l < c`` counts when any of its successors is ``>= c`` (skips are relayed).
    """
    n = len(profile)
    x = np.zeros(n + 1, dtype=np.float64)
    for c in range(1, n):
        x[c] = sum(
            layer.activation_bytes
            for layer in profile.layers[:c]
            if any(s >= c for s in layer.successors)
        )
    return x


@dataclass(frozen=True)
class Event:
    """One box of the schedule: a compute op, a send, an update or an all-reduce."""

    stage: int
    kind: EventKind
    microbatch: int
    start: float
    end: float


@dataclass(frozen=True)
class StageEstimate:
    index: int
    layers: tuple[int, int]
    devices: tuple[str, ...]
    microbatch: int
    microbatches: int
    forward_s: float
    backward_s: float
    compute_s: float
    transfer_s: float
    boundary_bytes: float
    update_s: float
    allreduce_s: float
    end_s: float
    memory_bytes: float
    memory_capacity_bytes: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["layers"] = list(self.layers)
        d["devices"] = list(self.devices)
        return d


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one plan. Units: seconds, bytes, samples, dollars."""

    global_batch: int
    schedule: Schedule
    batch_time_s: float
    throughput: float
    cost_per_hour: float
    cost_per_batch: float
    cost_per_sample: float
    comm_fraction: float
    fits: bool
    not_fitting: tuple[str, ...]
    stages: tuple[StageEstimate, ...]
    timeline: tuple[Event, ...]

    @property
    def compute_s(self) -> float:
        return sum(s.compute_s for s in self.stages)

    @property
    def transfer_s(self) -> float:
        return sum(s.transfer_s for s in self.stages)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "global_batch": self.global_batch,
            "schedule": self.schedule.value,
            "batch_time_s": self.batch_time_s,
            "throughput": self.throughput,
            "cost_per_hour": self.cost_per_hour,
            "cost_per_batch": self.cost_per_batch,
            "cost_per_sample": self.cost_per_sample,
            "comm_fraction": self.comm_fraction,
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "fits": self.fits,
            "not_fitting": list(self.not_fitting),
            "stages": [s.to_dict() for s in self.stages],
        }
        if timeline:
            d["timeline"] = [e.__dict__ for e in self.timeline]
        return d


def simulate(plan: Plan, profile: ModelProfile, cluster: ClusterSpec) -> Estimate:
    """Cost one plan by discrete simulation of its schedule (DESIGN.md rules 1-10)."""
    plan.validate(profile, cluster)
    return _Simulation(plan, profile, cluster).run()


class _Simulation:
    """State of one simulation; :meth:`run` walks every stage's op list in dependency order."""

    def __init__(self, plan: Plan, profile: ModelProfile, cluster: ClusterSpec) -> None:
        self.plan, self.profile, self.cluster = plan, profile, cluster
        self.S = plan.num_stages
        costs = {
            t: layer_costs(profile, cluster.device_types[t])
            for t in {cluster.device(d).type for d in plan.devices}
        }
        self.fwd = [self._stage_time(s, costs, "fwd") for s in range(self.S)]
        self.bwd = [
            self._stage_time(s, costs, "bwd") + self._accumulation(s) for s in range(self.S)
        ]
        cuts = cut_bytes(profile)
        self.x = [
            float(cuts[st.end]) if s < self.S - 1 else 0.0 for s, st in enumerate(plan.stages)
        ]
        self.links = [
            cluster.link(plan.stages[s].devices, plan.stages[s + 1].devices)
            for s in range(self.S - 1)
        ]
        self.events: list[Event] = []
        # Rule 10's transfer time, summed from each send's duration as it is costed (not
        # recovered as ``end - start`` later, which loses the small durations of a long run).
        self.transfer = [0.0] * self.S

    def _stage_time(self, s: int, costs: dict[str, LayerCosts], kind: str) -> float:
        """Rule 2: max over replicas of the summed layer times for a ``b_s / r_s`` share."""
        stage = self.plan.stages[s]
        n = stage.microbatch / stage.replicas
        best = 0.0
        for d in stage.devices:
            c = costs[self.cluster.device(d).type]
            fixed, per = (
                (c.fwd_fixed, c.fwd_per_sample)
                if kind == "fwd"
                else (c.bwd_fixed, c.bwd_per_sample)
            )
            t = sum(float(fixed[i] + n * per[i]) for i in range(stage.start, stage.end))
            best = max(best, t)
        return best

    def _accumulation(self, s: int) -> float:
        """Rule 2, gradient accumulation: a replica's backward adds into the step's gradients
        on every microbatch but its first, rule 8's ``4 x params / bandwidth`` (slowest
        replica) each time; spread evenly over the stage's ``M_s`` backward ops."""
        stage = self.plan.stages[s]
        m = self.plan.microbatches(s)
        params = float(
            sum(layer.params_bytes for layer in self.profile.layers[stage.start : stage.end])
        )
        bandwidth = min(self.cluster.device_type(d).memory_bandwidth_gbps for d in stage.devices)
        return (m - 1) / m * 4.0 * params / (bandwidth * 1e9)

    def _send(
        self,
        s: int,
        link_free: list[float],
        ready: float,
        nbytes: float,
        li: int,
        kind: EventKind,
        j: int,
    ) -> float:
        """Rule 7: one send on a directional link, after the previous one; returns delivery."""
        start = max(ready, link_free[li])
        duration = self.links[li].transfer_s(nbytes)
        end = start + duration
        link_free[li] = end
        self.transfer[s] += duration
        self.events.append(Event(s, kind, j, start, end))
        return end

    def run(self) -> Estimate:
        plan, S = self.plan, self.S
        b = [st.microbatch for st in plan.stages]
        m = [plan.microbatches(s) for s in range(S)]
        orders = [stage_order(plan.schedule, m[s], s, S) for s in range(S)]
        pos, free = [0] * S, [0.0] * S
        fwd_end: list[dict[int, float]] = [{} for _ in range(S)]
        delivered: list[dict[int, float]] = [{} for _ in range(S)]  # forward sends of s
        grad_at: list[dict[int, float]] = [{} for _ in range(S)]  # gradient sends of s
        last_bwd = [0.0] * S
        fwd_link, grad_link = [0.0] * max(S - 1, 0), [0.0] * max(S - 1, 0)
        remaining = sum(len(o) for o in orders)
        while remaining:
            progressed = False
            for s in range(S):
                while pos[s] < len(orders[s]):
                    kind, j = orders[s][pos[s]]
                    if kind == "F":
                        k = upstream_microbatch(j, b[s], b[s - 1]) if s else -1
                        if s and k not in delivered[s - 1]:
                            break
                        dep = delivered[s - 1][k] if s else 0.0
                        start = max(free[s], dep)
                        end = start + self.fwd[s]
                        fwd_end[s][j] = end
                        if s < S - 1:
                            delivered[s][j] = self._send(
                                s, fwd_link, end, self.x[s] * b[s], s, "send", j
                            )
                    else:
                        k = upstream_microbatch(j, b[s], b[s + 1]) if s < S - 1 else -1
                        if s < S - 1 and k not in grad_at[s + 1]:
                            break
                        dep = grad_at[s + 1][k] if s < S - 1 else 0.0
                        start = max(free[s], dep, fwd_end[s][j])
                        end = start + self.bwd[s]
                        last_bwd[s] = end
                        if s > 0:
                            grad_at[s][j] = self._send(
                                s, grad_link, end, self.x[s - 1] * b[s], s - 1, "grad", j
                            )
                    self.events.append(Event(s, kind, j, start, end))
                    free[s] = end
                    pos[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # pragma: no cover - the schedules above cannot deadlock
                raise RuntimeError(f"schedule deadlocked at positions {pos}")
        return self._finish(last_bwd, m)

    def _finish(self, last_bwd: Sequence[float], m: Sequence[int]) -> Estimate:
        plan, profile, cluster = self.plan, self.profile, self.cluster
        stages, problems = [], []
        transfer = self.transfer
        for s, st in enumerate(plan.stages):
            layers = profile.layers[st.start : st.end]
            params = float(sum(layer.params_bytes for layer in layers))
            acts = float(sum(layer.activation_bytes for layer in layers))
            types = [cluster.device_type(d) for d in st.devices]
            update = max(4.0 * params / (t.memory_bandwidth_gbps * 1e9) for t in types)
            allreduce = 0.0
            if st.replicas > 1:
                r, link = st.replicas, cluster.link(st.devices, st.devices)
                allreduce = (
                    2 * (r - 1) / r * params / link.bytes_per_s + 2 * (r - 1) * link.latency_s
                )
            self.events.append(Event(s, "update", -1, last_bwd[s], last_bwd[s] + update))
            if allreduce:
                self.events.append(
                    Event(
                        s, "allreduce", -1, last_bwd[s] + update, last_bwd[s] + update + allreduce
                    )
                )
            in_flight = m[s] if plan.schedule is Schedule.GPIPE else min(self.S - s, m[s])
            memory = 4.0 * params + in_flight * (st.microbatch / st.replicas) * acts
            capacity = min(t.memory_bytes for t in types)
            for d, t in zip(st.devices, types, strict=True):
                if memory > t.memory_bytes:
                    problems.append(
                        f"stage {s} on {d}: needs {memory / 1e9:.3f} GB > "
                        f"{t.memory_gb:g} GB of {t.name}"
                    )
            stages.append(
                StageEstimate(
                    index=s,
                    layers=st.layers,
                    devices=st.devices,
                    microbatch=st.microbatch,
                    microbatches=m[s],
                    forward_s=self.fwd[s],
                    backward_s=self.bwd[s],
                    compute_s=m[s] * (self.fwd[s] + self.bwd[s]),
                    transfer_s=transfer[s],
                    boundary_bytes=self.x[s],
                    update_s=update,
                    allreduce_s=allreduce,
                    end_s=last_bwd[s] + update + allreduce,
                    memory_bytes=memory,
                    memory_capacity_bytes=capacity,
                    fits=memory <= capacity,
                )
            )
        batch_time = max(st.end_s for st in stages)
        price = sum(cluster.device_type(d).price_per_hour for d in plan.devices)
        comm, comp = sum(transfer), sum(st.compute_s for st in stages)
        cost_batch = price * batch_time / 3600.0
        return Estimate(
            global_batch=plan.global_batch,
            schedule=plan.schedule,
            batch_time_s=batch_time,
            throughput=plan.global_batch / batch_time if batch_time > 0 else float("inf"),
            cost_per_hour=price,
            cost_per_batch=cost_batch,
            cost_per_sample=cost_batch / plan.global_batch,
            comm_fraction=comm / (comm + comp) if comm + comp > 0 else 0.0,
            fits=not problems,
            not_fitting=tuple(problems),
            stages=tuple(stages),
            timeline=tuple(sorted(self.events, key=lambda e: (e.start, e.stage))),
        )
