"""Keep this machine's cores out of their idle states while an emulated cluster runs.

An emulated device sleeps most of each operation (:mod:`executor.emulation`), so the cores
go idle many times a second, and a core that has just left idle runs the next computation
slower than the profile (timed back to back) predicts; a real device does not pay that.
``bench/idle_slowdown.py`` measures the effect and this remedy (figures in
``bench/results/idle_slowdown/`` and the README): on this machine the effect is real and
the remedy helps most of the time, not always.

:class:`KeepAwake` starts one spinner process per core under ``SCHED_IDLE``, Linux's
lowest scheduling class: a spinner runs only when nothing else wants the core and gives it
up at once when something does, so it takes no time from Ray, the stage workers or anything
else on the machine -- it only stops the cores from idling. Where ``SCHED_IDLE`` is not
available the spinners exit at once (never spin at normal priority). They also exit by
themselves when the process that started them is gone, and :meth:`KeepAwake.stop` ends
them by their process ids.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import TracebackType

__all__ = ["KeepAwake"]

_SPINNER = """
import os, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    sys.exit(0)
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200000):
        pass
"""


class KeepAwake:
    """``count`` idle-priority spinner processes (default: one per core) while in use."""

    def __init__(self, count: int | None = None) -> None:
        self.count = count if count is not None else (os.cpu_count() or 1)
        if self.count < 0:
            raise ValueError(f"count: expected >= 0 spinners, got {self.count}")
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> KeepAwake:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs if p.poll() is None)

    def start(self) -> None:
        if not sys.platform.startswith("linux") or self._procs:
            return
        for _ in range(self.count):
            self._procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SPINNER, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )

    def stop(self) -> None:
        """End every spinner this object started (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()
