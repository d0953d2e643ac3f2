"""Elastic training: a lost node re-plans and resumes; a joined node is put to use.

:func:`elastic_train` runs :func:`executor.train.train` in segments, one per plan.

**A node lost.** A lost node ends the segment within seconds with a
:class:`~executor.errors.StageFailedError` naming the replica whose actor died (or an
:class:`~executor.errors.ExecutorTimeoutError` when a collective hangs past the run's
timeout). Such a failure is told apart from the model's own errors (a worker's exception,
which comes back unchanged) by the live cluster: the loop waits up to
:attr:`ElasticConfig.notice_s` for Ray to stop listing a node of the plan. If one is gone,
the devices left (:func:`live_spec`) are planned again (:class:`Replanner`), and training
resumes the last checkpoint under the new plan, up to the same total steps: the steps
trained after that checkpoint are trained again (``steps_redone``). An actor that died on a
node that is still there resumes under the same plan; a timeout with every node there ends
the run as before. If what is left cannot hold the
model, :class:`ElasticError` names the lost nodes, what is left and what is missing.

**A node joined.** After each checkpoint the loop reads the live cluster. When it holds
devices the current plan's cluster had not, it plans on all of them and switches when the
net gain clears the threshold (:func:`decide`): the predicted gain ``1 - new / old`` (the
cost model's step times), less the switch cost as a share of the remaining training,
``cost / (remaining steps x measured step time)``. The switch cost is measured: the
segment's start (deploy + restore) plus one checkpoint save where the segment restored
nothing. A switch stops the segment at that checkpoint and resumes it on the new plan.
Either way the decision is reported (``on_replan``).

**Why the weights equal an uninterrupted run's.** A resumed segment loads the weights and
the optimizer state re-sharded by parameter name (:mod:`executor.checkpoint`) and seeks the
data streams to the checkpoint's position; the model is built from its seed, so a restart
before any checkpoint starts from the same weights. Pipelined training computes the same
update as single-process training whatever the plan, so with dropout off
(``deterministic``) the final weights are the same to rounding.

**Why** ``dp`` **re-plans, and what it is weighed against.** The planner a job started with
may take minutes (a measured search, PPO); the re-plan is on the critical path of a stalled
job. ``dp`` is exact for the steady-state bottleneck on heterogeneous devices and answers in
well under a second on clusters of a few nodes, with the job's objective, schedule and batch
(:class:`PlannerReplanner`). But it is exact for the profile, and a profile can be far from
the cluster's real speeds; so ``dp``'s plan is one of two candidates (:func:`choose`), the
other being the current plan folded onto the devices there (:func:`fold_plan`: its cuts and
microbatches kept, the lost devices dropped, a stage left empty merged into its neighbour;
after a join, the current plan itself). Both are predicted on the profile corrected by what
this run measured: the segment's stage compute times (forward plus backward of the busiest
replica, its steps' median, the first left out) over the cost model's for the same plan give
one speed factor per device type (:func:`speed_factors`: the median over the stages on that
type alone), and every layer time of that type is scaled by it (:func:`corrected_profile`);
``dp`` plans again on that profile. The lower predicted step time wins (a tie: ``dp``'s);
the event records which (``chosen``) and both predictions. A loss before any step was
measured compares them on the profile as it is. After a join the same comparison sets the
decision's predicted gain, so a ``dp`` plan that does not beat the current one there is
never switched to.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from pipeplan.agents.problem import Budget, InfeasibleError, Objective, Problem
from pipeplan.agents.registry import make_planner
from pipeplan.core.cluster import ClusterSpec, parse_device_id
from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerTiming, ModelProfile
from pipeplan.core.tables import layer_costs
from pipeplan.executor import checkpoint
from pipeplan.executor.config import TrainConfig
from pipeplan.executor.errors import ExecutorError, ExecutorTimeoutError, StageFailedError
from pipeplan.executor.live_cluster import LiveNode, discover, live_nodes
from pipeplan.executor.measure import StepResult, summarise
from pipeplan.executor.model import ModelSource
from pipeplan.executor.train import CheckpointHook, StepHook, TrainResult, TrainStep, train

Reason = Literal["node_lost", "actor_lost", "node_joined"]
Candidate = Literal["dp", "folded"]

REPLAN_PLANNER = "dp"
"""The planner of a re-plan (module docstring)."""


class ElasticError(ExecutorError):
    """Training cannot go on after a loss: what is left cannot hold the model, or the
    re-plans ran out."""


@dataclass(frozen=True)
class ElasticConfig:
    """How elastic training reacts to nodes that go and come."""

    replan_threshold: float = 0.10
    """Switch to a plan on joined devices when its net gain (:func:`decide`) is above this."""
    watch_joins: bool = True
    """Read the live cluster after each checkpoint for joined devices."""
    max_replans: int = 8
    """Most re-plans after losses in one run; one more loss ends it."""
    notice_s: float = 30.0
    """Longest wait after a failure for Ray to stop listing a lost node."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.replan_threshold <= 1.0:
            raise PipeplanError(
                f"replan_threshold: must be in [0, 1], got {self.replan_threshold!r}"
            )
        if self.max_replans < 0:
            raise PipeplanError(f"max_replans: must be >= 0, got {self.max_replans}")
        if not self.notice_s > 0:
            raise PipeplanError(f"notice_s: must be > 0, got {self.notice_s!r}")


@dataclass(frozen=True)
class Decision:
    """Whether to switch to a plan on joined devices, and the figures behind it."""

    gain: float
    """Predicted: ``1 - new step time / old step time``."""
    switch_cost_s: float
    remaining_s: float
    """The remaining steps at the measured step time (under the current plan)."""
    net_gain: float
    """``gain - switch_cost_s / remaining_s``."""
    threshold: float
    switch: bool


def decide(
    old_step_s: float,
    new_step_s: float,
    measured_step_s: float,
    remaining_steps: int,
    switch_cost_s: float,
    threshold: float,
) -> Decision:
    """Switch when the predicted gain, less the switch cost's share of the remaining
    training, is above ``threshold`` (module docstring)."""
    gain = 1.0 - new_step_s / old_step_s if old_step_s > 0 else 0.0
    remaining_s = remaining_steps * measured_step_s
    cost_share = switch_cost_s / remaining_s if remaining_s > 0 else float("inf")
    net = gain - cost_share
    return Decision(gain, switch_cost_s, remaining_s, net, threshold, net > threshold)


@dataclass(frozen=True)
class Replanned:
    """One re-plan: after a loss (always switched), or after a join (switched or not)."""

    reason: Reason
    step: int
    """The step training goes on from (the resumed checkpoint's)."""
    nodes: tuple[str, ...]
    """The nodes lost, or joined."""
    plan: Plan
    """The plan training goes on with (after a join that did not switch: the candidate)."""
    predicted_step_s: float | None
    previous_plan: Plan
    previous_predicted_step_s: float | None
    switched: bool
    steps_redone: int = 0
    """Steps trained after the resumed checkpoint, lost with the failure."""
    noticed_s: float = 0.0
    """From the failure to Ray confirming the loss."""
    replan_s: float = 0.0
    """The planner's time."""
    decision: Decision | None = None
    cause: str = ""
    chosen: Candidate | None = None
    """The candidate with the lower predicted step time (:func:`choose`): ``dp``'s plan or
    the current plan folded onto the devices there; None when nothing was planned (an
    actor lost)."""
    dp_predicted_step_s: float | None = None
    """``dp``'s plan's step time on the corrected profile."""
    folded_predicted_step_s: float | None = None
    """The folded plan's step time on the corrected profile; None when it does not fit."""
    speed_factors: Mapping[str, float] = field(default_factory=dict)
    """Measured over predicted compute per device type, the correction the predictions
    used (empty: nothing measured, the profile as it is)."""

    def text(self) -> str:
        """One line for people."""
        nodes = ", ".join(self.nodes) or "none"
        stages = len(self.plan.stages)
        predicted = (
            f", predicted step {self.predicted_step_s:.3f} s"
            if self.predicted_step_s is not None
            else ""
        )
        if self.reason == "node_joined":
            d = self.decision
            why = f" (net gain {d.net_gain:+.2f}, threshold {d.threshold:.2f})" if d else ""
            verb = "switching to" if self.switched else "keeping the plan over"
            return f"node(s) {nodes} joined: {verb} a {stages}-stage plan{predicted}{why}"
        lost = "an actor" if self.reason == "actor_lost" else f"node(s) {nodes}"
        return (
            f"{lost} lost: resuming step {self.step} on a {stages}-stage plan{predicted}"
            f"{self._candidates()}; {self.steps_redone} step(s) to train again"
        )

    def _candidates(self) -> str:
        if self.chosen is None:
            return ""

        def s(x: float | None) -> str:
            return "does not fit" if x is None else f"{x:.3f} s"

        return (
            f" ({self.chosen} chosen: dp {s(self.dp_predicted_step_s)}, "
            f"folded {s(self.folded_predicted_step_s)})"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "reason": self.reason,
            "step": self.step,
            "nodes": list(self.nodes),
            "plan": self.plan.to_dict(),
            "predicted_step_s": self.predicted_step_s,
            "previous_plan": self.previous_plan.to_dict(),
            "previous_predicted_step_s": self.previous_predicted_step_s,
            "switched": self.switched,
            "steps_redone": self.steps_redone,
            "noticed_s": round(self.noticed_s, 3),
            "replan_s": round(self.replan_s, 3),
            "cause": self.cause,
            "chosen": self.chosen,
            "dp_predicted_step_s": self.dp_predicted_step_s,
            "folded_predicted_step_s": self.folded_predicted_step_s,
            "speed_factors": dict(self.speed_factors),
        }
        if self.decision is not None:
            d = self.decision
            out.update(
                gain=d.gain,
                net_gain=d.net_gain,
                switch_cost_s=round(d.switch_cost_s, 3),
                threshold=d.threshold,
            )
        return out


ReplanHook = Callable[[Replanned], None]


class Replanner(Protocol):
    """Plans the job's problem again on another cluster, and predicts a plan's step time."""

    def plan(self, cluster: ClusterSpec) -> tuple[Plan, float]:
        """The plan for ``cluster`` and its predicted step time; raises
        :class:`~agents.problem.InfeasibleError` when none fits."""
        ...

    def predict(self, plan: Plan, cluster: ClusterSpec) -> float:
        """The step time the cost model predicts for ``plan`` on ``cluster``."""
        ...

    def shortfall(self, cluster: ClusterSpec) -> str:
        """What ``cluster`` lacks to hold the model, in words ('' when it is not memory)."""
        ...

    def estimate(self, plan: Plan, cluster: ClusterSpec) -> Estimate:
        """The cost model's prediction for ``plan`` on ``cluster``, stage by stage."""
        ...

    def corrected(
        self, factors: Mapping[str, float], cluster: ClusterSpec, microbatches: int | None = None
    ) -> Replanner:
        """This replanner with every compute time on a type of ``factors`` times its factor
        (``cluster`` describes the types), planning with ``microbatches`` microbatches when
        given (:func:`measured_microbatches`)."""
        ...


@dataclass
class PlannerReplanner:
    """A :class:`Replanner` with one of the project's planners (default ``dp``) on the
    job's objective, batch and schedule. ``profile``: the model's profile, or a function
    that takes it (called once, when first needed: a job with a plan document may never
    need one)."""

    profile: ModelProfile | Callable[[], ModelProfile]
    objective: Objective
    global_batch: int
    schedule: Schedule
    seed: int = 0
    min_throughput: float | None = None
    planner: str = REPLAN_PLANNER
    options: dict[str, Any] = field(default_factory=dict)
    budget: Budget = field(default_factory=lambda: Budget(evaluations=20_000, seconds=10.0))
    microbatches: int | None = None
    """A fixed microbatch count for the planner (None: it chooses)."""

    def _profile(self) -> ModelProfile:
        if not isinstance(self.profile, ModelProfile):
            self.profile = self.profile()
        return self.profile

    def plan(self, cluster: ClusterSpec) -> tuple[Plan, float]:
        problem = Problem(
            profile=self._profile(),
            cluster=cluster,
            objective=self.objective,
            global_batch=self.global_batch,
            schedule=self.schedule,
            min_throughput=self.min_throughput,
            seed=self.seed,
            budget=self.budget,
            microbatches=self.microbatches,
        )
        found = make_planner(self.planner, **self.options).plan(problem)
        return found.plan, found.estimate.batch_time_s

    def predict(self, plan: Plan, cluster: ClusterSpec) -> float:
        return self.estimate(plan, cluster).batch_time_s

    def estimate(self, plan: Plan, cluster: ClusterSpec) -> Estimate:
        return simulate(plan, self._profile(), cluster)

    def corrected(
        self, factors: Mapping[str, float], cluster: ClusterSpec, microbatches: int | None = None
    ) -> PlannerReplanner:
        profile = corrected_profile(self._profile(), cluster, factors)
        return replace(self, profile=profile, microbatches=microbatches)

    def shortfall(self, cluster: ClusterSpec) -> str:
        need = 4 * sum(layer.params_bytes for layer in self._profile().layers)
        have = sum(cluster.device_type(d).memory_gb * 1e9 for d in cluster.device_ids)
        if need <= have:
            return ""
        return (
            f"the model's weights, gradients and optimizer state need {need / 1e9:.3g} GB, "
            f"the devices left hold {have / 1e9:.3g} GB ({(need - have) / 1e9:.3g} GB missing)"
        )


def fold_plan(plan: Plan, left: ClusterSpec | Collection[str]) -> Plan:
    """``plan`` on the devices ``left`` (a cluster, or device ids): its cuts and
    microbatches kept, the devices ``left`` lacks dropped from their stages, and a stage
    left without devices merged into its neighbour (the one before it; the first stage into
    the next one kept). Raises :class:`ElasticError` naming the plan's devices when none of
    them is left."""
    there = set(left.device_ids if isinstance(left, ClusterSpec) else left)
    stages: list[Stage] = []
    pending: int | None = None  # first layer of emptied stages before the first kept one
    for stage in plan.stages:
        devices = tuple(d for d in stage.devices if d in there)
        if not devices:
            if stages:
                last = stages[-1]
                stages[-1] = replace(last, layers=(last.layers[0], stage.layers[1]))
            elif pending is None:
                pending = stage.layers[0]
            continue
        start = stage.layers[0] if pending is None else pending
        pending = None
        stages.append(replace(stage, layers=(start, stage.layers[1]), devices=devices))
    if not stages:
        raise ElasticError(
            f"fold_plan: none of the plan's devices ({', '.join(plan.devices)}) is left; "
            f"the cluster has {', '.join(sorted(there)) or 'no devices'}"
        )
    return replace(plan, stages=tuple(stages))


def stage_compute_s(plan: Plan, result: StepResult) -> tuple[float, ...]:
    """Each stage's forward plus backward compute in one step (its busiest replica), as
    :func:`executor.measure.summarise` reads it from the step's records."""
    measured = summarise(plan, [result], 0, emulated=False, placement=())
    return tuple(st.compute_s for st in measured.stages)


def speed_factors(
    plan: Plan, measured: Sequence[float], estimate: Estimate, cluster: ClusterSpec
) -> dict[str, float]:
    """Per device type: the median over ``plan``'s stages on that type alone of measured
    over predicted compute per step (``measured``: a time per stage, as
    :func:`stage_compute_s`; ``estimate``: the cost model's for ``plan``). A stage on
    several types, or with a time of 0, says nothing; a type no stage says anything of is
    left out (factor 1)."""
    if len(measured) != len(plan.stages) or len(estimate.stages) != len(plan.stages):
        raise PipeplanError(
            f"measured: {len(measured)} stage times and {len(estimate.stages)} predicted for "
            f"a plan of {len(plan.stages)} stages"
        )
    ratios: dict[str, list[float]] = {}
    for stage, got, want in zip(plan.stages, measured, estimate.stages, strict=True):
        types = {cluster.device(d).type for d in stage.devices}
        if len(types) == 1 and got > 0 and want.compute_s > 0:
            ratios.setdefault(types.pop(), []).append(got / want.compute_s)
    return {t: statistics.median(xs) for t, xs in sorted(ratios.items())}


def corrected_profile(
    profile: ModelProfile, cluster: ClusterSpec, factors: Mapping[str, float]
) -> ModelProfile:
    """``profile`` with the layer timings of each type of ``factors`` times its factor: the
    cost model's rule 1 times (measured timings, or the FLOP estimate where the profile has
    none, :func:`core.tables.layer_costs`) written as that type's timings."""
    for t, f in sorted(factors.items()):
        if t not in cluster.device_types:
            raise PipeplanError(f"speed_factors: {t!r} is not a device type of {cluster.name}")
        if not f > 0:
            raise PipeplanError(f"speed_factors.{t}: must be > 0, got {f!r}")
        c = layer_costs(profile, cluster.device_types[t], scale=f)
        timings = [
            LayerTiming(float(fwd), float(bwd), float(fwd_fixed), float(bwd_fixed))
            for fwd, bwd, fwd_fixed, bwd_fixed in zip(
                c.fwd_per_sample, c.bwd_per_sample, c.fwd_fixed, c.bwd_fixed, strict=True
            )
        ]
        profile = profile.with_timings(t, timings)
    return profile


@dataclass(frozen=True)
class Choice:
    """The plan to go on with after a loss or a join, and the figures behind it."""

    plan: Plan
    predicted_s: float
    chosen: Candidate
    dp_plan: Plan
    dp_s: float
    folded_s: float | None
    """None when the folded plan does not fit (or nothing of it is left)."""
    factors: dict[str, float]


def measured_microbatches(plan: Plan) -> int | None:
    """The microbatch count a corrected re-plan keeps: ``plan``'s, when its stages share one
    microbatch size. A speed factor is measured at that size only; per call a stage also pays
    a fixed overhead that one factor per type cannot tell from compute, so at smaller
    microbatches (more calls) the corrected profile would promise steps the run does not
    make. None (the planner chooses) when the stages' sizes differ."""
    sizes = {st.microbatch for st in plan.stages}
    return plan.global_batch // sizes.pop() if len(sizes) == 1 else None


def choose(
    replanner: Replanner,
    current: Plan,
    cluster: ClusterSpec,
    measured: Sequence[float] | None = None,
    measured_on: ClusterSpec | None = None,
) -> Choice:
    """``dp``'s plan on ``cluster`` or ``current`` folded onto it (:func:`fold_plan`),
    whichever has the lower predicted step time on the profile corrected by ``measured``
    (``current``'s stage compute times on ``measured_on``, :func:`speed_factors`), ``dp``
    then keeping ``current``'s microbatch count (:func:`measured_microbatches`); without
    them, on the profile as it is. A tie keeps ``dp``'s. Raises
    :class:`~agents.problem.InfeasibleError` when ``dp`` finds no plan."""
    factors: dict[str, float] = {}
    if measured:
        on = measured_on or cluster
        try:
            fitted = speed_factors(current, measured, replanner.estimate(current, on), on)
        except PipeplanError:  # a plan the profile does not describe: no correction
            fitted = {}
        factors = {t: f for t, f in fitted.items() if t in cluster.device_types}
    fixed = measured_microbatches(current)
    planner = replanner.corrected(factors, cluster, fixed) if factors else replanner
    dp_plan, dp_s = planner.plan(cluster)
    folded_s: float | None = None
    folded = current
    try:
        folded = fold_plan(current, cluster)
        est = planner.estimate(folded, cluster)
        folded_s = est.batch_time_s if est.fits else None
    except (PipeplanError, ElasticError):
        folded_s = None
    if folded_s is not None and folded_s < dp_s:
        return Choice(folded, folded_s, "folded", dp_plan, dp_s, folded_s, factors)
    return Choice(dp_plan, dp_s, "dp", dp_plan, dp_s, folded_s, factors)


def live_spec(reference: ClusterSpec) -> ClusterSpec:
    """The connected cluster as a spec: its live nodes and devices, with ``reference``'s
    device types (their speeds set the emulation), network and emulation headroom; a type
    ``reference`` does not know is described as :func:`executor.live_cluster.discover` does."""
    found = discover(reference)
    types = {**found.device_types, **reference.device_types}
    return replace(reference, device_types=types, nodes=found.nodes)


def nodes_of(plan: Plan) -> set[str]:
    return {parse_device_id(d)[0] for d in plan.devices}


def added_devices(before: ClusterSpec, now: Sequence[LiveNode]) -> tuple[str, ...]:
    """The nodes of ``now`` with devices ``before`` had not (a new node, or more devices)."""
    had = {n.name: n.devices for n in before.nodes}
    return tuple(
        n.name for n in now if any(c > had.get(n.name, {}).get(t, 0) for t, c in n.devices.items())
    )


def wait_for_loss(
    used: set[str], known: set[str], notice_s: float
) -> tuple[tuple[str, ...], float]:
    """Once a node of ``used`` is no longer alive (waiting up to ``notice_s`` for Ray to
    say so), the nodes of ``known`` that are gone; and the seconds waited."""
    started = time.monotonic()
    while True:
        alive = {n.name for n in live_nodes()}
        waited = time.monotonic() - started
        if used - alive or waited >= notice_s:
            return tuple(sorted(known - alive)) if used - alive else (), waited
        time.sleep(0.5)


def may_be_a_loss(error: ExecutorError) -> bool:
    """A failure a lost node or actor causes: an actor that died, a timeout, or a peer
    that went away; not a worker's own exception (a model or data error)."""
    if isinstance(error, ExecutorTimeoutError):
        return True
    if isinstance(error, StageFailedError):
        text = f"{error.cause}\n{error.traceback}"
        return "died" in error.cause or any(
            s in text for s in ("timed out", "Timed out", "Connection closed", "reset by peer")
        )
    return False


@dataclass(frozen=True)
class ElasticResult:
    """What an elastic run did: its steps (the last time each was trained), the plans it
    ran, and every re-plan."""

    result: TrainResult
    plans: tuple[Plan, ...]
    replans: tuple[Replanned, ...]
    cluster: ClusterSpec
    """The spec the last plan ran on."""

    @property
    def plan(self) -> Plan:
        return self.plans[-1]


@dataclass
class _Run:
    """The loop's state: the plan, its cluster, what was trained and checkpointed."""

    plan: Plan
    spec: ClusterSpec
    predicted: float | None
    """The plan's predicted step time, once known (the profile may be made on demand)."""
    config: TrainConfig
    steps: dict[int, TrainStep] = field(default_factory=dict)
    segment: list[TrainStep] = field(default_factory=list)
    stage_times: list[tuple[float, ...]] = field(default_factory=list)
    """The segment's stage compute times, step by step (:func:`stage_compute_s`)."""
    checkpoint: Path | None = None
    """The checkpoint a failure resumes: the last written, else the one resumed first."""
    checkpoint_step: int = 0
    written: Path | None = None
    startup_s: float = 0.0
    save_s: float = 0.0
    last_step_at: float = 0.0
    plans: list[Plan] = field(default_factory=list)
    replans: list[Replanned] = field(default_factory=list)


def elastic_train(
    plan: Plan,
    model: ModelSource,
    cluster: ClusterSpec,
    config: TrainConfig,
    replanner: Replanner,
    elastic: ElasticConfig | None = None,
    on_step: StepHook | None = None,
    on_checkpoint: CheckpointHook | None = None,
    on_replan: ReplanHook | None = None,
) -> ElasticResult:
    """Train ``plan`` to ``config.steps`` steps, re-planning after losses and joins
    (module docstring). ``cluster``: the spec the cluster was started from (its device
    types' speeds); the live cluster says which of its nodes are there."""
    elastic = elastic or ElasticConfig()
    spec = live_spec(cluster)
    first = _first_step(config)
    run = _Run(plan, spec, None, config, checkpoint_step=first)  # predicted when needed
    run.checkpoint = checkpoint.resolve(config.resume) if config.resume is not None else None
    losses = 0
    while True:
        run.plans.append(run.plan)
        run.segment, run.stage_times = [], []
        try:
            result = train(
                run.plan,
                model,
                run.spec,
                run.config,
                on_step=lambda s: _stepped(run, s, on_step),
                on_checkpoint=lambda t, p: _checkpointed(run, t, p, on_checkpoint),
                on_started=lambda s: setattr(run, "startup_s", s),
                on_result=lambda r: run.stage_times.append(stage_compute_s(run.plan, r)),
                stop_after_checkpoint=lambda t, p: _joined(run, t, replanner, elastic, on_replan),
            )
        except ExecutorError as e:
            if not may_be_a_loss(e):
                raise
            losses += 1
            if losses > elastic.max_replans:
                raise ElasticError(
                    f"max_replans: {elastic.max_replans} re-plans after losses, then another "
                    f"failure: {str(e).splitlines()[0]}"
                ) from e
            _after_loss(run, e, cluster, replanner, elastic, on_replan)
            continue
        if not result.stopped:
            break
    merged = TrainResult(
        tuple(run.steps[t] for t in sorted(run.steps)),
        first,
        run.written,
        config.resume,
        result.startup_s,
    )
    return ElasticResult(merged, tuple(run.plans), tuple(run.replans), run.spec)


def _first_step(config: TrainConfig) -> int:
    if config.resume is None:
        return 0
    return checkpoint.read_manifest(checkpoint.resolve(config.resume)).step


def _predict(replanner: Replanner, plan: Plan, spec: ClusterSpec) -> float | None:
    try:
        return replanner.predict(plan, spec)
    except PipeplanError:  # a plan the profile does not describe: no prediction
        return None


def measured_stage_s(stage_times: Sequence[Sequence[float]]) -> tuple[float, ...] | None:
    """Each stage's median compute time over a segment's steps, its first step (warm-up)
    left out when there are more; None before any step."""
    rows = list(stage_times[1:] if len(stage_times) > 1 else stage_times)
    if not rows:
        return None
    return tuple(statistics.median(col) for col in zip(*rows, strict=True))


def _stepped(run: _Run, step: TrainStep, hook: StepHook | None) -> None:
    run.steps[step.step] = step
    run.segment.append(step)
    run.last_step_at = time.perf_counter()
    if hook is not None:
        hook(step)


def _checkpointed(run: _Run, step: int, path: Path, hook: CheckpointHook | None) -> None:
    run.save_s = time.perf_counter() - run.last_step_at
    run.checkpoint, run.checkpoint_step, run.written = path, step, path
    if hook is not None:
        hook(step, path)


def _after_loss(
    run: _Run,
    error: ExecutorError,
    reference: ClusterSpec,
    replanner: Replanner,
    elastic: ElasticConfig,
    on_replan: ReplanHook | None,
) -> None:
    """Re-plan on what is left (or keep the plan when only an actor died), and point the
    run at its last checkpoint."""
    known = {n.name for n in run.spec.nodes}
    gone, waited = wait_for_loss(nodes_of(run.plan), known, elastic.notice_s)
    if not gone and not (isinstance(error, StageFailedError) and "died" in error.cause):
        raise error  # a timeout with every node there: not a loss
    trained = max(run.steps, default=run.checkpoint_step - 1) + 1
    redone = max(0, trained - run.checkpoint_step)
    cause = str(error).splitlines()[0]
    previous = run.plan
    previous_predicted = run.predicted
    if previous_predicted is None:
        previous_predicted = run.predicted = _predict(replanner, previous, run.spec)
    t0 = time.perf_counter()
    choice: Choice | None = None
    if gone:
        reason: Reason = "node_lost"
        try:
            spec = live_spec(reference)
        except PipeplanError as e:
            raise ElasticError(
                f"node(s) {', '.join(gone)} lost at step {trained}: no devices are left ({e})"
            ) from error
        try:
            choice = choose(replanner, run.plan, spec, measured_stage_s(run.stage_times), run.spec)
        except InfeasibleError as e:
            missing = replanner.shortfall(spec) or str(e)
            left = ", ".join(f"{n.name} {dict(n.devices)}" for n in spec.nodes)
            raise ElasticError(
                f"node(s) {', '.join(gone)} lost at step {trained}: what is left ({left}) "
                f"cannot hold the model: {missing}"
            ) from error
        run.plan, run.spec, run.predicted = choice.plan, spec, choice.predicted_s
    else:
        reason = "actor_lost"
    for t in [t for t in run.steps if t >= run.checkpoint_step]:
        del run.steps[t]
    run.config = replace(run.config, resume=run.checkpoint)
    event = Replanned(
        reason=reason,
        step=run.checkpoint_step,
        nodes=gone,
        plan=run.plan,
        predicted_step_s=run.predicted,
        previous_plan=previous,
        previous_predicted_step_s=previous_predicted,
        switched=run.plan != previous,
        steps_redone=redone,
        noticed_s=waited,
        replan_s=time.perf_counter() - t0,
        cause=cause,
        chosen=choice.chosen if choice else None,
        dp_predicted_step_s=choice.dp_s if choice else None,
        folded_predicted_step_s=choice.folded_s if choice else None,
        speed_factors=choice.factors if choice else {},
    )
    run.replans.append(event)
    if on_replan is not None:
        on_replan(event)


def _joined(
    run: _Run,
    step: int,
    replanner: Replanner,
    elastic: ElasticConfig,
    on_replan: ReplanHook | None,
) -> bool:
    """After the checkpoint of ``step``: when devices joined, plan on all and decide
    whether to switch (module docstring); True stops the segment to switch."""
    if not elastic.watch_joins:
        return False
    joined = added_devices(run.spec, live_nodes())
    if not joined:
        return False
    t0 = time.perf_counter()
    spec = live_spec(run.spec)
    try:
        # The folded current plan is the current plan itself: every device is still there.
        choice = choose(replanner, run.plan, spec, measured_stage_s(run.stage_times), run.spec)
    except PipeplanError:
        run.spec = spec  # nothing to plan with: leave this join be
        return False
    if choice.folded_s is None:  # the current plan on the corrected profile, fitting or not
        fixed = measured_microbatches(run.plan)
        planner = replanner.corrected(choice.factors, spec, fixed) if choice.factors else replanner
        try:
            old = planner.predict(run.plan, spec)
        except PipeplanError:
            run.spec = spec
            return False
    else:
        old = choice.folded_s
    candidate, predicted = choice.dp_plan, choice.dp_s
    planned_s = time.perf_counter() - t0
    measured = statistics.median(s.batch_time_s for s in run.segment) if run.segment else old
    cost = run.startup_s + (0.0 if run.config.resume is not None else run.save_s)
    decision = decide(
        old, predicted, measured, run.config.steps - step, cost, elastic.replan_threshold
    )
    event = Replanned(
        reason="node_joined",
        step=step,
        nodes=joined,
        plan=candidate,
        predicted_step_s=predicted,
        previous_plan=run.plan,
        previous_predicted_step_s=old,
        switched=decision.switch,
        replan_s=planned_s,
        decision=decision,
        chosen=choice.chosen,
        dp_predicted_step_s=choice.dp_s,
        folded_predicted_step_s=choice.folded_s,
        speed_factors=choice.factors,
    )
    run.replans.append(event)
    if on_replan is not None:
        on_replan(event)
    run.spec = spec
    if decision.switch:
        run.plan, run.predicted = candidate, predicted
        run.config = replace(run.config, resume=run.checkpoint)
    return decision.switch
