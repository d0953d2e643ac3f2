"""What a call to a worker (:mod:`executor.worker_pool`) gives back, named without Ray.

The service's API process names calls and reads their :class:`Outcome`, :class:`WorkerLost`
and :class:`WorkerTimeout` (:mod:`service.api.pool`) without importing Ray; the workers
themselves are Ray actors, started where the pool is.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pipeplan.executor.errors import ExecutorError


class WorkerLost(ExecutorError):
    """The worker's process is gone (killed, crashed, out of memory); names the worker."""


class WorkerTimeout(ExecutorError):
    """A call ran past its limit; the worker is still busy with it and must be killed."""


@dataclass(frozen=True)
class Outcome:
    """What one call gave: its return ``value`` or its failure (``error``: the exception's
    one line, ``traceback``), and the text it printed or logged (``log``)."""

    value: Any = None
    log: str = ""
    error: str | None = None
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def resolve(target: str) -> Any:
    """The object ``package.module:attr`` names (imported now)."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"target: expected 'package.module:attr', got {target!r}")
    return getattr(importlib.import_module(module), attr)
