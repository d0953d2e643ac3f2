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

**Why** ``dp`` **re-plans.** The planner a job started with may take minutes (a measured
search, PPO); the re-plan is on the critical path of a stalled job. ``dp`` is exact for the
steady-state bottleneck on heterogeneous devices and answers in well under a second on
clusters of a few nodes, with the job's objective, schedule and batch
(:class:`PlannerReplanner`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from pipeplan.agents.problem import Budget, InfeasibleError, Objective, Problem
from pipeplan.agents.registry import make_planner
from pipeplan.core.cluster import ClusterSpec, parse_device_id
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan, Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.executor import checkpoint
from pipeplan.executor.config import TrainConfig
from pipeplan.executor.errors import ExecutorError, ExecutorTimeoutError, StageFailedError
from pipeplan.executor.live_cluster import LiveNode, discover, live_nodes
from pipeplan.executor.model import ModelSource
from pipeplan.executor.train import CheckpointHook, StepHook, TrainResult, TrainStep, train

Reason = Literal["node_lost", "actor_lost", "node_joined"]

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
            f"{lost} lost: resuming step {self.step} on a {stages}-stage plan{predicted}; "
            f"{self.steps_redone} step(s) to train again"
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
        )
        found = make_planner(self.planner, **self.options).plan(problem)
        return found.plan, found.estimate.batch_time_s

    def predict(self, plan: Plan, cluster: ClusterSpec) -> float:
        return simulate(plan, self._profile(), cluster).batch_time_s

    def shortfall(self, cluster: ClusterSpec) -> str:
        need = 4 * sum(layer.params_bytes for layer in self._profile().layers)
        have = sum(cluster.device_type(d).memory_gb * 1e9 for d in cluster.device_ids)
        if need <= have:
            return ""
        return (
            f"the model's weights, gradients and optimizer state need {need / 1e9:.3g} GB, "
            f"the devices left hold {have / 1e9:.3g} GB ({(need - have) / 1e9:.3g} GB missing)"
        )


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
        run.segment = []
        try:
            result = train(
                run.plan,
                model,
                run.spec,
                run.config,
                on_step=lambda s: _stepped(run, s, on_step),
                on_checkpoint=lambda t, p: _checkpointed(run, t, p, on_checkpoint),
                on_started=lambda s: setattr(run, "startup_s", s),
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
    if gone:
        reason: Reason = "node_lost"
        try:
            spec = live_spec(reference)
        except PipeplanError as e:
            raise ElasticError(
                f"node(s) {', '.join(gone)} lost at step {trained}: no devices are left ({e})"
            ) from error
        try:
            new_plan, predicted = replanner.plan(spec)
        except InfeasibleError as e:
            missing = replanner.shortfall(spec) or str(e)
            left = ", ".join(f"{n.name} {dict(n.devices)}" for n in spec.nodes)
            raise ElasticError(
                f"node(s) {', '.join(gone)} lost at step {trained}: what is left ({left}) "
                f"cannot hold the model: {missing}"
            ) from error
        run.plan, run.spec, run.predicted = new_plan, spec, predicted
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
        candidate, predicted = replanner.plan(spec)
        old = replanner.predict(run.plan, spec)
    except PipeplanError:
        run.spec = spec  # nothing to plan with: leave this join be
        return False
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
    )
    run.replans.append(event)
    if on_replan is not None:
        on_replan(event)
    run.spec = spec
    if decision.switch:
        run.plan, run.predicted = candidate, predicted
        run.config = replace(run.config, resume=run.checkpoint)
    return decision.switch
