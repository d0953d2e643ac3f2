"""``StageWorker``: one replica of one pipeline stage, run as a Ray actor.

The worker builds the model itself (zoo name and seed, so every worker has the same
weights), cuts it with :func:`executor.partition.partition` and keeps its own stage. Before
the first step every worker of a run joins the run's ``torch.distributed`` process group
(:mod:`executor.transport`): rank 0 opens the store (:meth:`StageWorker.open_store`), then
all join at once (:meth:`StageWorker.join_group`).

**One call per step.** The driver calls :meth:`StageWorker.run_step` once per step on every
worker; the worker runs its stage's operation order (``core.schedules.stage_orders``: GPipe
or 1F1B) by itself. A forward receives its samples' activations from the previous stage's
operations that hold them, peer to peer (``irecv``), computes, and sends each next-stage
operation the rows it needs (``isend``); a backward receives the gradients from the next
stage the same way and sends its inputs' gradients back. Unequal microbatches and replica
counts change only which rows go to whom (:class:`executor.microbatch.Layout`). After the
last backward a replicated stage sums its replicas' gradients with ``all_reduce`` over the
stage's subgroup -- through shared memory where its CPU replicas share a plan node and a
host (:mod:`executor.shared_sum`) -- then every worker steps its optimizer. The driver passes
the batch to the first stage (inputs) and the last (labels) through Ray's object store and
never touches an activation or a gradient.

**Records.** Every operation returns an :class:`OpRecord` (what it did, when): a forward's
or backward's ``start`` is the moment its inputs had arrived, its ``end`` the moment its
results were handed to the process group, so the gap between a sender's end and its
receiver's start is the transfer (:func:`executor.measure.transfers`). The all-reduce is one
``G`` record, the optimizer step a ``U``.

**Failures.** :meth:`StageWorker.run_step` never raises: it hands back a :class:`Failure`
with the traceback. Its neighbours then wait on a receive that never comes, until the
process group's timeout; the driver does not wait for them: it raises at the first failure
and kills every actor of the run.

**Recomputation.** A stage whose plan stage recomputes (``WorkerSpec.recompute``) runs its
forwards without autograd and keeps only their inputs; each backward first runs the
microbatch's forward again, from the same random state, then back-propagates through it
(:mod:`executor.recompute`). The backward's record includes that second forward.

**Metrics.** Each forward, backward and update is recorded in Ray's metrics as it ends
(:func:`executor.metrics.stage_compute`, tagged with the stage and its device type).

**Devices.** A stage of a CUDA type (:mod:`executor.accelerators`) computes on the GPU Ray
gave its actor: the worker checks it can use CUDA when it starts, moves its slice of the
model there, and its messages to another CUDA stage go from GPU memory over NCCL; with a CPU
neighbour they go through host memory over gloo (:func:`executor.transport.wire_device`). A
compute is timed after ``torch.cuda.synchronize`` on both sides, so that its record holds
the kernels' time, not the time to queue them.

**Emulation.** A device type ``k`` times slower than the fastest (``slowdown = k``) makes
each real forward and backward last ``k`` times the CPU time it took: the worker sleeps
after it (:func:`executor.emulation.emulation_sleep`). Only the device compute is slowed:
the stage's module (and the loss on the last stage) forward, and the autograd backward.
Packing and unpacking messages, and the leaves' clones, are the executor's host work, which
a slower accelerator would not slow down and the profile does not time; they count at their
real length. The optimizer update is not slowed: it is memory-bound, and the cost model
costs it by memory bandwidth (rule 8), which ``local-hetero`` gives every type alike. Nor is
the gradient accumulation, for the same reason (rule 2's accumulation term,
:mod:`core.costmodel`): a backward runs into fresh gradients, timed and slowed as the
profile times it, and then the worker adds the step's earlier gradients to them
(``earlier += new``, the sum autograd would have formed) at the real speed.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import ray
import torch

from pipeplan.core.cluster import parse_device_id
from pipeplan.core.plan import Schedule
from pipeplan.core.schedules import Op, stage_orders
from pipeplan.executor import buckets, checkpoint, metrics, recompute, transport
from pipeplan.executor.accelerators import local_device, synchronize
from pipeplan.executor.buckets import Buckets
from pipeplan.executor.data import BatchStream, DataSpec, open_stream
from pipeplan.executor.emulation import emulation_sleep
from pipeplan.executor.errors import StageFailedError
from pipeplan.executor.loss import CROSS_ENTROPY, LossSpec, load_loss
from pipeplan.executor.microbatch import Layout
from pipeplan.executor.model import ModelSource, OptimizerConfig, batch_loss, disable_dropout
from pipeplan.executor.partition import ValueMeta, fetch_attr, partition
from pipeplan.executor.payloads import Payload, concat_gradients, concat_inputs
from pipeplan.executor.shared_sum import ArenaLayout, SharedSum, open_shared_sum
from pipeplan.executor.torch_engine import Engine, StageModule, TorchStage
from pipeplan.executor.transport import GroupSpec, Link

OpKind = Literal["F", "B", "G", "U", "S"]
"""Forward, backward, all-reduce, update; ``S``: a whole step run by PyTorch's pipeline
schedule (:mod:`executor.torch_engine`), which times no single operation."""


@dataclass(frozen=True)
class Feed:
    """Where the first and last stages read their batches themselves (a training run): a
    data source reference (:mod:`executor.data`) and its seed. Each reading replica opens
    its own stream of the same source and seed, so all see the same global batches."""

    data: str = "synthetic"
    seed: int = 0
    loss: str = "cross-entropy"
    """The loss the last stage computes (:mod:`executor.loss`)."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one stage replica needs to build itself."""

    stage: int
    replica: int
    device: str
    node: str
    bounds: tuple[int, ...]
    """Layer boundaries of the whole plan: stage ``s`` holds ``[bounds[s], bounds[s+1])``."""
    global_batch: int
    model: ModelSource
    optimizer: OptimizerConfig
    slowdown: float = 1.0
    deterministic: bool = False
    """Disable dropout (for comparing with single-process training)."""
    accelerator: str | None = None
    """The device type's accelerator (``cuda``: the stage runs on a GPU; None: the CPU)."""
    microbatches: int = 1
    """Microbatches the stage runs per step (``ceil(B / b_s)``): with more than one its
    backwards accumulate gradients, which needs more heap (:func:`heap_reserve`)."""
    replicas: int = 1
    """Replicas of the stage: with more than one it all-reduces its gradients."""
    shape: tuple[tuple[int, int], ...] = ()
    """``(microbatch, replicas)`` of every stage of the plan: who sends this worker which
    rows (:class:`executor.microbatch.Layout`)."""
    schedule: Schedule = Schedule.GPIPE
    accelerators: tuple[tuple[str | None, ...], ...] = ()
    """The accelerator of every stage replica of the plan (where each message lives)."""
    timeout_s: float = 300.0
    """Longest wait for one message or collective (the process group's timeout)."""
    engine: Engine = "pipeplan"
    """Who runs the stage's operations: pipeplan's schedule runner, or PyTorch's pipeline
    schedules (:mod:`executor.torch_engine`)."""
    feed: Feed | None = None
    """Set on every worker of a training run: its seed seeds the worker's random state, and
    the first and last stages read the batches themselves (the driver passes none)."""
    recompute: bool = False
    """The stage recomputes its activations (:mod:`executor.recompute`)."""


@dataclass(frozen=True)
class OpRecord:
    """What one operation did."""

    stage: int
    replica: int
    kind: OpKind
    step: int
    microbatch: int
    start: float
    """Wall clock (``time.time()``) when its inputs had arrived and it began."""
    end: float
    compute_s: float
    """Real compute plus the emulation sleep."""
    emulated_s: float
    """The emulation sleep alone."""
    cpu_s: float = 0.0
    """CPU time (this thread's) of the device compute of a forward or backward (the
    emulation's base), of the whole operation otherwise."""


@dataclass(frozen=True)
class StepOutput:
    """What one worker hands back for a step: its records, and on the last stage the loss
    terms of its samples."""

    records: tuple[OpRecord, ...]
    loss: Payload | None


@dataclass(frozen=True)
class Failure:
    """A worker's error, handed back instead of raised."""

    stage: int
    replica: int
    device: str
    node: str
    operation: str
    traceback: str

    def error(self, what: str) -> StageFailedError:
        """The exception a driver raises for it; ``what``: what the driver was waiting for."""
        return StageFailedError(
            self.stage,
            self.replica,
            self.device,
            self.node,
            f"{what}: operation {self.operation} raised",
            self.traceback,
        )


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker runs, and the names of the values it receives and sends."""

    node_id: str
    pid: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Wiring:
    """Who a worker talks to: per operation of its stage (``(microbatch, replica)`` of its
    own), the messages it receives and sends, and the values each carries."""

    forward_in: Mapping[tuple[int, int], list[Link]]
    forward_out: Mapping[tuple[int, int], list[Link]]
    backward_in: Mapping[tuple[int, int], list[Link]]
    backward_out: Mapping[tuple[int, int], list[Link]]
    sent: tuple[str, ...]
    """Values its forward sends on (its outputs less the constants)."""
    received: tuple[str, ...]
    """Values its forward receives (its inputs less the constants)."""
    grads_in: tuple[str, ...]
    """Its outputs whose gradients come back (the floating ones)."""
    grads_out: tuple[str, ...]
    """Its inputs whose gradients it sends back."""

    @classmethod
    def of(
        cls,
        layout: Layout,
        stage: int,
        inputs: Sequence[str],
        outputs: Sequence[str],
        meta: Mapping[str, ValueMeta],
    ) -> Wiring:
        def sending(names: Sequence[str]) -> tuple[str, ...]:
            return tuple(n for n in names if meta[n].kind != "constant")

        def flowing(names: Sequence[str]) -> tuple[str, ...]:
            return tuple(n for n in names if meta[n].differentiable)

        last = stage == layout.num_stages - 1
        return cls(
            forward_in=layout.forward_links(stage) if stage > 0 else {},
            forward_out=layout.forward_sends(stage) if not last else {},
            backward_in=layout.backward_links(stage) if not last else {},
            backward_out=layout.backward_sends(stage) if stage > 0 else {},
            sent=sending(outputs),
            received=sending(inputs),
            grads_in=flowing(outputs),
            grads_out=flowing(inputs),
        )


class StageWorker:
    """One replica of one stage. Wrapped by :func:`ray.remote` in :mod:`executor.pipeline`."""

    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(1)
        self.group: GroupSpec | None = None
        self.subgroup: Any = None
        self.shared: SharedSum | None = None
        """The replicas' shared-memory sum, where they share a host (else gloo sums)."""
        self.store: Any = None
        self.socket: socket.socket | None = None
        self.torch_stage: TorchStage | None = None
        self._pending: list[tuple[Any, torch.Tensor]] = []
        """Sends under way (work, buffer): waited for at the end of the step."""
        self._saved: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self._replays: dict[int, recompute.Replay] = {}
        """A recomputing stage's inputs of each microbatch between forward and backward."""
        self._losses: dict[int, torch.Tensor] = {}
        self._posted: dict[tuple[str, int], list[Any]] = {}
        self._buckets: Buckets | None = None
        """The step's gradient sums under way (replicated stages)."""
        self._hooked = [0.0, 0.0]
        """Wall and CPU seconds the last backward's hooks took (not slowed by emulation)."""
        self._last_backward = -1
        """The microbatch of the step's last backward (its hooks start the all-reduce)."""
        self._build(spec)

    def _build(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device_type = parse_device_id(spec.device)[1]
        self.device = local_device(spec.accelerator, self.device_type, spec.node)
        model, example = spec.model.build()
        if spec.deterministic:
            disable_dropout(model)
        cut = partition(model, example, spec.bounds)  # on the CPU: it runs the model
        # In place: the stage's module holds the model's own parameter objects.
        model.to(self.device)
        self.graph = cut.stages[spec.stage]
        self.meta: Mapping[str, ValueMeta] = cut.meta
        self.last = spec.stage == len(cut.stages) - 1
        self.module = self.graph.module.to(self.device)
        self.module.train()
        self.attrs = {a: fetch_attr(model, t) for a, t in self.graph.attrs.items()}
        self.params: dict[str, torch.nn.Parameter] = {
            self.graph.param_names[n]: p for n, p in self.module.named_parameters()
        }
        for arg, target in self.graph.attrs.items():
            value = self.attrs[arg]
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                self.params[target] = value
        # The model's state_dict entries this stage holds (by the model's names): what a
        # checkpoint saves and loads (executor.checkpoint). The stage's module shares the
        # model's tensors, so they are told apart by identity.
        held = {id(t) for t in (*self.module.parameters(), *self.module.buffers())}
        held |= {id(v) for v in self.attrs.values() if isinstance(v, torch.Tensor)}
        self.state: dict[str, torch.Tensor] = {
            n: t for n, t in model.state_dict(keep_vars=True).items() if id(t) in held
        }
        self._bucket_layout = buckets.layout(self.params)
        # A stage of activations and pools alone has nothing to optimise.
        self.optimizer = spec.optimizer.make(self.params.values()) if self.params else None
        if self.device.type == "cpu":
            param_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
            touch_heap(
                heap_reserve(
                    param_bytes, spec.optimizer.state_buffers, spec.microbatches, spec.replicas
                )
            )
        shape = spec.shape or ((spec.global_batch, spec.replicas),)
        self.layout = Layout.of(spec.global_batch, list(shape))
        if spec.shape:
            self.wiring = Wiring.of(
                self.layout, spec.stage, self.graph.inputs, self.graph.outputs, self.meta
            )
            sizes = [b for b, _ in spec.shape]
            self.order: list[Op] = stage_orders(spec.schedule, sizes, spec.global_batch)[spec.stage]
            backwards = [j for kind, j in self.order if kind == "B"]
            self._last_backward = backwards[-1] if backwards else -1
        self.loss = load_loss(LossSpec.parse(spec.feed.loss if spec.feed else CROSS_ENTROPY))
        if spec.feed is not None:  # training: dropout masks reproducible run to run
            torch.manual_seed(rng_seed(spec.feed.seed, spec.stage, spec.replica))
        self.stream: BatchStream | None = None
        if spec.feed is not None and (spec.stage == 0 or self.last):
            output = cut.meta[cut.model_output]
            self.stream = open_stream(
                DataSpec.parse(spec.feed.data),
                example,
                (1, *output.shape),
                spec.global_batch,
                spec.feed.seed,
                class_targets=self.loss.spec.class_targets,
            )
        self.torch_stage = None
        if self.group is not None and spec.engine == "torch-pipelining":
            self._torch_stage()

    def _torch_stage(self) -> None:
        """PyTorch's stage and schedule over this worker's slice (the group must exist)."""
        spec = self.spec
        module = StageModule(self.graph, self.attrs, self.meta, self.last).to(self.device)
        self.torch_stage = TorchStage(
            module, spec.stage, len(spec.shape), self.device, spec.schedule, spec.microbatches
        )

    def reset(self, spec: WorkerSpec) -> WorkerInfo:
        """Start over with fresh weights (and possibly another batch size or slowdown), in the
        same process and process group: cheaper than a new actor when only microbatches or
        schedule change."""
        if spec.stage != self.spec.stage or spec.bounds != self.spec.bounds:
            raise ValueError(f"reset: stage {spec.stage} {spec.bounds} is not this worker's")
        self._build(spec)
        if self.shared is not None:  # the new model's gradients: another dtype or size
            self.shared = self.shared.for_params(ArenaLayout.of(self.params))
        return self.ready()

    def ready(self) -> WorkerInfo:
        return WorkerInfo(
            ray.get_runtime_context().get_node_id(),
            os.getpid(),
            self.graph.inputs,
            self.graph.outputs,
        )

    # --- the process group ------------------------------------------------------------------

    def open_store(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0 only: open the run's TCP store on this node's address; returns it."""
        self.socket = transport.listen(ray.util.get_node_ip_address())
        self.store = transport.open_store(self.socket, world_size, timeout_s)
        address, port = self.socket.getsockname()[:2]
        return str(address), int(port)

    def join_group(self, group: GroupSpec) -> int:
        """Join the run's process group (every worker at once); returns the rank."""
        self.subgroup = transport.join(group, self.store)
        self.group = group
        self.shared = None
        if self.subgroup is not None and self.device.type == "cpu" and group.shared_sum:
            row = group.ranks[self.spec.stage]
            node = group.nodes[group.rank] if group.nodes else ""
            name = f"pipeplan-{group.address}-{group.port}-s{self.spec.stage}"
            layout = ArenaLayout.of(self.params)
            self.shared = open_shared_sum(self.subgroup, row, group.rank, node, name, layout)
        if self.spec.engine == "torch-pipelining":
            self._torch_stage()
        return group.rank

    def leave_group(self) -> None:
        transport.leave()
        self.group = self.subgroup = self.store = self.shared = None
        if self.socket is not None:
            self.socket.close()
            self.socket = None

    # --- one step ---------------------------------------------------------------------------

    def run_step(
        self, step: int, inputs: Payload | None, labels: np.ndarray | None
    ) -> StepOutput | Failure:
        """Run this stage's operations of step ``step`` in its schedule's order, all-reduce
        (replicas), update. ``inputs``: the whole batch's model inputs (first stage);
        ``labels``: the whole batch's labels (last stage)."""
        operation = "step"
        try:
            if self.group is None:
                raise RuntimeError("run_step before join_group")
            losses: dict[str, Any] = {"loss_sum": 0.0, "predictions": 0, "correct": 0}
            if self.stream is not None and inputs is None and labels is None:
                operation = "reading data"
                inputs, labels = self._read_batch()
            if self.torch_stage is not None:
                return self._torch_step(step, inputs, labels, losses)
            records: list[OpRecord] = []
            self.begin_step()
            operation = "posting receives"
            self._prepost(step)
            for kind, j in self.order:
                operation = f"{kind}{j}"
                if kind == "F":
                    records.append(self._forward(step, j, inputs, labels, losses))
                else:
                    records.append(self._backward(step, j))
            operation = "G"
            if self.subgroup is not None:
                records.append(self._all_reduce(step))
            operation = "U"
            records.append(self._update(step))
            for work, _ in self._pending:
                work.wait()
            self._pending.clear()
            return StepOutput(tuple(records), losses if self.last else None)
        except Exception:
            return self._failure(operation)

    def _read_batch(self) -> tuple[Payload | None, np.ndarray | None]:
        """The stream's next global batch: the inputs for the first stage, the targets for
        the last."""
        assert self.stream is not None
        x, y = self.stream.next()
        inputs = {self.graph.inputs[0]: x.numpy()} if self.spec.stage == 0 else None
        return inputs, (y.numpy() if self.last else None)

    def seek_data(self, position: int) -> None | Failure:
        """Resume the data stream at global batch ``position`` (a checkpoint's)."""
        try:
            if self.stream is not None:
                self.stream.seek(position)
            return None
        except Exception:
            return self._failure("data seek")

    def begin_step(self) -> None:
        """Clear the per-step state: sends under way, saved activations, losses. (A driver
        calls :meth:`run_step`; a one-stage worker's operations may also be called one by
        one after this, as ``bench.idle_slowdown`` does to pause between them.)"""
        self._pending = []
        self._saved = {}
        self._replays = {}
        self._losses = {}
        self._posted = {}

    def _torch_step(
        self,
        step: int,
        inputs: Payload | None,
        labels: np.ndarray | None,
        losses: dict[str, Any],
    ) -> StepOutput:
        """One step on PyTorch's schedule: one ``S`` record for the forwards and backwards,
        then the update; the last stage's loss terms from the merged logits."""
        assert self.torch_stage is not None
        x = y = None
        if self.spec.stage == 0:
            if inputs is None:
                raise ValueError("the first stage's step needs the batch's inputs")
            x = torch.from_numpy(np.array(inputs[self.graph.inputs[0]])).to(self.device)
        if self.last:
            if labels is None:
                raise ValueError("the last stage's step needs the batch's labels")
            y = torch.from_numpy(np.array(labels)).to(self.device)
        clock = Clock.now()
        logits = self.torch_stage.step(x, y)
        synchronize(self.device)
        records = [self._record("S", step, -1, clock)]
        if logits is not None and y is not None:
            terms = self.loss.terms(logits, y)
            losses.update(
                loss_sum=float(terms.loss_sum),
                predictions=terms.predictions,
                correct=terms.correct,
            )
        records.append(self._update(step))
        return StepOutput(tuple(records), losses if self.last else None)

    def _rank(self, endpoint: tuple[int, int, int]) -> int:
        assert self.group is not None
        return self.group.ranks[endpoint[0]][endpoint[2]]

    def _post(self, link: Link, names: Sequence[str], step: int, j: int, backward: bool) -> Any:
        """Post the receive of ``link``'s message into operation ``j``."""
        metas = [self.meta[n] for n in names]
        device = transport.wire_device(self.device, self._accelerator(link.peer))
        size = transport.buffer_size(metas, link.rows, [True] * len(metas) if backward else None)
        message_tag = transport.tag(link.peer[1], j, backward, step)
        buffer = transport.recv_buffer(size, device)
        return transport.irecv(buffer, self._rank(link.peer), message_tag)

    def _prepost(self, step: int) -> None:
        """Post, before the step's first operation, every receive that travels in host
        memory (gloo), so a message is taken in while this stage still computes earlier
        operations. Receives between two GPUs are posted as their operation comes: NCCL runs
        a pair's operations in the order they were posted, and a gradient's receive posted
        ahead of this stage's own sends would wait for itself."""
        k = self.spec.replica
        for kind, j in self.order:
            if kind == "F" and self.spec.stage > 0:
                links, names, backward = self.wiring.forward_in[(j, k)], self.wiring.received, False
            elif kind == "B" and not self.last:
                links, names, backward = self.wiring.backward_in[(j, k)], self.wiring.grads_in, True
            else:
                continue
            if all(
                transport.wire_device(self.device, self._accelerator(link.peer)).type == "cpu"
                for link in links
            ):
                self._posted[(kind, j)] = [
                    self._post(link, names, step, j, backward) for link in links
                ]

    def _receive(
        self, links: Sequence[Link], names: Sequence[str], step: int, j: int, backward: bool
    ) -> list[list[torch.Tensor | None]]:
        """Every message of ``links`` into this operation (microbatch ``j``): the tensors of
        ``names`` in each (gradients with their presence bytes)."""
        posted = self._posted.pop(("B" if backward else "F", j), None)
        if posted is None:
            posted = [self._post(link, names, step, j, backward) for link in links]
        buffers = transport.wait_all(posted, self.spec.timeout_s)
        metas = [self.meta[n] for n in names]
        return [
            transport.unpack(b, metas, link.rows, flags=backward)
            for b, link in zip(buffers, links, strict=True)
        ]

    def _send(
        self,
        links: Sequence[Link],
        values: Sequence[torch.Tensor | None],
        names: Sequence[str],
        step: int,
        j: int,
        backward: bool,
    ) -> None:
        """Post one message per link: rows ``[lo, hi)`` of the batched ``values``, the
        shared ones whole."""
        for link in links:
            device = transport.wire_device(self.device, self._accelerator(link.peer))
            rows = [
                None
                if v is None
                else (v[link.lo : link.hi] if self.meta[n].kind == "batched" else v)
                for n, v in zip(names, values, strict=True)
            ]
            buffer = transport.pack(rows, device, flags=backward)
            message_tag = transport.tag(j, link.peer[1], backward, step)
            work = transport.isend(buffer, self._rank(link.peer), message_tag)
            self._pending.append((work, buffer))

    def _accelerator(self, endpoint: tuple[int, int, int]) -> str | None:
        if not self.spec.accelerators:
            return None
        return self.spec.accelerators[endpoint[0]][endpoint[2]]

    def _forward(
        self,
        step: int,
        j: int,
        inputs: Payload | None,
        labels: np.ndarray | None,
        losses: dict[str, Any],
    ) -> OpRecord:
        """Forward of microbatch ``j`` (this replica's share of it)."""
        s, k = self.spec.stage, self.spec.replica
        lo, hi = self.layout.spans[s][j][k]
        if s == 0:
            if inputs is None:
                raise ValueError("the first stage's step needs the batch's inputs")
            values = {n: torch.from_numpy(np.array(inputs[n][lo:hi])) for n in self.graph.inputs}
        else:
            links = self.wiring.forward_in[(j, k)]
            parts = self._receive(links, self.wiring.received, step, j, backward=False)
            values = concat_inputs(self.graph.inputs, self.wiring.received, parts, self.meta)
        clock = Clock.now()
        values = {
            n: v.to(self.device) if isinstance(v, torch.Tensor) else v for n, v in values.items()
        }
        leaves = {
            n: v.requires_grad_(True)
            for n, v in values.items()
            if s > 0 and isinstance(v, torch.Tensor) and v.is_floating_point()
        }
        y = None
        if self.last:
            if labels is None:
                raise ValueError("the last stage's step needs the batch's labels")
            y = torch.from_numpy(np.array(labels[lo:hi])).to(self.device)
        rng = recompute.RngState.capture(self.device) if self.spec.recompute else None
        synchronize(self.device)
        compute = Clock.now()
        with recompute.without_graph(self.spec.recompute):
            outputs = self._apply(values, leaves)
            if y is not None:
                terms = self.loss.terms(outputs[self.graph.outputs[0]], y)
                self._losses[j] = batch_loss(terms, hi - lo, self.spec.global_batch)
        synchronize(self.device)
        computed = compute.elapsed()
        if y is not None:
            losses["loss_sum"] += float(terms.loss_sum.detach())
            losses["predictions"] += terms.predictions
            losses["correct"] += terms.correct
        self._saved[j] = (leaves, {} if rng is not None else outputs)
        if rng is not None:  # keep the inputs only; the backward runs the forward again
            self._replays[j] = recompute.Replay(values, y, hi - lo, rng)
        record = self._record("F", step, j, clock, computed)
        if not self.last:
            sent = [outputs[n] for n in self.wiring.sent]
            self._send(self.wiring.forward_out[(j, k)], sent, self.wiring.sent, step, j, False)
        return record

    def _apply(
        self, values: Mapping[str, Any], leaves: Mapping[str, torch.Tensor]
    ) -> dict[str, Any]:
        """The stage's module on one microbatch's inputs: its outputs by name. The module
        gets clones of the leaves: an in-place op (ReLU(inplace=True)) may not touch one."""
        feed = {n: (v.clone() if n in leaves else v) for n, v in values.items()}
        args = [feed[a] if a in feed else self.attrs[a] for a in self.graph.args]
        produced = dict(zip(self.graph.results, self.module(*args), strict=True))
        return {n: produced[n] if n in produced else values[n] for n in self.graph.outputs}

    def _recompute(
        self, j: int, leaves: dict[str, torch.Tensor]
    ) -> tuple[dict[str, Any], tuple[float, float]]:
        """A recomputing stage's forward of microbatch ``j`` again, with autograd and the
        random state of its first run (its outputs, and the last stage's loss into
        ``_losses``); returns them and its wall and CPU seconds."""
        replay = self._replays.pop(j)
        synchronize(self.device)
        clock = Clock.now()
        with recompute.replayed(replay.rng, self.device):
            outputs = self._apply(replay.values, leaves)
            if replay.labels is not None:
                terms = self.loss.terms(outputs[self.graph.outputs[0]], replay.labels)
                self._losses[j] = batch_loss(terms, replay.samples, self.spec.global_batch)
        synchronize(self.device)
        return outputs, clock.elapsed()

    def _backward(self, step: int, j: int) -> OpRecord:
        """Backward of microbatch ``j``: the next stage's gradients in, this stage's inputs'
        gradients out."""
        s, k = self.spec.stage, self.spec.replica
        if j not in self._saved:
            raise RuntimeError(f"backward of step {step} microbatch {j} before its forward")
        grads: dict[str, torch.Tensor] = {}
        links: list[Link] = []
        if not self.last:
            links = self.wiring.backward_in[(j, k)]
            parts = self._receive(links, self.wiring.grads_in, step, j, backward=True)
            grads = concat_gradients(self.wiring.grads_in, links, parts, self.meta)
        clock = Clock.now()
        leaves, outputs = self._saved.pop(j)
        rerun = (0.0, 0.0)
        if j in self._replays:
            outputs, rerun = self._recompute(j, leaves)
        # The backward stores fresh gradients; adding them into the step's earlier ones
        # happens after the device compute (see the module docstring: accumulation).
        earlier = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        for n in earlier:
            self.params[n].grad = None
        self._hooked = [0.0, 0.0]
        hooks = self._overlap_all_reduce(earlier) if j == self._last_backward else []
        if self.last:
            synchronize(self.device)
            compute = Clock.now()
            self._losses.pop(j).backward()
        else:
            pairs = [
                (outputs[n], g.to(self.device))
                for n, g in grads.items()
                if isinstance(outputs[n], torch.Tensor) and outputs[n].requires_grad
            ]
            synchronize(self.device)
            compute = Clock.now()
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        synchronize(self.device)
        wall, cpu = compute.elapsed()
        # the adds run at full speed; a recomputing stage's second forward is device compute
        computed = (wall - self._hooked[0] + rerun[0], cpu - self._hooked[1] + rerun[1])
        for handle in hooks:
            handle.remove()
        for n, grad in earlier.items():
            p = self.params[n]
            p.grad = grad if p.grad is None else grad.add_(p.grad)
        record = self._record("B", step, j, clock, computed)
        if s > 0:
            back = [leaves[n].grad if n in leaves else None for n in self.wiring.grads_out]
            out = self.wiring.backward_out[(j, k)]
            self._send(out, back, self.wiring.grads_out, step, j, True)
        return record

    def _overlap_all_reduce(self, earlier: dict[str, torch.Tensor]) -> list[Any]:
        """For the step's last backward of a replicated stage: as soon as autograd has
        stored a parameter's gradient, add the step's earlier gradient of it (the
        accumulation) and start its all-reduce, so the sums travel while the backward goes on
        (in DDP's buckets: :mod:`executor.buckets`). Every replica runs the same graph, so the
        all-reduces start in the same order everywhere. The hooks' own time is kept apart
        (``_hooked``): the accumulation runs at full speed, as it does after the other
        backwards."""
        if self.subgroup is None:
            return []

        sums = self._buckets = Buckets(self._bucket_layout, self.subgroup, self.shared)

        def hook(name: str) -> Callable[[torch.Tensor], None]:
            def ready(p: torch.Tensor) -> None:
                clock = Clock.now()
                assert p.grad is not None
                p.grad = sums.ready(name, p.grad, earlier.pop(name, None))
                wall, cpu = clock.elapsed()
                self._hooked[0] += wall
                self._hooked[1] += cpu

            return ready

        return [p.register_post_accumulate_grad_hook(hook(n)) for n, p in self.params.items()]

    def _all_reduce(self, step: int) -> OpRecord:
        """Wait for the replicas' gradient sums (``all_reduce`` over the stage's subgroup,
        started by :meth:`_overlap_all_reduce` during the last backward): each replica holds
        the gradient of *its* samples' share of the global-batch mean loss, so the sum is the
        gradient of the whole batch. A parameter without a gradient has none on every
        replica (the same graph) and keeps none, as in single-process training. The record
        holds what is left of the all-reduce once the backward is over."""
        clock = Clock.now()
        if self._buckets is not None:  # started during the last backward
            self._buckets.finish()
            self._buckets = None
        synchronize(self.device)
        synchronize(self.device)
        return self._record("G", step, -1, clock)

    def _update(self, step: int) -> OpRecord:
        """Optimizer step."""
        clock = Clock.now()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        return self._record("U", step, -1, clock)

    # --- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> None | Failure:
        """This replica's part of a checkpoint into ``path`` (every replica at once)."""
        try:
            state = checkpoint.shard_state(self.state, self.optimizer, self.params, self._rng_key)
            checkpoint.save_shard(state, Path(path))
            return None
        except Exception:
            return self._failure("checkpoint save")

    def load_checkpoint(self, path: str, restore_rng: bool) -> None | Failure:
        """Load this replica's entries of the checkpoint at ``path`` (every replica at once);
        ``restore_rng``: also its random state (the checkpoint's plan is this run's)."""
        try:
            key = self._rng_key if restore_rng else None
            checkpoint.load_shard(Path(path), self.state, self.optimizer, self.params, key)
            return None
        except Exception:
            return self._failure("checkpoint load")

    @property
    def _rng_key(self) -> str:
        return f"s{self.spec.stage}.r{self.spec.replica}"

    def _failure(self, operation: str) -> Failure:
        spec = self.spec
        return Failure(
            spec.stage, spec.replica, spec.device, spec.node, operation, traceback.format_exc()
        )

    def parameters(self) -> dict[str, np.ndarray]:
        """The stage's parameters, by the model's parameter names."""
        return {n: p.detach().cpu().numpy().copy() for n, p in self.params.items()}

    # --- helpers ----------------------------------------------------------------------------

    def _record(
        self,
        kind: OpKind,
        step: int,
        mb: int,
        clock: Clock,
        computed: tuple[float, float] | None = None,
    ) -> OpRecord:
        """What the operation begun at ``clock`` did. ``computed``: wall and CPU seconds of
        its device compute (forward and backward), which the emulation slows down;
        ``None`` for the all-reduce and the update, which it does not."""
        wall, cpu = clock.elapsed()
        sleep = 0.0
        if computed is not None:
            sleep = emulation_sleep(self.spec.slowdown, *computed)
            cpu = computed[1]
        if sleep > 0:
            time.sleep(sleep)
        spec = self.spec
        metrics.stage_compute(spec.stage, self.device_type, kind, wall + sleep)
        return OpRecord(
            spec.stage,
            spec.replica,
            kind,
            step,
            mb,
            clock.start,
            time.time(),
            wall + sleep,
            sleep,
            cpu,
        )


def rng_seed(seed: int, stage: int, replica: int) -> int:
    """The seed of one stage replica's random state in a training run (its dropout): a run
    of the same seed draws the same masks, and no two replicas draw alike."""
    return (seed * 1_000_003 + stage * 1_009 + replica) % (2**63)


HEAP_RESERVE = 4
"""Parameter sizes of heap a CPU stage that accumulates gradients (several microbatches per
step) faults in when it starts (:func:`touch_heap`), besides the optimizer's state: the
step's gradients and a backward's new weight gradients beside them (2), and as much again,
because the other allocations between them (saved activations, payloads) fragment the heap
while a weight gradient needs one contiguous block as large as its layer's weights. With less
(2 or 3), VGG-16's last stage under 1F1B still grew its heap in some timed steps -- a few
hundred MB of page faults in one backward, scaled by the emulation (README, fidelity). The
slack also holds a replicated stage's flat copy for the all-reduce."""


def heap_reserve(param_bytes: int, state_buffers: int, microbatches: int, replicas: int) -> int:
    """Bytes of heap a CPU stage of ``param_bytes`` of parameters faults in at start, in
    parameter sizes: :data:`HEAP_RESERVE` when it accumulates gradients; otherwise (one
    microbatch per step: each step's gradients take the blocks the last step's freed) 1 for
    the gradients, and 1 more with replicas, for the all-reduce's flat copy; plus the
    optimizer's ``state_buffers`` (:attr:`executor.model.OptimizerConfig.state_buffers`),
    which its first update allocates. Six replicas of VGG-16 (TAPP's BSP on
    ``local-pipeline``) need the smaller reserve to fit this machine's memory."""
    gradients = HEAP_RESERVE if microbatches > 1 else 1 + int(replicas > 1)
    return (gradients + state_buffers) * param_bytes


def touch_heap(n_bytes: int) -> None:
    """Allocate ``n_bytes``, write them, free them: with the actors' malloc settings
    (:data:`executor.pinning.WORKER_ENV`: no mmap, no trimming) the heap keeps those pages,
    so the first operations allocate from memory already faulted in. Without it the heap grows
    over the first two calls or so, and a run whose warm-up is one call per stage (one
    microbatch) still paid page faults in its first timed step."""
    if n_bytes > 0:
        block = torch.empty(n_bytes, dtype=torch.uint8)
        block.fill_(0)
        del block


@dataclass(frozen=True)
class Clock:
    """When an operation began: wall clock, a monotonic clock and this thread's CPU time."""

    start: float
    wall: float
    cpu: float

    @classmethod
    def now(cls) -> Clock:
        return cls(time.time(), time.perf_counter(), time.thread_time())

    def elapsed(self) -> tuple[float, float]:
        """Wall seconds and CPU seconds since :meth:`now`."""
        return time.perf_counter() - self.wall, time.thread_time() - self.cpu
