"""Bounds on the work a call does, for tests that claim "refused at once" or "never expanded":
they count function calls instead of timing them, so a busy machine cannot fail them and a
slow path cannot pass them."""

from __future__ import annotations

import sys
from types import FrameType, TracebackType
from typing import Any

AT_ONCE = 1_000
"""Function calls a refusal "at once" may make: the limits' refusals make ~30-210 today, and
the documents the tests refuse have 1,000 or more items (nodes, devices, layers,
microbatches), so one that goes through them item by item cannot pass."""


class counting_calls:  # noqa: N801  (used as a context manager, like a function)
    """Counts the Python and C function calls made in its block (this thread's), in
    ``calls``: a call per node, layer or device read shows as at least that many."""

    def __init__(self) -> None:
        self.calls = 0
        self._before: Any = None

    def _count(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def __enter__(self) -> counting_calls:
        self._before = sys.getprofile()
        sys.setprofile(self._count)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        sys.setprofile(self._before)
