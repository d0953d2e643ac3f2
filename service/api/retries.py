"""Searches that outlive their Ray Job: their checkpoints, and handing them over again.

**Checkpoints.** A ``plan`` job whose planner is a learned search (:data:`CHECKPOINTING`:
TAPP, PPO) checkpoints into its own folder, ``JOBS_DIR/JOB_ID/search`` (the planner options
``checkpoint_dir``, and ``checkpoint_every``: every iteration for a measured search, whose
iterations are runs; the planner's default otherwise), unless its spec names a folder of its
own. :func:`search_spec` writes that into the spec when the job is submitted, so every
attempt of the job runs with it, and ``GET /v1/jobs/{id}/artifacts`` lists the checkpoint and
the trained policy.

**Retries.** The reconcile (:func:`service.api.app.reconcile_job`) finds jobs whose work
ended without a result. Such a job's work was **lost** when the backend says its Ray Job
``failed`` (a driver killed, a node lost: the job posted no error of its own, or it would
have ended ``failed`` then) or knows no such job any more; a job the backend ``stopped``
(cancelled, or past its deadline) or that exited cleanly was not lost. A lost ``plan`` or
``compare`` job with retries left (``attempt <= retries``) is handed over again by
:func:`retry`: a new submission id (``JOBID-a2`` ...), a new job token (the lost attempt's can
post no more), back to ``queued``, and an ``attempt`` event naming the attempt, the reason and
the checkpoint it resumes from. The new attempt runs the same spec, so a search goes on from
the checkpoint in its folder (:mod:`agents.resume`); one lost before its first checkpoint,
and a ``compare`` job, start again from the beginning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeplan.agents.resume import CHECKPOINT_FILES
from pipeplan.service.api.auth import hash_token, new_job_token
from pipeplan.service.api.backend import (
    BackendState,
    JobsBackend,
    Submission,
    attempt_id,
    first_seq,
)
from pipeplan.service.api.schemas import Job, JobKind, JobState
from pipeplan.service.api.store import JobFinished, Store

log = logging.getLogger("pipeplan.service")

CHECKPOINTING = frozenset(CHECKPOINT_FILES)
"""The planners whose searches checkpoint (and resume)."""
SEARCH_FOLDER = "search"
"""The folder of a job's folder its search checkpoints into by default."""
MEASURED_CHECKPOINT_EVERY = 1
"""A measured search checkpoints after every iteration (each is a few runs on the cluster)."""
RETRIED_KINDS = frozenset({JobKind.PLAN, JobKind.COMPARE})


def search_folder(jobs_root: Path, job_id: str) -> Path:
    return jobs_root / job_id / SEARCH_FOLDER


def search_spec(spec: dict[str, Any], job_id: str, jobs_root: Path) -> dict[str, Any]:
    """The spec a ``plan`` job runs with: a learned search's ``checkpoint_dir`` defaulted to
    the job's folder (and ``checkpoint_every`` to 1 for a measured one); other specs as
    they are."""
    planner, given = spec.get("planner"), spec.get("options") or {}
    if not isinstance(planner, str) or planner not in CHECKPOINTING or not isinstance(given, dict):
        return spec  # not a learned search (or not a spec at all: the checks say why)
    options = dict(given)
    if options.get("checkpoint_dir") is None:
        options["checkpoint_dir"] = str(search_folder(jobs_root, job_id))
        if spec.get("reward") == "measured" and options.get("checkpoint_every") is None:
            options["checkpoint_every"] = MEASURED_CHECKPOINT_EVERY
    return {**spec, "options": options}


def checkpoint_of(job: Job) -> str | None:
    """The checkpoint file a new attempt of ``job`` goes on from, if its folder holds one."""
    planner = job.spec.get("planner")
    options = job.spec.get("options")
    if (
        job.kind is not JobKind.PLAN
        or planner not in CHECKPOINTING
        or not isinstance(options, dict)
    ):
        return None
    folder = options.get("resume") or options.get("checkpoint_dir")
    if not isinstance(folder, str):
        return None
    path = Path(folder) / CHECKPOINT_FILES[str(planner)]
    return str(path) if path.is_file() else None


def was_lost(state: BackendState, unknown: bool) -> bool:
    """Whether work that ended without a result was lost (module docstring): the backend
    says it ``failed``, or (``unknown``) has had no such job for longer than a submission
    takes to show."""
    return state is BackendState.FAILED or unknown


def retries_left(job: Job) -> bool:
    return job.kind in RETRIED_KINDS and job.attempt <= job.retries


Forget = Callable[[str], None] | None
"""Told the id of a job whose token changed (the service's cache of token hashes forgets
it, so the new attempt's token is read from the store and the old one is refused)."""


def retry(
    job: Job,
    store: Store,
    backend: JobsBackend,
    server_url: str,
    reason: str,
    forget: Forget = None,
) -> bool:
    """Hand ``job`` over again (module docstring); False when it is not open any more at its
    attempt (it ended meanwhile, or another reconcile handed it over). A backend that
    refuses the new attempt ends the job ``failed`` saying so."""
    attempt = job.attempt + 1
    submission_id = attempt_id(job.id, attempt)
    resumes_from = checkpoint_of(job)
    event = {
        "attempt": attempt,
        "attempts": job.retries + 1,
        "submission_id": submission_id,
        "reason": reason,
        "resumes_from": resumes_from,
    }
    token = new_job_token()
    if not store.begin_attempt(
        job, submission_id, hash_token(token), first_seq(attempt) - 1, event
    ):
        return False
    if forget is not None:
        forget(job.id)
    log.info("job %s: attempt %d as %s (%s)", job.id, attempt, submission_id, reason)
    try:
        got = backend.submit(Submission(job.id, server_url, token, attempt))
    except Exception as e:  # whatever the backend raises, the job fails with its reason
        with contextlib.suppress(JobFinished):  # it ended meanwhile (cancelled)
            store.finish(
                job.id,
                JobState.FAILED,
                error=f"retry: attempt {attempt}: submit: {type(e).__name__}: {e}",
            )
        return True
    if got != submission_id:  # the planner pool runs it: no Ray Job
        store.set_ray_job_id(job.id, got)
    return True
