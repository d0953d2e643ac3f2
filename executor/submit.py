"""Submit one training step: every operation of every stage replica, as Ray actor calls.

Each stage replica runs its stage's order of ``core.schedules.stage_orders``, submitted in that
order (the actor runs one submitter's tasks in submission order, :mod:`executor.stage`); each call
passes the payload refs of the neighbour operations holding its samples
(``executor.microbatch.Layout``). Refs exist only once their operation is submitted, so
operations are submitted in rounds: each replica goes as far down its order as its
neighbours allow; a deadlock-free schedule always progresses. Then, per stage, the replicas'
ring all-reduce and optimizer steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeplan.core.plan import Plan
from pipeplan.core.schedules import stage_orders
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.microbatch import Layout, Piece
from pipeplan.executor.ring import rounds
from pipeplan.executor.stage import WorkerInfo, WorkerSpec

Ref = Any  # ray.ObjectRef
OpKey = tuple[int, int, int]  # stage, microbatch, replica


@dataclass
class WorkerHandle:
    """The driver's view of one stage replica: its spec, actor handle and where it runs."""

    spec: WorkerSpec
    actor: Any
    info: WorkerInfo | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.spec.stage, self.spec.replica

    def where(self) -> str:
        s = self.spec
        return f"stage {s.stage} replica {s.replica} ({s.device} on node {s.node})"


@dataclass
class Submission:
    """The refs of one submitted step."""

    records: dict[Ref, WorkerHandle] = field(default_factory=dict)
    """Every operation's record (:class:`~executor.stage.OpRecord`), with the replica that
    runs it."""
    losses: list[Ref] = field(default_factory=list)
    """The last stage's forward payloads: loss terms."""

    def add(self, record: Ref, worker: WorkerHandle) -> None:
        self.records[record] = worker


def submit_step(
    plan: Plan,
    layout: Layout,
    rows: Sequence[Sequence[WorkerHandle]],
    step: int,
    inputs: Ref,
    labels: Ref,
) -> Submission:
    """Submit step ``step`` (``inputs``/``labels``: the batch in the object store)."""
    S = plan.num_stages
    sizes = [st.microbatch for st in plan.stages]
    orders = stage_orders(plan.schedule, sizes, plan.global_batch)
    workers = [w for row in rows for w in row]
    cursor = dict.fromkeys((w.key for w in workers), 0)
    payloads: dict[str, dict[OpKey, Ref]] = {"F": {}, "B": {}}
    out = Submission()
    remaining = sum(len(orders[w.spec.stage]) for w in workers)
    while remaining:
        progressed = 0
        for w in workers:
            s, k = w.key
            while cursor[w.key] < len(orders[s]):
                kind, j = orders[s][cursor[w.key]]
                args = _arguments(plan, layout, w, kind, j, payloads[kind], inputs, labels)
                if args is None:
                    break  # a neighbour's payload is not submitted yet
                method = w.actor.forward if kind == "F" else w.actor.backward
                record, payload = method.remote(step, j, *args)
                payloads[kind][(s, j, k)] = payload
                if kind == "F" and s == S - 1:
                    out.losses.append(payload)
                out.add(record, w)
                cursor[w.key] += 1
                progressed += 1
        if not progressed:
            raise ExecutorError(f"step {step}: schedule {plan.schedule} cannot progress")
        remaining -= progressed
    _submit_updates(rows, step, out)
    return out


def _arguments(
    plan: Plan,
    layout: Layout,
    w: WorkerHandle,
    kind: str,
    j: int,
    ready: dict[OpKey, Ref],
    inputs: Ref,
    labels: Ref,
) -> list[Any] | None:
    """Arguments after ``(step, microbatch)``, or None if a payload is missing."""
    s, k = w.key
    last = s == plan.num_stages - 1
    lo, hi = layout.spans[s][j][k]
    own = Piece(-1, 0, 0, lo, hi, True)  # rows of the whole batch
    if kind == "F" and s == 0:
        pieces, refs = [own], [inputs]
    elif kind == "B" and last:
        pieces, refs = [], []
    else:
        pieces = layout.forward_pieces(s, j, k) if kind == "F" else layout.backward_pieces(s, j, k)
        keys = [(p.stage, p.microbatch, p.replica) for p in pieces]
        if any(key not in ready for key in keys):
            return None
        refs = [ready[key] for key in keys]
    if kind == "B":
        return [pieces, *refs]
    return [pieces, own if last else None, *refs, *([labels] if last else [])]


def _submit_updates(
    rows: Sequence[Sequence[WorkerHandle]],
    step: int,
    out: Submission,
) -> None:
    """Per stage: a ring all-reduce of the replicas' gradients (if replicated: replica ``k``
    passes each round's chunk to replica ``k+1``, :mod:`executor.ring`), then every
    replica updates."""
    for row in rows:
        r = len(row)
        if r > 1:
            sends: list[Ref] = []
            for w in row:
                record, chunk = w.actor.ring_start.remote(step, r)
                out.add(record, w)
                sends.append(chunk)
            for _ in range(rounds(r)):
                received = [sends[(k - 1) % r] for k in range(r)]
                sends = []
                for w, chunk in zip(row, received, strict=True):
                    record, nxt = w.actor.ring_step.remote(step, chunk)
                    out.add(record, w)
                    sends.append(nxt)
        for w in row:
            record, _ = w.actor.update.remote(step)
            out.add(record, w)
