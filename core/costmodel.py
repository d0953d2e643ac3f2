"""The cost model: ``simulate(plan, profile, cluster) -> Estimate``.

It follows the rules of the contract in DESIGN.md exactly, by discrete simulation of each
stage's op list. The formulas are :mod:`core.rules`' and the per-layer tables
:class:`core.tables.CostTables`', so :mod:`core.batch_eval` (the same model over a
population), the env and the planners cost a plan the same way. Rule 2b charges a
replica's backward for adding into the step's gradients on every microbatch but its first:
a profile times a backward into fresh gradients (:mod:`models.profiler`), and the
accumulating one is slower (see ``bench/results/grad_accumulation/``).

Calibration (issue #18, :mod:`core.calibration`): when the cluster spec has a
``calibration:`` block, four terms join the contract, and a spec without it (or with every
term at its default) is costed exactly as before:

- **1c.** Every layer time of type ``t`` (rule 1, measured or FLOP fallback) is multiplied by
  ``compute_scale[t]`` (default 1) and by ``model_scale[k]`` (default 1), ``k`` the profile's
  :attr:`~core.profile.ModelProfile.model_key` (``NAME@SHAPE:HASH``, the hash over the input
  shape and the layers' names, ops, sizes and successors, README), and each forward and each
  backward op of a replica on ``t`` adds ``call_overhead[t].fwd_s`` and ``.bwd_s`` (default
  0) once, whatever its share of samples; F_s and Bk_s (rule 2) are the maxima over replicas
  of those sums (rule 2b's accumulation term is added to Bk_s after, unscaled).
- **4.** A link class's send numbers are ``calibration.network``'s where it has them, and
  its ring numbers (rule 8r) ``calibration.all_reduce``'s where it has them; the rest stays
  the spec's ``network``. Rule 4's sends and rule 8's all-reduce use the link so made (a
  link with no ring numbers prices its all-reduce with its send numbers).
- **8c.** ``batch_time = max over stages (...) + step_overhead_s`` (default 0); throughput,
  cost per batch and per sample follow from that batch time.
- **8u.** Rule 8's update ``4 x params_s / bandwidth`` (and so rule 2b's accumulation) takes
  ``bandwidth = memory_bandwidth_gbps[t]`` for a replica of type ``t`` the calibration has one
  for, the spec's ``memory_bandwidth_gbps`` otherwise; the stage's slowest replica (lowest
  bandwidth) still sets it.

A link class may carry its own ring numbers (``network.<class>.all_reduce``: bandwidth and
latency, :class:`core.cluster.Link`): rule 8's all-reduce is then
``2 (r-1)/r x params / all_reduce bandwidth + 2 (r-1) x all_reduce latency`` (rule 8r);
without them it uses the link's own numbers, as before. Rule 4's sends always use the
link's own send numbers (a calibration's fitted ones where it has them).

Integer replica shares (issue #18) change rules 2 and 9; with ``r_s`` dividing every
microbatch's samples each reads exactly as before:

- **2i.** Replica ``k`` of a stage (``k = 0 .. r_s - 1`` in its device order) computes
  ``floor(n / r_s) + (1 if k < n mod r_s else 0)`` samples of an op of ``n`` samples
  (:func:`core.rules.replica_samples`): the executor cuts the ``n`` samples so, into
  contiguous shares, the first ones larger. F_s and Bk_s (rule 2) are the maxima over the
  replicas of each one's time for its own share; rule 9's activations per device are the
  largest share, ``ceil(b_s / r_s)`` samples per held microbatch
  (:func:`core.rules.replica_share`). Before, every share was the fraction ``n / r_s``: 4
  samples on 3 replicas cost 4/3 samples each, while the executor's first replica computes
  2 (the demo's plans of that kind were measured 30% slower than predicted).

Remainders and unequal 1F1B (issue #16) change rules 2, 5, 6, 7, 9 and 10 as follows; with
every ``b_s`` dividing ``B`` (and equal ones under 1F1B) each reads exactly as before:

- Rule 5, counts: ``M_s = ceil(B / b_s)``; microbatch ``j`` of stage ``s`` holds samples
  ``[j b_s, min((j+1) b_s, B))``, so ``n_{s,j} = b_s`` except the last one's
  ``B - (M_s - 1) b_s``. Any ``1 <= b_s <= B`` is a valid plan, under either schedule.
- Rule 2: an op of microbatch ``j`` lasts F_s or Bk_s computed for ``n_{s,j}`` samples (each
  replica's own share of them, rule 2i). Rule 2b's accumulation,
  ``(M_s - 1) / M_s`` x update, is added to every backward, the last one's too.
- Rule 5, 1F1B: stage ``s`` runs ``w_s`` warm-up forwards, then alternates ``F(w_s + i)``
  and ``B(i)``, then the remaining backwards. From the last stage up, ``w_{S-1} = 0`` and
  ``w_s = min(M_s, max(ceil(sum_{t>s} b_t / b_s), max_{i<M_s} (ceil(f(i) / b_s) - i - 1)))``
  with ``f(i) = min((w_{s+1} + k_i + 1) b_{s+1}, B)`` and ``k_i`` rule 6's index of stage
  ``s+1``'s microbatch holding the last sample of ``i``: the first term keeps the samples
  the stages after ``s`` hold in flight (``S - s - 1`` when the sizes are equal), the second
  makes the schedule deadlock-free (before its backward ``i`` the stage has forwarded every
  sample stage ``s+1`` needs to send that gradient). See
  :func:`core.schedules.one_f_one_b_warmups`.
- Rule 6: the neighbour's microbatch an op waits for is the one holding sample
  ``min((j+1) b_s, B) - 1``: ``k = ceil(min((j+1) b_s, B) / b_other) - 1``.
- Rule 7: a send of microbatch ``j`` carries ``n_{s,j}`` samples (forward: of X_s; gradient:
  of X_{s-1}).
- Rule 9: a stage holds ``H_s`` samples of activations at its peak: ``H_s = B`` for GPipe;
  ``H_s = min((w_s + 1) b_s, B)`` for 1F1B (its first ``min(w_s + 1, M_s)`` microbatches).
  Memory per device ``4 x params_s + (H_s / b_s) x ceil(b_s / r_s) x acts_s``
  (:func:`core.rules.held_microbatches`).
- Rule 10: the op time of a stage is the sum of its ops' durations, ``(M_s - 1) (F_s + Bk_s)
  + F_s(n_last) + Bk_s(n_last)``.

Activation recomputation (a stage's ``recompute``, :class:`core.plan.Stage`) changes rules 2
and 9 for that stage only; a plan without it is costed exactly as before:

- **2r.** Each backward first runs the stage's forward again: a replica's backward of a
  share lasts its forward plus its backward of that share (rules 1, 1c and 2i, call
  overheads included), Bk_s is the maximum of that over the replicas, and rule 2b's
  accumulation is added after (:func:`core.rules.recompute_backward_s`). The schedule and
  the sends are unchanged; rule 10 counts the extra forward as op time.
- **9r.** Between a microbatch's forward and its backward the stage keeps only its inputs,
  ``X_{s-1}`` bytes per sample (rule 3's cut before it; 0 for the first stage), and during a
  backward it holds one microbatch's activations again: memory per device ``4 x params_s +
  (H_s / b_s) x ceil(b_s / r_s) x X_{s-1} + ceil(b_s / r_s) x acts_s``
  (:func:`core.rules.recompute_memory_bytes`). A stage over memory without recomputation
  that would fit with it says so in ``not_fitting``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.objective import SECONDS_PER_HOUR
from pipeplan.core.plan import Plan, Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.core.schedules import one_f_one_b_warmups, stage_orders, upstream_microbatch
from pipeplan.core.tables import CostTables

EventKind = Literal["F", "B", "send", "grad", "update", "allreduce"]
_Terms = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Rule 1's fixed and per-sample times (type x layer) and rule 1c's call overhead (per type)
of one pass, forward or backward."""


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
    recompute: bool = False
    """The stage recomputes its activations (rules 2r and 9r); in the document only when on."""

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["layers"] = list(self.layers)
        d["devices"] = list(self.devices)
        if not self.recompute:
            del d["recompute"]
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
    return _Simulation(plan, CostTables.of(profile, cluster)).run()


class _Simulation:
    """State of one simulation; :meth:`run` walks every stage's op list in dependency order."""

    def __init__(self, plan: Plan, tables: CostTables) -> None:
        self.plan, self.tables, self.cluster = plan, tables, tables.cluster
        self.S = S = plan.num_stages
        self.m = [plan.microbatches(s) for s in range(S)]
        self.params = [float(tables.params(st.start, st.end)) for st in plan.stages]
        self.b = [st.microbatch for st in plan.stages]
        # samples of each stage's last microbatch: b_s, or the remainder
        self.n_last = [plan.samples(s, self.m[s] - 1) for s in range(S)]
        self.warmups = (
            one_f_one_b_warmups(self.b, plan.global_batch)
            if plan.schedule is Schedule.ONE_F_ONE_B
            else [0] * S
        )
        self.update = [self._update(s) for s in range(S)]
        self.fwd = [self._stage_time(s, [self._forward_terms]) for s in range(S)]
        self.bwd = [self._backward(s, self.b[s]) for s in range(S)]
        # the last microbatch's times (the same numbers when it is a full one)
        self.fwd_last = [
            self._stage_time(s, [self._forward_terms], self.n_last[s]) for s in range(S)
        ]
        self.bwd_last = [self._backward(s, self.n_last[s]) for s in range(S)]
        self.x = [
            float(tables.cuts[st.end]) if s < S - 1 else 0.0 for s, st in enumerate(plan.stages)
        ]
        self.links = [
            self.cluster.link(plan.stages[s].devices, plan.stages[s + 1].devices)
            for s in range(S - 1)
        ]
        self.events: list[Event] = []
        # Rule 10's transfer time, summed from each send's duration as it is costed (not
        # recovered as ``end - start`` later, which loses the small durations of a long run).
        self.transfer = [0.0] * S

    @property
    def _forward_terms(self) -> _Terms:
        tables = self.tables
        return tables.fwd_fixed, tables.fwd_per_sample, tables.fwd_call

    @property
    def _backward_terms(self) -> _Terms:
        tables = self.tables
        return tables.bwd_fixed, tables.bwd_per_sample, tables.bwd_call

    def _stage_time(self, s: int, passes: list[_Terms], samples: int | None = None) -> float:
        """Rule 2: max over replicas of the summed layer times for each one's share (rule 2i)
        of a microbatch of ``n`` samples (``b_s`` unless given), plus the replica type's call
        overhead (rule 1c); with several ``passes`` (rule 2r's forward then backward) a
        replica's time is the sum of its passes, in order."""
        stage = self.plan.stages[s]
        n = stage.microbatch if samples is None else samples
        best = 0.0
        for k, d in enumerate(stage.devices):
            share = rules.replica_samples(n, stage.replicas, k)
            t = self.tables.type_index[self.cluster.device(d).type]
            layers = slice(stage.start, stage.end)
            times = [
                sum(rules.compute_s(fixed[t, layers], per[t, layers], share).tolist())
                + float(call[t])
                for fixed, per, call in passes
            ]
            total = times[0] if len(times) == 1 else rules.recompute_backward_s(*times)
            best = max(best, total)
        return best

    def _backward(self, s: int, samples: int) -> float:
        """Rule 2 and 2b: the backward of ``samples`` samples plus its share of accumulation;
        rule 2r: a recomputing stage's forward again before it."""
        passes = [self._backward_terms]
        if self.plan.stages[s].recompute:
            passes = [self._forward_terms, self._backward_terms]
        return self._stage_time(s, passes, samples) + rules.accumulation_s(
            self.update[s], self.m[s]
        )

    def _update(self, s: int) -> float:
        """Rule 8's update on the stage's slowest replica (rule 2b charges it too)."""
        cluster, devices = self.cluster, self.plan.stages[s].devices
        bandwidth = min(cluster.memory_bandwidth_gbps(cluster.device(d).type) for d in devices)
        return float(rules.update_s(self.params[s], bandwidth))

    def _send(
        self, s: int, link: int, ready: float, nbytes: float, kind: EventKind, j: int
    ) -> float:
        """Rule 7: one send on a directional link, after the previous one; returns delivery."""
        free = self.grad_link if kind == "grad" else self.fwd_link
        start = max(ready, free[link])
        duration = self.links[link].transfer_s(nbytes)
        end = start + duration
        free[link] = end
        self.transfer[s] += duration
        self.events.append(Event(s, kind, j, start, end))
        return end

    def run(self) -> Estimate:
        S = self.S
        orders = stage_orders(self.plan.schedule, self.b, self.plan.global_batch)
        self.pos, self.free = [0] * S, [0.0] * S
        self.fwd_end: list[dict[int, float]] = [{} for _ in range(S)]
        self.delivered: list[dict[int, float]] = [{} for _ in range(S)]  # forward sends of s
        self.grad_at: list[dict[int, float]] = [{} for _ in range(S)]  # gradient sends of s
        self.last_bwd = [0.0] * S
        self.fwd_link, self.grad_link = [0.0] * max(S - 1, 0), [0.0] * max(S - 1, 0)
        remaining = sum(len(o) for o in orders)
        while remaining:
            progressed = False
            for s in range(S):
                while self.pos[s] < len(orders[s]) and self._step(s, *orders[s][self.pos[s]]):
                    self.pos[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # pragma: no cover - the schedules above cannot deadlock
                raise RuntimeError(f"schedule deadlocked at positions {self.pos}")
        return self._finish()

    def _step(self, s: int, kind: str, j: int) -> bool:
        """Run op ``(kind, j)`` of stage ``s`` if its dependencies are done (rules 6 and 7)."""
        b, last, B = self.b, self.S - 1, self.plan.global_batch
        final = j == self.m[s] - 1
        n = self.n_last[s] if final else b[s]  # rule 7: a send carries the op's samples
        if kind == "F":
            k = upstream_microbatch(j, b[s], b[s - 1], B) if s else -1
            if s and k not in self.delivered[s - 1]:
                return False
            start = max(self.free[s], self.delivered[s - 1][k] if s else 0.0)
            end = start + (self.fwd_last[s] if final else self.fwd[s])
            self.fwd_end[s][j] = end
            if s < last:
                self.delivered[s][j] = self._send(s, s, end, self.x[s] * n, "send", j)
        else:
            k = upstream_microbatch(j, b[s], b[s + 1], B) if s < last else -1
            if s < last and k not in self.grad_at[s + 1]:
                return False
            dep = self.grad_at[s + 1][k] if s < last else 0.0
            start = max(self.free[s], dep, self.fwd_end[s][j])
            end = start + (self.bwd_last[s] if final else self.bwd[s])
            self.last_bwd[s] = end
            if s > 0:
                self.grad_at[s][j] = self._send(s, s - 1, end, self.x[s - 1] * n, "grad", j)
        self.events.append(Event(s, "F" if kind == "F" else "B", j, start, end))
        self.free[s] = end
        return True

    def _stage(self, s: int, problems: list[str]) -> StageEstimate:
        """Rules 8 and 9 for stage ``s``: its update, all-reduce and memory; a line in
        ``problems`` for each of its devices the stage does not fit on."""
        st, m, cluster = self.plan.stages[s], self.m[s], self.cluster
        types = [cluster.device_type(d) for d in st.devices]
        update, params = self.update[s], self.params[s]
        allreduce = 0.0
        if st.replicas > 1:
            link = cluster.link(st.devices, st.devices)
            allreduce = link.allreduce_s(params, st.replicas)
        end = self.last_bwd[s]
        self.events.append(Event(s, "update", -1, end, end + update))
        if allreduce:
            self.events.append(Event(s, "allreduce", -1, end + update, end + update + allreduce))
        held = float(
            rules.held_microbatches(
                self.plan.schedule, st.microbatch, self.plan.global_batch, self.warmups[s]
            )
        )
        acts = float(self.tables.acts(st.start, st.end))
        share = rules.replica_share(st.microbatch, st.replicas)
        inputs = float(self.tables.cuts[st.start])
        plain = rules.memory_bytes(params, acts, share, held)
        recomputed = rules.recompute_memory_bytes(params, inputs, acts, share, held)
        memory = recomputed if st.recompute else plain
        capacity = min(t.memory_bytes for t in types)
        for d, t in zip(st.devices, types, strict=True):
            if memory > t.memory_bytes:
                hint = ""
                if not st.recompute and recomputed <= t.memory_bytes:
                    hint = f" ({recomputed / rules.GB:.3f} GB with recompute: it would fit)"
                problems.append(
                    f"stage {s} on {d}: needs {memory / rules.GB:.3f} GB > "
                    f"{t.memory_gb:g} GB of {t.name}{hint}"
                )
        return StageEstimate(
            index=s,
            layers=st.layers,
            devices=st.devices,
            microbatch=st.microbatch,
            microbatches=m,
            forward_s=self.fwd[s],
            backward_s=self.bwd[s],
            compute_s=self._compute(s),
            transfer_s=self.transfer[s],
            boundary_bytes=self.x[s],
            update_s=update,
            allreduce_s=allreduce,
            end_s=end + update + allreduce,
            memory_bytes=memory,
            memory_capacity_bytes=capacity,
            fits=memory <= capacity,
            recompute=st.recompute,
        )

    def _compute(self, s: int) -> float:
        """Rule 10's op time of stage ``s``: its M_s forwards and backwards."""
        m, full = self.m[s], self.fwd[s] + self.bwd[s]
        if self.n_last[s] == self.b[s]:
            return m * full
        return (m - 1) * full + (self.fwd_last[s] + self.bwd_last[s])

    def _finish(self) -> Estimate:
        """Rule 10: batch time, price, throughput and communication share."""
        plan, cluster = self.plan, self.cluster
        problems: list[str] = []
        stages = [self._stage(s, problems) for s in range(self.S)]
        batch_time = max(st.end_s for st in stages) + self.tables.step_overhead
        price = sum(cluster.device_type(d).price_per_hour for d in plan.devices)
        comm, comp = sum(self.transfer), sum(st.compute_s for st in stages)
        cost_batch = price * batch_time / SECONDS_PER_HOUR
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
