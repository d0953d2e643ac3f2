"""The driver: deploy a plan as stage actors, train with GPipe or 1F1B, measure.

:class:`Pipeline` owns the actors (a context manager: they are killed on exit, whatever
happened). Before any actor starts it refuses a plan the live cluster cannot run
(:func:`executor.pinning.check_feasible`: a device type or node it lacks, too many
devices; a device of a CUDA type on a node where Ray counts too few GPUs,
:func:`executor.accelerators.check_nodes`) or the model cannot be cut at
(:func:`executor.partition.partition`). Then one :class:`~executor.stage.StageWorker` per
stage replica is pinned to its device's node and type (and one GPU for a CUDA type: the
stage computes there, :mod:`executor.stage`), and its placement is checked.

:meth:`Pipeline.start` then forms the run's ``torch.distributed`` process group
(:mod:`executor.transport`): stage 0's first replica opens the TCP store on its node, and
every replica joins with its rank, in plan order (gloo; ``cpu:gloo,cuda:nccl`` when a stage
is on CUDA). The group has the run's timeout, so a receive whose sender died ends.

:meth:`Pipeline.step` trains one global batch: one call per stage replica
(:func:`executor.submit.submit_step`); the replicas send activations and gradients to each
other peer to peer and all-reduce a replicated stage's gradients over the stage's subgroup
(:mod:`executor.stage`). :func:`executor.waiting.wait_all` waits for every replica with a
deadline; a worker's exception or a dead actor or node ends the step with one
:class:`~executor.errors.StageFailedError` naming the stage, device and node, and kills the
run's actors (their neighbours would otherwise wait on the process group until its timeout).

Every step's batch time, samples per second and transfer times go to Ray's metrics
(:mod:`executor.metrics`); they change nothing the step returns.

:func:`run` trains a few warm-up and measured steps and returns a
:class:`~executor.measure.Measurement`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import ray
import torch

from pipeplan.core.cluster import ClusterSpec, parse_device_id
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan
from pipeplan.core.schedules import microbatch_count
from pipeplan.executor import metrics, shared_sum
from pipeplan.executor.accelerators import accelerator_of, accelerators, check_nodes
from pipeplan.executor.config import RunConfig as RunConfig
from pipeplan.executor.config import check_engine as check_engine
from pipeplan.executor.data import digits_batches, synthetic_batches
from pipeplan.executor.emulation import device_slowdowns
from pipeplan.executor.errors import ExecutorError, StageFailedError
from pipeplan.executor.live_cluster import LiveNode, live_nodes
from pipeplan.executor.measure import Measurement, Placement, StepResult, summarise, transfers
from pipeplan.executor.microbatch import Layout
from pipeplan.executor.model import Batch, ModelSource
from pipeplan.executor.partition import partition
from pipeplan.executor.pinning import actor_options, check_feasible, check_shares
from pipeplan.executor.reservation import Reservation, claim
from pipeplan.executor.stage import Feed, StageWorker, StepOutput, WorkerSpec
from pipeplan.executor.submit import Ref, WorkerHandle, submit_step
from pipeplan.executor.transport import GroupSpec, backend_for
from pipeplan.executor.waiting import lost_peer, wait_all

_Actor = ray.remote(StageWorker)


def _layout(plan: Plan) -> Layout:
    return Layout.of(plan.global_batch, [(s.microbatch, s.replicas) for s in plan.stages])


class Pipeline:
    """A plan deployed on the connected Ray cluster; a context manager owning its actors.

    ``cluster`` is the spec the plan was made for: its device types' flops set the emulated
    slowdowns (the live cluster itself only has to hold the plan's devices).
    """

    def __init__(
        self,
        plan: Plan,
        model: ModelSource,
        cluster: ClusterSpec,
        config: RunConfig | None = None,
        feed: Feed | None = None,
    ) -> None:
        self.plan, self.model, self.cluster = plan, model, cluster
        self.config = config or RunConfig()
        self.feed = feed
        """Set for training: the first and last stages read the batches themselves."""
        check_shares(plan)  # before the layout, which cannot share a microbatch otherwise
        self.layout = _layout(plan)
        self.workers: list[list[WorkerHandle]] = []
        self._step = 0
        self.input_name = ""
        self.reservation: Reservation | None = None
        """The devices' placement group while the pipeline is started."""
        self.failure: StageFailedError | None = None
        """The error that ended the run (its actors are gone): every later call raises it."""

    # --- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Pipeline:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Check the plan, start every stage replica on its node, wait until all are built."""
        nodes = live_nodes()
        check_feasible(self.plan, nodes)
        check_nodes(accelerators(self.cluster), self.plan.devices, nodes)
        slowdowns = self._slowdowns()
        self.input_name = self._check_model(self.model, self.plan)
        try:
            self.reservation = self._reserve(nodes)
            for row in self._specs(slowdowns):
                self.workers.append([self._launch(spec, nodes) for spec in row])
            refs = {w.actor.ready.remote(): w for w in self.all_workers()}
            self._await_ready(refs, {n.name: n.node_id for n in nodes})
            self._form_group()
        except BaseException:
            self.close()
            raise

    def _form_group(self) -> None:
        """Every replica joins the run's process group (module docstring)."""
        workers = self.all_workers()
        timeout = self.config.timeout_s
        deadline = time.monotonic() + self.config.start_timeout_s
        first = workers[0]
        ref = first.actor.open_store.remote(len(workers), timeout)
        address, port = wait_all({ref: first}, workers, deadline, "process group")[ref]
        ranks, rank = [], 0
        for row in self.workers:
            ranks.append(tuple(range(rank, rank + len(row))))
            rank += len(row)
        backend = backend_for([w.spec.accelerator for w in workers])
        nodes = tuple(w.spec.node for w in workers)
        shared = shared_sum.enabled()
        joins = {
            w.actor.join_group.remote(
                GroupSpec(address, port, r, tuple(ranks), backend, timeout, nodes, shared)
            ): w
            for r, w in enumerate(workers)
        }
        wait_all(joins, workers, deadline, "process group")

    def reconfigure(
        self, plan: Plan, config: RunConfig | None = None, model: ModelSource | None = None
    ) -> None:
        """Run another plan with the same stages (layers and devices) on the same actors:
        other microbatches, schedule, batch size, optimizer or emulation, or a model of the
        same architecture (another seed or dtype). Every worker starts over with fresh
        weights, as a new pipeline would, without new processes."""
        if [(s.layers, s.devices) for s in plan.stages] != [
            (s.layers, s.devices) for s in self.plan.stages
        ]:
            raise PlanError(
                "reconfigure: the plan must keep every stage's layers and devices; "
                "start a new Pipeline for another partition or placement"
            )
        self._require_started()
        nodes = live_nodes()
        check_feasible(plan, nodes)
        check_nodes(accelerators(self.cluster), plan.devices, nodes)
        self.input_name = self._check_model(model or self.model, plan)
        self.plan, self.layout = plan, _layout(plan)
        self.config = config or self.config
        self.model = model or self.model
        refs = {}
        for row, specs in zip(self.workers, self._specs(self._slowdowns()), strict=True):
            for w, spec in zip(row, specs, strict=True):
                w.spec = spec
                refs[w.actor.reset.remote(spec)] = w
        self._await_ready(refs, {n.name: n.node_id for n in live_nodes()})

    def close(self) -> None:
        """Kill every actor of this pipeline, then give its devices back (idempotent)."""
        for w in self.all_workers():
            with contextlib.suppress(Exception):  # already dead, or the cluster is gone
                ray.kill(w.actor, no_restart=True)
        self.workers = []
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def all_workers(self) -> list[WorkerHandle]:
        return [w for row in self.workers for w in row]

    def _require_started(self) -> None:
        if self.failure is not None:  # the run ended on it: say so again
            raise self.failure
        if not self.workers:
            raise ExecutorError("pipeline: not started (use it as a context manager)")

    def _check_model(self, model: ModelSource, plan: Plan) -> str:
        """Cut the model once here, so a bad cut (or a plan the engine cannot run) is
        refused before any actor is touched; returns the name of its input."""
        built, example = model.build()
        cut = partition(built, example, (0, *(s.end for s in plan.stages)))
        if len(cut.model_inputs) != 1:
            raise PlanError(f"model {model.name!r}: the executor feeds exactly one input")
        check_engine(plan, self.cluster, self.config, cut.meta)
        return cut.model_inputs[0]

    def _launch(self, spec: WorkerSpec, nodes: Sequence[LiveNode]) -> WorkerHandle:
        options = actor_options(spec.device, nodes, spec.accelerator)
        if self.reservation is not None:
            options.update(self.reservation.options(spec.device))
        return WorkerHandle(spec, _Actor.options(**options).remote(spec))

    def _specs(self, slowdowns: dict[str, float]) -> list[list[WorkerSpec]]:
        bounds = (0, *(s.end for s in self.plan.stages))
        shape = tuple((s.microbatch, s.replicas) for s in self.plan.stages)
        kinds = tuple(
            tuple(accelerator_of(self.cluster, parse_device_id(d)[1]) for d in s.devices)
            for s in self.plan.stages
        )
        return [
            [
                WorkerSpec(
                    stage=s,
                    replica=k,
                    device=device,
                    node=parse_device_id(device)[0],
                    bounds=bounds,
                    global_batch=self.plan.global_batch,
                    model=self.model,
                    optimizer=self.config.optimizer,
                    slowdown=slowdowns[device] if self.config.emulate else 1.0,
                    deterministic=self.config.deterministic,
                    accelerator=accelerator_of(self.cluster, parse_device_id(device)[1]),
                    microbatches=microbatch_count(self.plan.global_batch, stage.microbatch),
                    replicas=len(stage.devices),
                    shape=shape,
                    schedule=self.plan.schedule,
                    accelerators=kinds,
                    timeout_s=self.config.timeout_s,
                    engine=self.config.engine,
                    feed=self.feed,
                    recompute=stage.recompute,
                )
                for k, device in enumerate(stage.devices)
            ]
            for s, stage in enumerate(self.plan.stages)
        ]

    def _slowdowns(self) -> dict[str, float]:
        return device_slowdowns(self.cluster, self.plan.devices)

    def _reserve(self, nodes: Sequence[LiveNode]) -> Reservation:
        """The plan's devices as one placement group (:mod:`executor.reservation`), for this
        process's claimant: waits while others hold them, as long as the claimant says."""
        devices = list(self.plan.devices)
        kinds = [accelerator_of(self.cluster, parse_device_id(d)[1]) for d in devices]
        return claim(devices, nodes, kinds)

    def _await_ready(self, refs: dict[Ref, WorkerHandle], node_ids: dict[str, str]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        infos = wait_all(refs, self.all_workers(), deadline, "start")
        for ref, w in refs.items():
            w.info = infos[ref]
            if w.info.node_id != node_ids[w.spec.node]:
                raise ExecutorError(
                    f"{w.where()}: placed on Ray node {w.info.node_id}, not on node "
                    f"{w.spec.node!r} ({node_ids[w.spec.node]})"
                )

    @property
    def placement(self) -> tuple[Placement, ...]:
        return tuple(
            Placement(
                w.spec.stage,
                w.spec.replica,
                w.spec.device,
                w.spec.node,
                w.info.node_id if w.info else "",
                w.info.pid if w.info else 0,
            )
            for w in self.all_workers()
        )

    @property
    def emulated(self) -> bool:
        return any(w.spec.slowdown != 1.0 for w in self.all_workers())

    # --- training ---------------------------------------------------------------------------

    def step(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> StepResult:
        """Train one global batch ``(x, y)``; returns its time, loss, accuracy and records.
        Without a batch the first and last stages read the next one from their data stream
        (a pipeline with a ``feed``)."""
        self._require_started()
        batch = self.plan.global_batch
        if x is None or y is None:
            if self.feed is None:
                raise ExecutorError("pipeline: step() without a batch needs a data feed")
            x_ref = y_ref = None
        else:
            if x.shape[0] != batch or y.shape[0] != batch:
                raise PlanError(
                    f"batch: expected {batch} samples (plan.global_batch), got inputs "
                    f"{tuple(x.shape)} and labels {tuple(y.shape)}"
                )
            x_ref = ray.put({self.input_name: x.detach().numpy()})
            y_ref = ray.put(y.detach().numpy())
        t, self._step = self._step, self._step + 1
        start, t0 = time.time(), time.perf_counter()
        refs = submit_step(self.workers, t, x_ref, y_ref)
        deadline = time.monotonic() + self.config.timeout_s
        try:
            outputs: list[StepOutput] = list(
                wait_all(refs, self.all_workers(), deadline, f"step {t}").values()
            )
        except StageFailedError as e:
            # A neighbour of a lost node or killed actor fails first (its socket closes):
            # name the replica that died, once Ray says which.
            cause = lost_peer(e, refs, self.all_workers(), f"step {t}") or e
            self.failure = cause
            self.close()  # the others may wait on the process group until its timeout
            if cause is e:
                raise
            raise cause from e
        except BaseException:
            self.close()
            raise
        batch_time = time.perf_counter() - t0
        terms = [o.loss for o in outputs if o.loss is not None]
        records = [r for o in outputs for r in o.records]
        predictions = sum(m["predictions"] for m in terms)
        result = StepResult(
            step=t,
            start=start,
            batch_time_s=batch_time,
            loss=sum(m["loss_sum"] for m in terms) / predictions,
            accuracy=sum(m["correct"] for m in terms) / predictions,
            records=tuple(records),
        )
        self._publish(result)
        return result

    def _publish(self, result: StepResult) -> None:
        """The step's batch time, samples per second and every transfer time, in Ray's
        metrics (:mod:`executor.metrics`; the stage actors record their compute)."""
        if not metrics.enabled():
            return
        plan = self.plan
        metrics.training_step(
            self.model.name,
            self.cluster.name,
            plan.schedule.value,
            result.batch_time_s,
            plan.global_batch,
        )
        types = {
            (w.spec.stage, w.spec.replica): parse_device_id(w.spec.device)[1]
            for w in self.all_workers()
        }
        moved = transfers(self.layout, result.records, result.start)
        for (s, k, kind, _), seconds in moved.items():
            metrics.stage_transfer(s, types[(s, k)], kind, seconds)

    def measure(self, batches: Sequence[Batch], warmup: int) -> Measurement:
        """Train on every batch; the first ``warmup`` are left out of the batch time."""
        results = [self.step(x, y) for x, y in batches]
        return summarise(
            self.plan, results, warmup, emulated=self.emulated, placement=self.placement
        )

    # --- checkpoints ------------------------------------------------------------------------

    def _everyone(self, call: str, what: str, *args: object) -> None:
        """Call ``call`` on every replica at once (a collective) and wait for all."""
        self._require_started()
        workers = self.all_workers()
        refs = {getattr(w.actor, call).remote(*args): w for w in workers}
        try:
            wait_all(refs, workers, time.monotonic() + self.config.timeout_s, what)
        except BaseException:
            self.close()  # the others may wait on the collective until its timeout
            raise

    def save_checkpoint(self, folder: Path) -> None:
        """Every replica writes its part of one checkpoint into ``folder``
        (:mod:`executor.checkpoint`; the caller commits it)."""
        self._everyone("save_checkpoint", "checkpoint save", str(folder))

    def load_checkpoint(self, folder: Path, restore_rng: bool) -> None:
        """Every replica loads the entries it holds from checkpoint ``folder`` (weights,
        optimizer state; its random state too when ``restore_rng``)."""
        self._everyone("load_checkpoint", "checkpoint load", str(folder), restore_rng)

    def seek_data(self, position: int, step: int) -> None:
        """Resume the data streams at global batch ``position`` and count steps from ``step``."""
        self._everyone("seek_data", "data seek", position)
        self._step = step

    def stage_parameters(self, stage: int, replica: int = 0) -> dict[str, torch.Tensor]:
        """One stage replica's parameters, by the model's parameter names."""
        self._require_started()
        w = self.workers[stage][replica]
        ref = w.actor.parameters.remote()
        deadline = time.monotonic() + self.config.timeout_s
        arrays: dict[str, np.ndarray] = wait_all({ref: w}, [w], deadline, "parameters")[ref]
        return {n: torch.from_numpy(np.array(a)) for n, a in arrays.items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, by its name, from replica 0 of each stage."""
        out: dict[str, torch.Tensor] = {}
        for s in range(len(self.workers)):
            out.update(self.stage_parameters(s))
        return out


def make_batches(
    model: ModelSource, global_batch: int, count: int, config: RunConfig
) -> list[Batch]:
    """Batches for :func:`run`: digits shaped for the model, or synthetic ones."""
    built, example = model.build()
    if config.data == "digits":
        return digits_batches(example, global_batch, count, seed=config.seed)
    built.eval()
    with torch.no_grad():
        output_shape = tuple(built(example).shape)
    return synthetic_batches(example, output_shape, global_batch, count, seed=config.seed)


def run(
    plan: Plan,
    model: ModelSource,
    cluster: ClusterSpec,
    config: RunConfig | None = None,
    batches: Sequence[Batch] | None = None,
) -> Measurement:
    """Deploy ``plan``, train ``warmup + steps`` batches, measure, clean up."""
    config = config or RunConfig()
    count = config.warmup + config.steps
    if batches is None:
        batches = make_batches(model, plan.global_batch, count, config)
    if len(batches) < count:
        raise PlanError(f"run: {count} batches needed (warmup + steps), got {len(batches)}")
    with Pipeline(plan, model, cluster, config) as pipe:
        return pipe.measure(batches[:count], config.warmup)
