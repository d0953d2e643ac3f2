"""Fit a cluster's calibration (:mod:`core.calibration`) to measured runs, by least squares.

An :class:`~core.observations.Observation` is one measured plan with the profile it was
predicted from: the measured batch time and, per stage, the busiest replica's forward and
backward per call. :func:`fit` finds the terms that make the cost model agree with them:

- per device type: a compute scale and a call overhead for forwards and for backwards, and
  the memory bandwidth of its optimizer update (rule 8u);
- per link class that the observed plans send over: latency and bandwidth of a send;
- per link class that the observed plans all-reduce over: latency and bandwidth of a ring
  round (rule 8r);
- per model observed: a compute scale of all its layers (rule 1c's ``model_scale``);
- one step overhead.

It minimises, with :func:`scipy.optimize.least_squares` (bounded, trust-region), the
relative errors of every observation's batch time, of every stage's forward and backward
per call and of every replicated stage's all-reduce, and every stage's update (of at least
:data:`UPDATE_FLOOR_S`) error as a share of its plan's batch time (what it costs the
prediction: a 1 ms update missed by half matters less than a 100 ms one missed by a tenth;
on ``bench.fidelity``'s saved runs of 2026-11-27 this gave held-out medians of 8.0% and 6.1%
against 9.8% and 5.5% with relative update errors, and 11.0% and 6.0% blind to the
updates), all from
:func:`core.costmodel.simulate` on the calibrated cluster, so the fit is judged by the model
the planners use, schedule, bubbles and sends included. The per-stage terms pin the
per-type compute (many rows, well posed), the ring rounds (measured apart from the
compute, whose errors would otherwise leak into them) and the updates; the batch times
pin what only a whole step shows (sends, the driver's overhead). A type or a link class that no
observation uses keeps its spec values.

:func:`errors` gives each observation's batch-time error under a cluster, to compare a fit
with the uncalibrated spec on plans the fit did not see; :func:`fit_folds` fits once per
held-out split (:mod:`core.held_out`) and :func:`held_out_errors` judges each fit on the
observations it left out. Only :mod:`core`, numpy and scipy are imported: no torch, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from pipeplan.core import rules
from pipeplan.core.calibration import LINK_CLASSES, MAX_SCALE, MIN_SCALE, Calibration, CallOverhead
from pipeplan.core.cluster import ClusterSpec, device_id
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PlanError
from pipeplan.core.held_out import Fold, median_abs, relative_error
from pipeplan.core.observations import Observation
from pipeplan.core.plan import Plan, Schedule, Stage, uniform_stages
from pipeplan.core.profile import ModelProfile

STAGE_WEIGHT = 0.5
"""Weight of a stage's per-call residuals beside a batch time's (1)."""
PRIOR_WEIGHT = 0.001
"""Weight of the pull towards the uncalibrated spec (scale 1, no overheads, the spec's
links): a scale off by 0.5, or 10 ms of overhead, costs as much as a 0.1% error. It keeps
a fit of few runs from spending terms the runs do not pin (a ridge prior)."""
RING_LATENCY_PRIOR_MS = 0.1
"""Prior scale of a ring round's latency (ms), a hundred times firmer than the other
latencies': a 1 ms move costs as much as a 1% error. The runs of real plans all-reduce tens
to hundreds of MB, which pins a round's bandwidth and leaves its latency free to trade
against the step overhead (fitted alone it fell to zero and the small all-reduces of held-out
plans came out 15% short); the spec's latency is a measured one (``bench.links`` times the
rounds on chunks of 4 MB up)."""
MODEL_SCALE_PRIOR = 0.5
"""Prior scale of a model's compute scale (as a type's): a factor off by 0.5 costs as much as
a 0.1% error, so a model whose runs pin it (several plans, each stage's forward and
backward) gets its factor, and one seen in a single run stays near 1."""
UPDATE_FLOOR_S = 1e-3
"""Measured updates shorter than this (a few MB of weights) are timer noise, not fitted."""
UPDATE_RANGE = (1000.0, 10.0)
"""A fitted update bandwidth stays within (spec / 1000, spec x 10): a step slower than a
thousandth of the memory's speed, or faster than ten times it, is a fit gone wrong, not a
machine. Unbounded, one of ``bench.fidelity``'s held-out fits sent the slow type's bandwidth
to 14 TB/s: where a type's updates are a small share of the batch time they pin it
weakly, and the batch times pulled it."""
MS, MB = 1e-3, 1e6


@dataclass(frozen=True)
class Fit:
    """A fitted calibration and how well it matches the observations it was fitted to."""

    calibration: Calibration
    errors_before: tuple[float, ...]
    errors_after: tuple[float, ...]
    evaluations: int


class _Terms:
    """The fitted parameters as one vector, in units near 1 (ms, ms per MB).

    Per type: the forward and backward call overheads, the update's memory bandwidth (as ms
    per GB, for a type some observation measured an update on), and the compute scale only
    for a type some observed profile has no timing for (rule 1's FLOP fallback): a type
    timed on this cluster is already measured, and a scale fitted to it learns the load of
    the moment instead (in ``bench.fidelity``, fitting it made held-out plans worse). Per link class
    the observations send over: a send's latency and inverse bandwidth; per link class a
    replicated stage of theirs all-reduces over: a ring round's. Then the step overhead.

    Per model observed (:attr:`~core.profile.ModelProfile.model_key`): a compute scale of
    its layers on every type (after the types' scales). Unlike a type's, it is fitted where
    the layers are timed: it learns what that model's runs took over its profile -- a GPT
    of millisecond operations runs further from its profile than the convolutional nets do
    on the same devices, and a profile is one moment of a machine whose speed drifts --
    without moving any other model's predictions. ``bench.fidelity --reanalyse`` on the
    saved runs gives the held-out errors with and without it (README).
    """

    def __init__(
        self, cluster: ClusterSpec, observations: Sequence[Observation], per_model: bool = True
    ) -> None:
        used = {cluster.device(d).type for o in observations for d in o.plan.devices}
        self.types = sorted(used)
        self.scaled = [t for t in self.types if _untimed(t, observations)]
        self.models = sorted({o.profile.model_key for o in observations}) if per_model else []
        self.updated = [t for t in self.types if _updates_on(cluster, observations, t)]
        self.sends = [k for k in LINK_CLASSES if _sends_over(cluster, observations, k)]
        self.rings = [k for k in LINK_CLASSES if _reduces_over(cluster, observations, k)]
        net = cluster.links
        rows: list[tuple[float, float, float, float]] = []  # start, lo, hi, prior scale
        rows += [(1.0, MIN_SCALE, MAX_SCALE, 0.5)] * len(self.scaled)
        rows += [(1.0, MIN_SCALE, MAX_SCALE, MODEL_SCALE_PRIOR)] * len(self.models)
        rows += [(0.0, 0.0, 1e4, 10.0)] * (2 * len(self.types))  # fwd, bwd overhead (ms)
        for t in self.updated:  # ms per GB of rule 8's update (prior scale 0: on a log scale)
            per_gb = 1.0 / cluster.memory_bandwidth_gbps(t) / MS
            rows += [(per_gb, per_gb / UPDATE_RANGE[1], per_gb * UPDATE_RANGE[0], 0.0)]
        # per link: latency (ms), ms per MB (prior scale 0: on a log scale)
        for k in self.sends:
            link = getattr(net, k)
            rows += [(link.latency_s / MS, 0.0, 1e4, 10.0)]
            rows += [(MB / link.bytes_per_s / MS, 1e-6, 1e4, 0.0)]
        for k in self.rings:
            link = getattr(net, k)
            rows += [(link.ring_latency_s / MS, 0.0, 1e4, RING_LATENCY_PRIOR_MS)]
            rows += [(MB / link.ring_bytes_per_s / MS, 1e-6, 1e4, 0.0)]
        rows.append((0.0, 0.0, 1e5, 10.0))  # step overhead (ms)
        start, lo, hi, scale = (np.array(c) for c in zip(*rows, strict=True))
        self.start = np.clip(start, lo, hi)
        self.bounds = (lo, hi)
        self.prior, self.prior_scale = self.start.copy(), scale

    def prior_residuals(self, x: np.ndarray) -> np.ndarray:
        """Deviation from the uncalibrated spec; bandwidth on a log scale, a factor of 10
        counting like 10 ms."""
        out = np.empty_like(x)
        lin = self.prior_scale > 0
        out[lin] = (x[lin] - self.prior[lin]) / self.prior_scale[lin]
        out[~lin] = np.log10(x[~lin] / self.prior[~lin])
        return PRIOR_WEIGHT * out

    def calibration(self, x: np.ndarray, fit: dict[str, Any] | None = None) -> Calibration:
        n, M, T = len(self.scaled), len(self.models), len(self.types)
        K, U = len(self.sends), len(self.updated)
        scales, models = x[:n], x[n : n + M]
        calls = x[n + M : n + M + 2 * T].reshape(-1, 2)
        per_gb = x[n + M + 2 * T : n + M + 2 * T + U]
        links = x[n + M + 2 * T + U : -1].reshape(-1, 2)

        def fitted(names: list[str], rows: np.ndarray) -> dict[str, tuple[float, float]]:
            """(bandwidth_gbps, latency_us) of each link class from (latency ms, ms per MB)."""
            return {
                name: (_gbps(MB / (v[1] * MS)), float(v[0] * MS / rules.US))
                for name, v in zip(names, rows, strict=True)
            }

        return Calibration(
            compute_scale={t: float(v) for t, v in zip(self.scaled, scales, strict=True)},
            call_overhead={
                t: CallOverhead(float(v[0]) * MS, float(v[1]) * MS)
                for t, v in zip(self.types, calls, strict=True)
            },
            network=fitted(self.sends, links[:K]),
            all_reduce=fitted(self.rings, links[K:]),
            step_overhead_s=float(x[-1]) * MS,
            fit=fit or {},
            memory_bandwidth_gbps={
                t: float(1.0 / (v * MS)) for t, v in zip(self.updated, per_gb, strict=True)
            },
            model_scale={m: float(v) for m, v in zip(self.models, models, strict=True)},
        )


def _untimed(device_type: str, observations: Sequence[Observation]) -> bool:
    """Whether some observed profile costs a layer on ``device_type`` by its FLOPs."""
    return any(device_type not in layer.timings for o in observations for layer in o.profile.layers)


def _updates_on(cluster: ClusterSpec, observations: Sequence[Observation], name: str) -> bool:
    """Whether a device of type ``name`` is a replica of some observed stage whose measured
    update the fit reads (which type sets that update, rule 8's slowest replica, depends on
    the bandwidths being fitted, so every type of the stage gets one)."""
    return any(
        update >= UPDATE_FLOOR_S and any(cluster.device(d).type == name for d in stage.devices)
        for o in observations
        for stage, update in zip(o.plan.stages, o.update_s, strict=False)
    )


def _gbps(bytes_per_s: float) -> float:
    return float(bytes_per_s * rules.BITS_PER_BYTE / rules.GB)


def _crosses(cluster: ClusterSpec, devices: Sequence[str], link: str) -> bool:
    """Whether ``devices`` talk over link class ``link`` (inter-node when on several nodes)."""
    return (len({cluster.device(d).node for d in devices}) > 1) == (link == "inter_node")


def _sends_over(cluster: ClusterSpec, observations: Sequence[Observation], link: str) -> bool:
    """Whether any observed plan sends between two stages over this link class."""
    return any(
        _crosses(cluster, (*a.devices, *b.devices), link)
        for o in observations
        for a, b in zip(o.plan.stages, o.plan.stages[1:], strict=False)
    )


def _reduces_over(cluster: ClusterSpec, observations: Sequence[Observation], link: str) -> bool:
    """Whether any observed plan all-reduces a replicated stage over this link class."""
    return any(
        s.replicas > 1 and _crosses(cluster, s.devices, link)
        for o in observations
        for s in o.plan.stages
    )


def _residuals(cluster: ClusterSpec, observations: Sequence[Observation]) -> np.ndarray:
    out: list[float] = []
    for o in observations:
        est = simulate(o.plan, o.profile, cluster)
        out.append(relative_error(est.batch_time_s, o.batch_time_s))
        for st, f, b in zip(est.stages, o.forward_s, o.backward_s, strict=True):
            if f > 0:
                out.append(STAGE_WEIGHT * relative_error(st.forward_s, f))
            if b > 0:
                out.append(STAGE_WEIGHT * relative_error(st.backward_s, b))
        for st, ring in zip(est.stages, o.allreduce_s, strict=False):
            if ring > 0 and st.allreduce_s > 0:
                out.append(STAGE_WEIGHT * relative_error(st.allreduce_s, ring))
        for st, update in zip(est.stages, o.update_s, strict=False):
            if update >= UPDATE_FLOOR_S:
                out.append(STAGE_WEIGHT * (st.update_s - update) / o.batch_time_s)
    return np.array(out)


def errors(cluster: ClusterSpec, observations: Sequence[Observation]) -> tuple[float, ...]:
    """Each observation's batch-time error ``(predicted - measured) / measured`` on ``cluster``."""
    return tuple(
        relative_error(simulate(o.plan, o.profile, cluster).batch_time_s, o.batch_time_s)
        for o in observations
    )


def fit(
    cluster: ClusterSpec,
    observations: Sequence[Observation],
    record: dict[str, Any] | None = None,
    per_model: bool = True,
) -> Fit:
    """The calibration of ``cluster`` (its uncalibrated spec is the start) that best explains
    ``observations``; ``record`` goes into the calibration's ``fit`` block. ``per_model``:
    fit each observed model's compute scale (``False``: the types' terms alone, the
    ablation ``bench.fidelity`` reports)."""
    if not observations:
        raise PlanError("calibrate: no measured runs to fit")
    for i, o in enumerate(observations):
        if not (o.batch_time_s > 0 and math.isfinite(o.batch_time_s)):
            raise PlanError(f"observations[{i}].batch_time_s: must be > 0, got {o.batch_time_s!r}")
        o.plan.validate(o.profile, cluster)
    base = cluster.calibrated(None)
    terms = _Terms(base, observations, per_model)
    result = least_squares(
        lambda x: np.concatenate(
            [
                _residuals(base.calibrated(terms.calibration(x)), observations),
                terms.prior_residuals(x),
            ]
        ),
        terms.start,
        bounds=terms.bounds,
        x_scale="jac",
        diff_step=1e-2,
        ftol=1e-12,
        xtol=1e-12,
        gtol=1e-12,
        max_nfev=400,
    )
    before = errors(base, observations)
    calibration = terms.calibration(result.x)
    after = errors(base.calibrated(calibration), observations)
    summary = dict(record or {})
    summary.update(
        runs=len(observations),
        fitted_median_abs_error_before=median_abs(before),
        fitted_median_abs_error_after=median_abs(after),
    )
    return Fit(terms.calibration(result.x, summary), before, after, int(result.nfev))


def fit_folds(
    cluster: ClusterSpec,
    rows: Sequence[Sequence[Observation]],
    folds: Sequence[Fold],
    per_model: bool = True,
    records: Sequence[dict[str, Any]] | None = None,
) -> list[Calibration | None]:
    """Per fold (:mod:`core.held_out`), the calibration fitted to the runs of its ``train``
    rows (a row: the runs of one plan), None where they have none; ``records[i]`` goes into
    fold ``i``'s ``fit`` block, ``per_model`` as in :func:`fit`."""
    out: list[Calibration | None] = []
    for i, fold in enumerate(folds):
        seen = [o for j in fold.train for o in rows[j]]
        record = records[i] if records is not None else None
        out.append(fit(cluster, seen, record, per_model).calibration if seen else None)
    return out


def held_out_errors(
    cluster: ClusterSpec, observations: Sequence[Observation], folds: Sequence[Fold]
) -> tuple[list[float], list[float]]:
    """Each held-out observation's batch-time error before (``cluster`` as given) and after
    (the calibration fitted without it), in the folds' order; a fold with nothing to fit
    judges nothing."""
    before: list[float] = []
    after: list[float] = []
    fits = fit_folds(cluster, [(o,) for o in observations], folds)
    for fold, calibration in zip(folds, fits, strict=True):
        if calibration is None:
            continue
        test = [observations[i] for i in fold.test]
        before += errors(cluster, test)
        after += errors(cluster.calibrated(calibration), test)
    return before, after


def probe_plans(cluster: ClusterSpec, profile: ModelProfile, batch: int) -> list[Plan]:
    """Plans that exercise every term of a calibration, in an order where alternate plans
    cover every kind (so even positions can fit and odd ones be held out):

    - each device type alone, at the whole batch and at a quarter of it (compute, calls);
    - each pair of types on two nodes, two equal-layer GPipe stages (the inter-node link);
    - one device of each type on distinct nodes as a 1F1B pipeline (bubbles, both links);
    - a node's devices of one type as replicas of one stage, and as two stages (all-reduce,
      the intra-node link);
    - every device as replicas of one stage (TAPP's BSP).

    Microbatches that do not divide the batch are left out; plans are distinct.
    """
    quarter = max(1, batch // 4)
    one = _one_per_type(cluster)
    L = len(profile)
    out: list[Plan] = []

    def add(stages: list[tuple[tuple[int, int], tuple[str, ...], int]], schedule: Schedule) -> None:
        if any(batch % b for _, _, b in stages) or any(b < len(d) for _, d, b in stages):
            return
        plan = Plan(batch, tuple(Stage(r, d, b) for r, d, b in stages), schedule)
        if plan not in out:
            out.append(plan)

    for device in one.values():
        add([((0, L), (device,), batch)], Schedule.GPIPE)
        add([((0, L), (device,), quarter)], Schedule.GPIPE)
    types = sorted(one, key=lambda t: -cluster.device_types[t].flops)
    for i, a in enumerate(types):
        for b in types[i + 1 :]:
            if cluster.device(one[a]).node != cluster.device(one[b]).node and L >= 2:
                cuts = uniform_stages(L, 2)
                add([(cuts[0], (one[a],), quarter), (cuts[1], (one[b],), quarter)], Schedule.GPIPE)
    chain = _distinct_nodes([one[t] for t in types], cluster)
    if len(chain) >= 3 and len(chain) <= L:
        cuts = uniform_stages(L, len(chain))
        add([(c, (d,), quarter) for c, d in zip(cuts, chain, strict=True)], Schedule.ONE_F_ONE_B)
    for node in cluster.nodes:
        for t, count in node.devices.items():
            if count >= 2:
                pair = (device_id(node.name, t, 0), device_id(node.name, t, 1))
                add([((0, L), pair, batch)], Schedule.GPIPE)
                if L >= 2:
                    cuts = uniform_stages(L, 2)
                    add(
                        [(cuts[0], pair[:1], quarter), (cuts[1], pair[1:], quarter)],
                        Schedule.GPIPE,
                    )
    add([((0, L), cluster.device_ids, batch)], Schedule.GPIPE)
    return out


def _one_per_type(cluster: ClusterSpec) -> dict[str, str]:
    """The first device of each type, in the cluster's order."""
    out: dict[str, str] = {}
    for d in cluster.device_ids:
        out.setdefault(cluster.device(d).type, d)
    return out


def _distinct_nodes(devices: Sequence[str], cluster: ClusterSpec) -> list[str]:
    seen: set[str] = set()
    out = []
    for d in devices:
        node = cluster.device(d).node
        if node not in seen:
            seen.add(node)
            out.append(d)
    return out
