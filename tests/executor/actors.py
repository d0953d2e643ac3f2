"""What the executor's Ray tests ask of the live cluster: how many stage actors are alive,
and waiting until none is (a run must leave none behind). One home for the modules that
start pipelines."""

from __future__ import annotations

import time

from pipeplan.executor import runtime


def stage_workers_alive() -> int:
    """Stage actors of any run that Ray does not count as dead."""
    actors = runtime.actors()
    return sum(1 for a in actors if a["ActorClassName"] == "StageWorker" and a["State"] != "DEAD")


def wait_no_workers(timeout_s: float = 20.0) -> int:
    """Wait up to ``timeout_s`` for every stage actor to be gone; how many are left."""
    deadline = time.monotonic() + timeout_s
    while stage_workers_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return stage_workers_alive()
