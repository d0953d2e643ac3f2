"""Waiting for actor results with a deadline, and turning failures into one clear error.

A worker hands its own exception back as a :class:`~executor.stage.Failure` value; Ray
raises for a dead actor or node (``ActorDiedError``, carrying the dead actor's id, also on
every task that depended on it). Either way the driver raises a single
:class:`~executor.errors.StageFailedError` naming the stage, replica, device and node, with
the original traceback or Ray's account of the death.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from pipeplan.executor.errors import ExecutorTimeoutError, StageFailedError
from pipeplan.executor.stage import Failure
from pipeplan.executor.submit import Ref, WorkerHandle


def wait_all(
    refs: Mapping[Ref, WorkerHandle | None],
    workers: Sequence[WorkerHandle],
    deadline: float,
    what: str,
) -> dict[Ref, Any]:
    """Every ref's value (``refs`` maps each to the replica computing it, if any); raises on
    the first failure, or once ``deadline`` (``time.monotonic()``) passes."""
    values: dict[Ref, Any] = {}
    left = list(refs)
    while left:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise timed_out(what, [refs[r] for r in left])
        ready, left = ray.wait(left, num_returns=1, timeout=timeout)
        if left:  # collect everything else already done in one go
            more, left = ray.wait(left, num_returns=len(left), timeout=0)
            ready += more
        for ref in ready:
            values[ref] = _value(ref, refs[ref], workers, what)
    return values


def _value(ref: Ref, owner: WorkerHandle | None, workers: Sequence[WorkerHandle], what: str) -> Any:
    try:
        value = ray.get(ref, timeout=60.0)  # ready already: a long wait means a lost object
    except GetTimeoutError:
        raise timed_out(what, [owner]) from None
    except RayError as e:
        raise ray_failure(e, owner, workers, what) from None
    if isinstance(value, Failure):
        raise value.error(what)
    return value


PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited",
)
"""What gloo and NCCL say when the process at the other end of a message went away."""

PEER_GRACE_S = 20.0
"""How long a failure that names a lost peer waits for Ray to report which actor died."""


def lost_peer(
    failure: StageFailedError,
    refs: Mapping[Ref, WorkerHandle],
    workers: Sequence[WorkerHandle],
    what: str,
    grace_s: float = PEER_GRACE_S,
) -> StageFailedError | None:
    """When ``failure`` is a replica's receive or collective failing because its peer's
    process went away, the error for the replica whose actor died (Ray reports a lost node
    or a killed actor a little after its neighbours' sockets close); None when no other
    replica's step turns out to have died within ``grace_s``."""
    if not any(text in failure.traceback for text in PEER_LOST):
        return None
    others = [
        r
        for r, w in refs.items()
        if (w.spec.stage, w.spec.replica) != (failure.stage, failure.replica)
    ]
    deadline = time.monotonic() + grace_s
    while others and (timeout := deadline - time.monotonic()) > 0:
        ready, others = ray.wait(others, num_returns=1, timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref, timeout=10.0)
            except RayError as e:
                return ray_failure(e, refs[ref], workers, what)
    return None


def ray_failure(
    e: RayError, owner: WorkerHandle | None, workers: Sequence[WorkerHandle], what: str
) -> StageFailedError:
    """The replica whose actor died (by the actor id Ray reports), else the one waited on."""
    actor_id = getattr(e, "actor_id", None)
    dead = next((w for w in workers if actor_id and w.actor._actor_id.hex() == actor_id), owner)
    text = str(e).strip()
    if dead is None:
        return StageFailedError(-1, -1, "?", "?", f"{what}: {type(e).__name__}", text)
    node_died = "node has died" in text or ("node" in text and "terminated" in text)
    cause = f"{what}: the actor {'and its node ' if node_died else ''}died ({type(e).__name__})"
    s = dead.spec
    return StageFailedError(s.stage, s.replica, s.device, s.node, cause, text)


def timed_out(what: str, owners: Sequence[WorkerHandle | None]) -> ExecutorTimeoutError:
    names = sorted({w.where() for w in owners if w is not None})
    return ExecutorTimeoutError(f"{what}: no answer in time from {'; '.join(names) or 'Ray'}")
