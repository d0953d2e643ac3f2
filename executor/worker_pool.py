"""Long-lived Ray actors that call functions by name, in their own process, one at a time.

A service that answers many small requests cannot afford a new process (and a new import of
torch) per request. :class:`RayWorkers` starts actors once, each importing the modules it is
told to warm up, and :meth:`RayWorker.call` runs ``package.module:function`` in one of them
with the function's printed output and log records captured: the caller gets an
:class:`Outcome` (the return value, the captured text, or the failure with its traceback),
never an exception from inside the worker. A worker whose process died (killed, crashed, out
of memory) raises :class:`WorkerLost`; one that ran past the caller's limit raises
:class:`WorkerTimeout`, and either way the caller kills it and starts another.

Functions are named, not pickled, so the caller need not import what they import (the
service's API process names the job entrypoint without loading torch). The actors ask Ray
for no CPU: they wait most of the time, and must never hold back the cluster's runs. They
are owned by the process that started them, so they end with it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import threading
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.worker_calls import Outcome, WorkerLost, WorkerTimeout, resolve

__all__ = ["Outcome", "RayWorker", "RayWorkers", "WorkerLost", "WorkerTimeout", "resolve"]

MAX_LOG_CHARS = 1_000_000
"""The most captured text a call keeps (its end, where the failure is)."""
START_TIMEOUT_S = 300.0
"""How long a new worker may take to import its modules."""


class _Capture(io.TextIOBase):
    """A text sink that keeps the last :data:`MAX_LOG_CHARS` characters written to it."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._size = 0
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._parts.append(text)
            self._size += len(text)
            if self._size > 2 * MAX_LOG_CHARS:
                joined = "".join(self._parts)[-MAX_LOG_CHARS:]
                self._parts, self._size = [joined], len(joined)
        return len(text)

    def text(self) -> str:
        with self._lock:
            return "".join(self._parts)[-MAX_LOG_CHARS:]


@contextlib.contextmanager
def _captured() -> Iterator[_Capture]:
    """stdout, stderr and the root logger's records go to one capture for the block."""
    sink = _Capture()
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield sink
    finally:
        root.removeHandler(handler)


class _Worker:
    """The actor: imports ``warm`` once, then runs one call at a time."""

    def __init__(self, warm: Sequence[str]) -> None:
        for module in warm:
            importlib.import_module(module)

    def pid(self) -> int:
        return os.getpid()

    def call(self, target: str, args: tuple[Any, ...]) -> Outcome:
        with _captured() as sink:
            try:
                value = resolve(target)(*args)
            except BaseException as e:  # handed back, never raised across the boundary
                lines = str(e).strip().splitlines()
                error = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
                trace = traceback.format_exc()
                return Outcome(log=sink.text(), error=error, traceback=trace)
        return Outcome(value=value, log=sink.text())


_Actor = ray.remote(_Worker)


class RayWorker:
    """One started worker (its actor) and the calls made on it."""

    def __init__(self, actor: Any, name: str, pid: int, owner: RayWorkers | None = None) -> None:
        self.actor, self.name, self.pid, self.owner = actor, name, pid, owner

    def call(self, target: str, args: tuple[Any, ...], timeout_s: float | None = None) -> Outcome:
        """Run ``target(*args)`` in the worker; its :class:`Outcome`. Raises
        :class:`WorkerLost` when the worker died and :class:`WorkerTimeout` past
        ``timeout_s`` (``None``: no limit)."""
        ref = self.actor.call.remote(target, args)
        try:
            got: Outcome = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            raise WorkerTimeout(f"worker {self.name}: {target} ran past {timeout_s} s") from None
        except RayActorError as e:
            raise WorkerLost(f"worker {self.name} (pid {self.pid}) died: {_first(e)}") from None
        except RayTaskError as e:  # the call's arguments or answer did not cross
            return Outcome(error=_first(e), traceback=str(e))
        return got

    def kill(self) -> None:
        """End the worker's process (nothing if it is gone already)."""
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        if self.owner is not None:
            self.owner.forget(self)


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class RayWorkers:
    """Starts :class:`RayWorker` s on the cluster at ``address`` (its GCS, ``host:port``),
    named ``{prefix}-{n}`` in Ray ``namespace``, each importing ``warm`` first. This process
    joins the cluster on the first start (if it has not already) and leaves it in
    :meth:`close`, which also ends every worker it started."""

    def __init__(
        self, address: str, namespace: str, warm: Sequence[str] = (), prefix: str = "worker"
    ) -> None:
        self.address, self.namespace, self.warm = address, namespace, tuple(warm)
        self.prefix = f"{prefix}-{os.getpid()}"
        self._lock = threading.Lock()
        self._count = 0
        self._joined = False
        self._started: dict[str, RayWorker] = {}

    def _join(self) -> None:
        with self._lock:
            if not runtime.is_connected():
                runtime.keep_signal_handlers()  # its owner shuts down on SIGTERM
                runtime.connect(self.address)
                self._joined = True

    def start(self) -> RayWorker:
        """A new worker, once it has imported its modules (:class:`ExecutorError` if it
        could not start)."""
        self._join()
        with self._lock:
            self._count += 1
            name = f"{self.prefix}-{self._count}"
        actor: Any = _Actor.options(name=name, namespace=self.namespace, num_cpus=0).remote(
            self.warm
        )
        try:
            pid = int(ray.get(actor.pid.remote(), timeout=START_TIMEOUT_S))
        except Exception as e:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise ExecutorError(f"worker {name} did not start: {_first(e)}") from None
        worker = RayWorker(actor, name, pid, self)
        with self._lock:
            self._started[name] = worker
        return worker

    def forget(self, worker: RayWorker) -> None:
        """``worker`` was killed: :meth:`close` has nothing more to end of it."""
        with self._lock:
            self._started.pop(worker.name, None)

    def close(self) -> None:
        """Kill every worker started here, and leave the cluster if this object joined it."""
        with self._lock:
            started, self._started = list(self._started.values()), {}
        for worker in started:
            worker.kill()
        if self._joined:
            runtime.shutdown()
            self._joined = False
