"""``/v1/jobs/{id}/artifacts``: the files a job left, listed and served (API.md,
"Artifacts").

A job's artifacts are the files under its folder, ``JOBS_DIR/JOB_ID`` (a train job's
checkpoints and their manifests; a learned search's checkpoint and trained policy under
``search/``, :mod:`service.api.retries`), and ``plan.json``, the plan of its result, once it
has one. A ``plan`` job that succeeded also has ``gantt.png``, the cost model's schedule of
its plan (:func:`service.gantt.draw_gantt`, on the profile and cluster the dashboard draws
it from): drawn into the folder the first time the job's artifacts are read, then served
as a file. Hidden files (a name starting with ``.``: the temporary files a checkpoint or a
chart is written to before it is renamed) are not listed. A name is a path relative to the
folder; one that leads outside it (``..``, a link out) is 404, as a name that does not exist.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, status
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from pipeplan.service.api.auth import JobUserAuth
from pipeplan.service.api.deps import ProfilesDep, SettingsDep, StoreDep
from pipeplan.service.api.routes.jobs import JobId
from pipeplan.service.api.schemas import Job, JobKind, JobState, error_responses
from pipeplan.service.gantt import draw_gantt
from pipeplan.service.web.job_plan import ZooProfiles, plan_panel

log = logging.getLogger("pipeplan.service")

MAX_ARTIFACTS = 1000
"""The most files one listing names (the first in name order)."""
PLAN = "plan.json"
GANTT = "gantt.png"

router = APIRouter(
    prefix="/v1/jobs/{job_id}/artifacts",
    tags=["jobs"],
    responses=error_responses(401, 403, 404, 422),
)

ArtifactName = Annotated[
    str, PathParam(min_length=1, max_length=1024, description="The artifact's name")
]


class Artifact(BaseModel):
    """One artifact: its name (a path under the job's folder), size and kind (``file``: in
    the folder; ``result``: drawn from the job's result)."""

    name: str
    size_bytes: int
    kind: Literal["file", "result"]


def _files(folder: Path) -> list[Artifact]:
    if not folder.is_dir():
        return []
    found: list[Artifact] = []
    root = folder.resolve()
    for path in sorted(folder.rglob("*")):
        if len(found) >= MAX_ARTIFACTS:
            break
        hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if path.is_file() and not hidden and path.resolve().is_relative_to(root):
            name = path.relative_to(folder).as_posix()
            found.append(Artifact(name=name, size_bytes=path.stat().st_size, kind="file"))
    return found


def _plan_of(result: Any) -> dict[str, Any] | None:
    plan = result.get("plan") if isinstance(result, dict) else None
    return plan if isinstance(plan, dict) else None


def _gantt(job: Job, folder: Path, profiles: ZooProfiles | None) -> None:
    """Draw ``gantt.png`` of a succeeded plan job into ``folder`` if it is not there (the
    PNG written beside it, then renamed: a reader never sees a part). A plan the dashboard
    cannot simulate (no profile or cluster it can rebuild, too many microbatches) has none."""
    path = folder / GANTT
    if job.kind is not JobKind.PLAN or job.state is not JobState.SUCCEEDED or path.exists():
        return
    if _plan_of(job.result) is None:
        return
    estimate = plan_panel(job, profiles=profiles).estimate
    if estimate is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gantt.", suffix=".png", dir=folder)
    os.close(fd)
    try:
        draw_gantt(estimate, tmp, f"job {job.id}: {estimate.batch_time_s * 1e3:.2f} ms per batch")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _drawn(job: Job, folder: Path, profiles: ZooProfiles | None) -> None:
    try:
        _gantt(job, folder, profiles)
    except Exception:  # a chart that cannot be drawn leaves the other artifacts listed
        log.exception("artifacts: no Gantt chart for job %s", job.id)


@router.get("")
async def list_artifacts(
    job_id: JobId,
    _: JobUserAuth,
    store: StoreDep,
    settings: SettingsDep,
    profiles: ProfilesDep,
) -> list[Artifact]:
    """The job's artifacts: ``plan.json`` once its result has a plan, then the files of
    its folder in name order (at most 1,000; a succeeded plan job's ``gantt.png`` among
    them)."""
    job = await run_in_threadpool(store.get_job, job_id)
    listed = []
    if (plan := _plan_of(job.result)) is not None:
        size = len(JSONResponse(plan).body)
        listed.append(Artifact(name=PLAN, size_bytes=size, kind="result"))
    await run_in_threadpool(_drawn, job, settings.jobs_root / job_id, profiles)
    files = await run_in_threadpool(_files, settings.jobs_root / job_id)
    return listed + [f for f in files if f.name != PLAN]


@router.get(
    "/{name:path}",
    response_class=Response,
    responses={
        200: {
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": {"type": "object"}},
            }
        }
    },
)
async def get_artifact(
    job_id: JobId,
    name: ArtifactName,
    _: JobUserAuth,
    store: StoreDep,
    settings: SettingsDep,
    profiles: ProfilesDep,
) -> Response:
    """One artifact by its name (:func:`list_artifacts`)."""
    job = await run_in_threadpool(store.get_job, job_id)
    if name == PLAN and (plan := _plan_of(job.result)) is not None:
        return JSONResponse(plan)
    if name == GANTT:
        await run_in_threadpool(_drawn, job, settings.jobs_root / job_id, profiles)
    folder = (settings.jobs_root / job_id).resolve()
    path = (folder / name).resolve()
    if not path.is_relative_to(folder) or not path.is_file():
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"name: job {job_id!r} has no artifact {name!r}"
        )
    return FileResponse(path)
