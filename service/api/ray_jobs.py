"""The production :class:`~service.api.backend.JobsBackend`: every job is a Ray Job.

:class:`RayJobsBackend` adapts :class:`executor.ray_jobs.RayJobs` (Ray's
``JobSubmissionClient``, with Ray's token) to the backend protocol. A job's entrypoint is the
pipeplan CLI of this environment, called by absolute path (a bare ``python`` in a Ray Job
does not find this venv): ``pipeplan job run --job ID --server URL``, with the job's own
token in its environment (``PIPEPLAN_JOB_TOKEN``), never the API token. The submission id is
the pipeplan job id, so a repeated submission starts nothing.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from executor.ray_jobs import JobInfo, RayJobs, RayJobsError
from service.api.backend import BackendState, BackendStatus, Submission

JOB_TOKEN_ENV = "PIPEPLAN_JOB_TOKEN"
"""The environment variable the job entrypoint reads its job token from."""

_STATES = {
    "PENDING": BackendState.PENDING,
    "RUNNING": BackendState.RUNNING,
    "SUCCEEDED": BackendState.SUCCEEDED,
    "FAILED": BackendState.FAILED,
    "STOPPED": BackendState.STOPPED,
}


def pipeplan_exe() -> str:
    """The ``pipeplan`` script of this environment, by absolute path."""
    return str(Path(sys.executable).with_name("pipeplan"))


def entrypoint(submission: Submission) -> str:
    """The shell command a Ray Job runs for ``submission``."""
    args = [pipeplan_exe(), "job", "run", "--job", submission.job_id]
    return shlex.join([*args, "--server", submission.server_url])


def backend_status(info: JobInfo) -> BackendStatus:
    """Ray's view of a job in the protocol's words."""
    if info.status is None:
        return BackendStatus(BackendState.UNKNOWN, info.message)
    return BackendStatus(_STATES.get(info.status, BackendState.UNKNOWN), info.message)


class RayJobsBackend:
    """Jobs on the Ray cluster whose dashboard (Jobs API) is at ``address``."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self.jobs = RayJobs(address, token)

    def submit(self, submission: Submission) -> str:
        env = {JOB_TOKEN_ENV: submission.job_token}
        return self.jobs.submit(submission.job_id, entrypoint(submission), env)

    def stop(self, job_id: str) -> None:
        self.jobs.stop(job_id)

    def status(self, job_id: str) -> BackendStatus:
        return backend_status(self.jobs.info(job_id))

    def logs(self, job_id: str) -> str:
        return self.jobs.logs(job_id)

    def ready(self) -> str | None:
        return self.jobs.ping()


__all__ = ["JOB_TOKEN_ENV", "RayJobsBackend", "RayJobsError", "backend_status", "entrypoint"]
