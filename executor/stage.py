"""``StageWorker``: one replica of one pipeline stage, run as a Ray actor.

The worker builds the model itself (zoo name and seed, so every worker has the same
weights), cuts it with :func:`executor.partition.partition` and keeps its own stage. The
driver calls, per microbatch, :meth:`StageWorker.forward` and :meth:`StageWorker.backward`;
per batch, :meth:`StageWorker.ring_start` and :meth:`StageWorker.ring_step` (replicated
stages only: a ring all-reduce of the gradients, :mod:`executor.ring`) and
:meth:`StageWorker.update`.

**Ordering.** Every method returns an :class:`OpRecord` (what it did, when) beside its
payload (``num_returns=2``). The driver submits a worker's operations in the schedule's
order, and a single-threaded Ray actor runs the tasks of one submitter in submission order,
even when an earlier task still waits for an argument (Ray's documented actor task order;
the actors have no task retries, which would void it; a test checks it). So no argument
chains a worker's operations: each is sent to the actor as soon as its own inputs exist, and
the actor starts it the moment the previous one ends, with no round trip through the driver
in between. The payload refs passed in (activations from the previous stage, gradients from
the next one) make every cross-stage dependency explicit.

**Payloads.** Activations and gradients travel as ``{value name: numpy array}``
(:mod:`executor.payloads`).

**Failures.** A method never raises: it returns a :class:`Failure` (with the traceback) as
both record and payload. A method that receives a ``Failure`` passes it on untouched, and a
worker that has failed or seen a failure returns that ``Failure`` from every later operation
(until :meth:`StageWorker.reset`), so the driver sees the original error once and no worker
steps on a broken batch.

**Metrics.** Each forward, backward and update is recorded in Ray's metrics as it ends
(:func:`executor.metrics.stage_compute`, tagged with the stage and its device type).

**Devices.** A stage of a CUDA type (:mod:`executor.accelerators`) computes on the GPU Ray
gave its actor: the worker checks it can use CUDA when it starts, moves its slice of the
model there, and moves each operation's inputs there and its results back. Payloads stay CPU
arrays in Ray's object store, so transfers between stages go through the store whatever the
devices. A compute is timed after ``torch.cuda.synchronize`` on both sides, so that its
record holds the kernels' time, not the time to queue them.

**Emulation.** A device type ``k`` times slower than the fastest (``slowdown = k``) makes
each real forward and backward last ``k`` times the CPU time it took: the worker sleeps
after it (:func:`executor.emulation.emulation_sleep`). Only the device compute is slowed:
the stage's module (and the loss on the last stage) forward, and the autograd backward.
Turning payloads into tensors and back, and the leaves' clones, are the executor's host
work, which a slower accelerator would not slow down and the profile does not time; they
count at their real length. The optimizer update is not slowed: it is memory-bound, and the
cost model costs it by memory bandwidth (rule 8), which ``local-hetero`` gives every type
alike. Nor is the gradient accumulation, for the same reason (rule 2's accumulation term,
:mod:`core.costmodel`): a backward runs into fresh gradients, timed and slowed as the
profile times it, and then the worker adds the step's earlier gradients to them
(``earlier += new``, the sum autograd would have formed) at the real speed.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import ray
import torch

from pipeplan.core.cluster import parse_device_id
from pipeplan.executor import metrics
from pipeplan.executor.accelerators import local_device, synchronize
from pipeplan.executor.emulation import emulation_sleep
from pipeplan.executor.errors import StageFailedError
from pipeplan.executor.microbatch import Piece
from pipeplan.executor.model import (
    ModelSource,
    OptimizerConfig,
    batch_loss,
    disable_dropout,
    loss_terms,
)
from pipeplan.executor.partition import ValueKind, fetch_attr, partition
from pipeplan.executor.payloads import Payload, gather, gather_gradients, numpy_dtype, to_numpy
from pipeplan.executor.ring import RingState

OpKind = Literal["F", "B", "G", "U"]
Key = tuple[int, int]  # (step, microbatch)


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
    """Replicas of the stage: with more than one it runs the ring all-reduce."""


@dataclass(frozen=True)
class OpRecord:
    """What one operation did."""

    stage: int
    replica: int
    kind: OpKind
    step: int
    microbatch: int
    start: float
    """Wall clock (``time.time()``) when the method body began: its inputs had arrived."""
    end: float
    compute_s: float
    """Real compute plus the emulation sleep."""
    emulated_s: float
    """The emulation sleep alone."""
    cpu_s: float = 0.0
    """CPU time (this thread's) of the device compute of a forward or backward (the
    emulation's base), of the whole operation otherwise."""


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


def _guarded(kind: OpKind) -> Callable[[Any], Any]:
    """Pass an upstream :class:`Failure` on; turn an exception into a ``Failure``; after
    either, answer every operation with that ``Failure``."""

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def guarded(self: StageWorker, *args: Any) -> Any:
            if self.failure is None:
                self.failure = next((a for a in args if isinstance(a, Failure)), None)
            if self.failure is not None:
                return self.failure, self.failure
            try:
                return method(self, *args)
            except Exception:
                spec = self.spec
                self.failure = Failure(
                    spec.stage, spec.replica, spec.device, spec.node, kind, traceback.format_exc()
                )
                return self.failure, self.failure

        return guarded

    return wrap


class StageWorker:
    """One replica of one stage. Wrapped by :func:`ray.remote` in :mod:`executor.pipeline`."""

    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(1)
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
        self.kinds: Mapping[str, ValueKind] = cut.kinds
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
        # A stage of activations and pools alone has nothing to optimise.
        self.optimizer = spec.optimizer.make(self.params.values()) if self.params else None
        if self.device.type == "cpu":
            param_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
            touch_heap(
                heap_reserve(
                    param_bytes, spec.optimizer.state_buffers, spec.microbatches, spec.replicas
                )
            )
        self.saved: dict[Key, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self.losses: dict[Key, torch.Tensor] = {}
        self.ring: RingState | None = None
        self.failure: Failure | None = None

    def reset(self, spec: WorkerSpec) -> WorkerInfo:
        """Start over with fresh weights (and possibly another batch size or slowdown), in the
        same process: cheaper than a new actor when only microbatches or schedule change."""
        if spec.stage != self.spec.stage or spec.bounds != self.spec.bounds:
            raise ValueError(f"reset: stage {spec.stage} {spec.bounds} is not this worker's")
        self.__init__(spec)  # type: ignore[misc]
        return self.ready()

    def ready(self) -> WorkerInfo:
        return WorkerInfo(
            ray.get_runtime_context().get_node_id(),
            os.getpid(),
            self.graph.inputs,
            self.graph.outputs,
        )

    # --- operations -------------------------------------------------------------------------

    @_guarded("F")
    @ray.method(num_returns=2)
    def forward(
        self,
        step: int,
        microbatch: int,
        pieces: Sequence[Piece],
        labels: Piece | None,
        *payloads: Any,
    ) -> tuple[OpRecord, Payload]:
        """Run the stage on the samples of ``pieces`` (rows of ``payloads``, in order).

        The last stage also gets the labels (the last payload, rows ``labels``) and returns
        the loss terms instead of activations.
        """
        clock = Clock.now()
        values, leaves, args = self._inputs(pieces, payloads[: len(pieces)])
        key = (step, microbatch)
        y = None
        if self.last:
            if labels is None:
                raise ValueError("the last stage's forward needs labels")
            y = torch.from_numpy(np.array(payloads[-1][labels.lo : labels.hi])).to(self.device)
        synchronize(self.device)
        compute = Clock.now()
        produced = dict(zip(self.graph.results, self.module(*args), strict=True))
        outputs = {n: produced[n] if n in produced else values[n] for n in self.graph.outputs}
        if y is not None:
            terms = loss_terms(outputs[self.graph.outputs[0]], y)
            samples = sum(p.hi - p.lo for p in pieces)
            self.losses[key] = batch_loss(terms, samples, self.spec.global_batch)
        synchronize(self.device)
        computed = compute.elapsed()
        if y is not None:
            payload: Payload = {
                "loss_sum": float(terms.loss_sum.detach()),
                "predictions": terms.predictions,
                "correct": terms.correct,
            }
        else:
            payload = {n: to_numpy(v) for n, v in outputs.items()}
        self.saved[key] = (leaves, outputs)
        return self._record("F", step, microbatch, clock, computed), payload

    def _inputs(
        self, pieces: Sequence[Piece], payloads: Sequence[Payload]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[Any]]:
        """The stage's input values for ``pieces``, the leaves that will hold their
        gradients (stages after the first), and the module's arguments."""
        values = {
            n: v.to(self.device) if isinstance(v, torch.Tensor) else v
            for n, v in gather(self.graph.inputs, pieces, payloads, self.kinds).items()
        }
        leaves = {
            n: v.requires_grad_(True)
            for n, v in values.items()
            if self.spec.stage > 0 and isinstance(v, torch.Tensor) and v.is_floating_point()
        }
        # The module gets clones: an in-place op (ReLU(inplace=True)) may not touch a leaf.
        feed = {n: (v.clone() if n in leaves else v) for n, v in values.items()}
        args = [feed[a] if a in feed else self.attrs[a] for a in self.graph.args]
        return values, leaves, args

    @_guarded("B")
    @ray.method(num_returns=2)
    def backward(
        self, step: int, microbatch: int, pieces: Sequence[Piece], *payloads: Any
    ) -> tuple[OpRecord, Payload | None]:
        """Backward of one microbatch; ``payloads`` are the next stage's input gradients."""
        clock = Clock.now()
        key = (step, microbatch)
        if key not in self.saved:
            raise RuntimeError(
                f"backward of step {step} microbatch {microbatch} before its forward"
            )
        leaves, outputs = self.saved.pop(key)
        # The backward stores fresh gradients; adding them into the step's earlier ones
        # happens after the device compute (see the module docstring: accumulation).
        earlier = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        for n in earlier:
            self.params[n].grad = None
        if self.last:
            synchronize(self.device)
            compute = Clock.now()
            self.losses.pop(key).backward()
        else:
            grads = gather_gradients(self.graph.outputs, pieces, payloads, self.kinds)
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
        computed = compute.elapsed()
        for n, grad in earlier.items():
            p = self.params[n]
            p.grad = grad if p.grad is None else grad.add_(p.grad)
        payload = None
        if self.spec.stage > 0:
            payload = {n: None if v.grad is None else to_numpy(v.grad) for n, v in leaves.items()}
        return self._record("B", step, microbatch, clock, computed), payload

    @_guarded("G")
    @ray.method(num_returns=2)
    def ring_start(self, step: int, replicas: int) -> tuple[OpRecord, Any]:
        """Begin the replicas' ring all-reduce (:mod:`executor.ring`) of this step's
        gradients; returns the chunk to send to the next replica."""
        clock = Clock.now()
        grads = {n: None if p.grad is None else to_numpy(p.grad) for n, p in self.params.items()}
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        dtypes = {numpy_dtype(p.dtype) for p in self.params.values()} or {np.dtype("f4")}
        if len(dtypes) > 1:
            raise ValueError(
                f"ring all-reduce: parameters of several dtypes {sorted(map(str, dtypes))}"
            )
        dtype = dtypes.pop()
        self.ring = RingState.start(self.spec.replica, replicas, grads, shapes, dtype)
        # The ring holds the gradients now (and update() puts their sum back): freeing them
        # keeps one copy in memory, not two.
        del grads
        for p in self.params.values():
            p.grad = None
        return self._record("G", step, -1, clock), self.ring.outgoing()

    @_guarded("G")
    @ray.method(num_returns=2)
    def ring_step(self, step: int, chunk: np.ndarray) -> tuple[OpRecord, Any]:
        """Take the previous replica's chunk of this round; return the next one to send
        (``None`` after the last round)."""
        clock = Clock.now()
        if self.ring is None:
            raise RuntimeError(f"ring step of step {step} before ring_start")
        self.ring.receive(chunk)
        return self._record("G", step, -1, clock), self.ring.outgoing()

    @_guarded("U")
    @ray.method(num_returns=2)
    def update(self, step: int) -> tuple[OpRecord, None]:
        """Optimizer step. With replicas, the gradients are first replaced by their sum over
        the replicas (the finished ring all-reduce): each replica holds the gradient of
        *its* samples' share of the global-batch mean loss, so the sum is the gradient of
        the whole batch."""
        clock = Clock.now()
        if self.ring is not None:
            summed = self.ring.result()
            self.ring = None
            for name, p in self.params.items():
                g = summed[name]
                p.grad = None if g is None else torch.from_numpy(g).to(self.device)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        return self._record("U", step, -1, clock), None

    def parameters(self) -> dict[str, np.ndarray]:
        """The stage's parameters, by the model's parameter names."""
        return {n: to_numpy(p).copy() for n, p in self.params.items()}

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
        ``None`` for the ring all-reduce and the update, which it does not."""
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


HEAP_RESERVE = 4
"""Parameter sizes of heap a CPU stage that accumulates gradients (several microbatches per
step) faults in when it starts (:func:`touch_heap`), besides the optimizer's state: the
step's gradients and a backward's new weight gradients beside them (2), and as much again,
because the other allocations between them (saved activations, payloads) fragment the heap
while a weight gradient needs one contiguous block as large as its layer's weights. With less
(2 or 3), VGG-16's last stage under 1F1B still grew its heap in some timed steps -- a few
hundred MB of page faults in one backward, scaled by the emulation (README, fidelity). The
slack also holds a replicated stage's flat copy for the ring all-reduce."""


def heap_reserve(param_bytes: int, state_buffers: int, microbatches: int, replicas: int) -> int:
    """Bytes of heap a CPU stage of ``param_bytes`` of parameters faults in at start, in
    parameter sizes: :data:`HEAP_RESERVE` when it accumulates gradients; otherwise (one
    microbatch per step: each step's gradients take the blocks the last step's freed) 1 for
    the gradients, and 1 more with replicas, for the ring all-reduce's flat copy
    (:mod:`executor.ring`); plus the optimizer's ``state_buffers``
    (:attr:`executor.model.OptimizerConfig.state_buffers`), which its first update
    allocates. Six replicas of VGG-16 (TAPP's BSP on ``local-pipeline``) need the smaller
    reserve to fit this machine's memory."""
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
