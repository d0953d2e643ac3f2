"""A train job's folders: where its checkpoints go, and which checkpoint it resumes from.

Every job has a folder of its own, ``JOBS_DIR/JOB_ID`` (the setting ``jobs_dir``). A train
job whose request names no ``checkpoint_dir`` writes its checkpoints into
``JOBS_DIR/JOB_ID/checkpoints``, so that what it trained is kept where the service can find
it again. ``resume_from`` names a checkpoint (an absolute path: a step folder, or a
checkpoint directory and its latest step), or an earlier train job by its id: that job's
checkpoint directory, and so its latest checkpoint. Both are resolved here, when the job is
submitted, and the job's stored spec holds the paths it runs with; the job itself can read
only its own spec, never another job's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipeplan.service.api.schemas import JobKind
from pipeplan.service.api.store import JobNotFound, Store
from pipeplan.service.tasks.requests import RequestError

JOB_REF = re.compile(r"^pp-[0-9a-f]{16}$")
"""A pipeplan job id, as :func:`~service.api.store.jobs.new_job_id` draws them."""
CHECKPOINTS = "checkpoints"
"""The folder of a job's folder that its checkpoints go into by default."""


def is_job_ref(text: str) -> bool:
    """Whether ``resume_from`` names a job (by id) rather than a checkpoint path."""
    return bool(JOB_REF.match(text))


def checkpoint_folder(jobs_root: Path, job_id: str) -> Path:
    """Where the train job ``job_id`` writes its checkpoints by default."""
    return jobs_root / job_id / CHECKPOINTS


def resumed_folder(store: Store, job_id: str) -> str:
    """The checkpoint directory of the train job ``job_id``; :class:`RequestError` naming
    ``resume_from`` when there is no such job, it is not a train job, or it has written
    nothing (yet) where it writes its checkpoints."""
    try:
        job = store.get_job(job_id)
    except JobNotFound:
        raise RequestError(f"resume_from: no job {job_id!r}") from None
    if job.kind is not JobKind.TRAIN:
        raise RequestError(
            f"resume_from: job {job_id!r} is a {job.kind.value} job, not a train job"
        )
    folder = job.spec.get("checkpoint_dir")
    if not isinstance(folder, str) or not Path(folder).is_dir():
        raise RequestError(
            f"resume_from: job {job_id!r} ({job.state.value}) has no checkpoint yet "
            f"(none in {folder!r})"
        )
    return folder


def train_spec(spec: dict[str, Any], job_id: str, store: Store, jobs_root: Path) -> dict[str, Any]:
    """The spec the train job ``job_id`` runs with: ``checkpoint_dir`` defaulted to its
    folder's, ``resume_from`` a path (a job id resolved to that job's checkpoints)."""
    out = dict(spec)
    if out.get("checkpoint_dir") is None:
        out["checkpoint_dir"] = str(checkpoint_folder(jobs_root, job_id))
    resume = out.get("resume_from")
    if isinstance(resume, str) and is_job_ref(resume):
        out["resume_from"] = resumed_folder(store, resume)
    return out
