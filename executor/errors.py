"""Errors of a run on the cluster. Bad plans and models raise ``core.errors`` types instead."""

from __future__ import annotations


class ExecutorError(RuntimeError):
    """A run on the Ray cluster failed (a worker raised, an actor or node died, a timeout)."""


class StageFailedError(ExecutorError):
    """One stage replica failed; names the stage, its device and node, and the cause."""

    def __init__(
        self, stage: int, replica: int, device: str, node: str, cause: str, traceback: str = ""
    ) -> None:
        self.stage, self.replica, self.device, self.node = stage, replica, device, node
        self.cause, self.traceback = cause, traceback
        where = f"stage {stage} replica {replica} on device {device} (node {node})"
        text = f"{where}: {cause}"
        if traceback:
            text += f"\n--- original traceback ---\n{traceback.rstrip()}"
        super().__init__(text)


class ExecutorTimeoutError(ExecutorError):
    """A wait on the cluster ran out of time; names the operations still pending."""
