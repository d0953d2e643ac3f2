"""Ray's Jobs API (``JobSubmissionClient``) for the service: submit, stop, status, logs.

The one place outside :mod:`executor.runtime` that talks to Ray for the service: the
service's backend (:mod:`service.api.ray_jobs`) adapts :class:`RayJobs` to its protocol and
never imports Ray itself.

**Token.** Ray 2.60's dashboard (where the Jobs API lives) answers 401 without Ray's token
and 403 with a wrong one; every request carries ``Authorization: Bearer <token>``, the token
read as Ray reads it (:func:`ray_token`). The client is built on first use and again after a
connection error, so a backend made while the cluster starts or restarts recovers.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.executor.errors import ExecutorError

if TYPE_CHECKING:  # Ray is imported where a client is made: the API process starts without it
    from ray.job_submission import JobSubmissionClient

__all__ = ["JobInfo", "RayJobs", "RayJobsError", "ray_token"]

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


class RayJobsError(ExecutorError):
    """The Jobs API did not answer, or refused a request; the message says which and why."""


def ray_token() -> str | None:
    """Ray's token as Ray looks for it: ``RAY_AUTH_TOKEN``, else the file at
    ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``; None when there is none."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class JobInfo:
    """What Ray says of one job: its status (``JobStatus`` name), message, or ``None``
    status when Ray has no job of that id."""

    status: str | None
    message: str = ""

    @property
    def terminal(self) -> bool:
        from ray.job_submission import JobStatus

        return self.status is not None and JobStatus(self.status).is_terminal()


def _line(e: BaseException) -> str:
    """An error's first line (Ray's authentication errors run to a paragraph)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _not_found(e: Exception) -> bool:
    return "status code 404" in str(e) or "does not exist" in str(e)


class RayJobs:
    """The Jobs API of the cluster whose dashboard is at ``address`` (``http://HOST:PORT``)."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._token = token
        self._client: JobSubmissionClient | None = None
        self._lock = threading.Lock()

    def _headers(self) -> dict[str, str]:
        token = self._token or ray_token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def client(self) -> JobSubmissionClient:
        """The connected client (made now if there is none: Ray is imported then)."""
        from ray.job_submission import JobSubmissionClient

        with self._lock:
            if self._client is None:
                try:
                    self._client = JobSubmissionClient(self.address, headers=self._headers())
                except Exception as e:  # Ray raises ConnectionError, RuntimeError, auth errors
                    raise RayJobsError(
                        f"Ray Jobs API at {self.address}: {type(e).__name__}: {_line(e)}"
                    ) from None
            return self._client

    def _forget(self) -> None:
        with self._lock:
            self._client = None

    def submit(self, submission_id: str, entrypoint: str, env: dict[str, str]) -> str:
        """Start ``entrypoint`` as job ``submission_id`` with ``env`` in its environment;
        an id Ray holds already starts nothing (the id is returned all the same)."""
        try:
            return str(
                self.client().submit_job(
                    entrypoint=entrypoint,
                    submission_id=submission_id,
                    runtime_env={"env_vars": env},
                )
            )
        except RayJobsError:
            raise
        except Exception as e:
            if "already exists" in str(e):
                return submission_id
            self._forget()
            raise RayJobsError(f"submitting job {submission_id!r}: {_line(e)}") from None

    def stop(self, job_id: str) -> None:
        """Ask Ray to stop the job; no error when it has finished or is unknown."""
        try:
            self.client().stop_job(job_id)
        except RayJobsError:
            raise
        except Exception as e:
            if _not_found(e):
                return
            self._forget()
            raise RayJobsError(f"stopping job {job_id!r}: {_line(e)}") from None

    def info(self, job_id: str) -> JobInfo:
        """The job's status and message (``JobInfo(None)`` when Ray has no such job)."""
        try:
            details = self.client().get_job_info(job_id)
        except RayJobsError:
            raise
        except Exception as e:
            if _not_found(e):
                return JobInfo(None, f"Ray has no job {job_id!r}")
            self._forget()
            raise RayJobsError(f"status of job {job_id!r}: {_line(e)}") from None
        return JobInfo(str(details.status.value), details.message or "")

    def logs(self, job_id: str) -> str:
        """The job's log text ("" when Ray has none)."""
        try:
            return str(self.client().get_job_logs(job_id))
        except RayJobsError:
            raise
        except Exception as e:
            if _not_found(e):
                return ""
            self._forget()
            raise RayJobsError(f"logs of job {job_id!r}: {_line(e)}") from None

    def ping(self) -> str | None:
        """None when the Jobs API answers, else why not."""
        try:
            self.client().get_version()
        except Exception as e:
            self._forget()
            return (
                str(e)
                if isinstance(e, RayJobsError)
                else f"Ray Jobs API at {self.address}: {_line(e)}"
            )
        return None
