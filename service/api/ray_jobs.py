"""The production :class:`~service.api.backend.JobsBackend`: every job is a Ray Job.

:class:`RayJobsBackend` adapts :class:`executor.ray_jobs.RayJobs` (Ray's
``JobSubmissionClient``, with Ray's token) to the backend protocol. A job's entrypoint is the
pipeplan CLI of this environment, called by absolute path (a bare ``python`` in a Ray Job
does not find this venv): ``pipeplan job run --job ID --server URL``, with the job's own
token in its environment (``PIPEPLAN_JOB_TOKEN``), never the API token. The submission id is
the pipeplan job id, so a repeated submission starts nothing; a job handed over again after
its Ray Job died (``retries``) is submitted as ``JOBID-a2``, ``JOBID-a3`` ... (Ray keeps an
id for good), and the service asks for the current one through
:class:`~service.api.backend.AttemptsBackend`.

For the dashboard's cluster page, :meth:`RayJobsBackend.cluster_state` reads the nodes and
what they use from the same Ray dashboard over HTTP (its state API ``/api/v0/nodes`` and
``/api/cluster_status``, with Ray's token), so the service still never imports Ray.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from pipeplan.executor.ray_jobs import JobInfo, RayJobs, RayJobsError, ray_token
from pipeplan.executor.resources import DEVICE_PREFIX, NODE_PREFIX
from pipeplan.service.api.backend import (
    BackendState,
    BackendStatus,
    ClusterState,
    NodeState,
    Submission,
)

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


CLUSTER_TIMEOUT_S = 5.0
"""How long the cluster page waits for Ray's dashboard."""
MAX_NODES_LISTED = 1000


def _key(resource: str) -> str:
    """A resource name as Ray's ``/api/cluster_status`` spells it, made comparable: that
    route camel-cases its keys (``pipeplan_node:n0`` comes back ``pipeplanNode:N0``)."""
    return resource.replace("_", "").lower()


def _in_use(usage: Mapping[str, Any], resource: str) -> float | None:
    """Used amount of ``resource`` in one node's ``{name: [used, total]}``; None if absent."""
    wanted = _key(resource)
    for name, pair in usage.items():
        if _key(name) == wanted and isinstance(pair, list | tuple) and pair:
            return float(pair[0])
    return None


def node_state(record: Mapping[str, Any], usage: Mapping[str, Any] | None) -> NodeState:
    """One record of Ray's ``/api/v0/nodes`` (and the node's entry of ``usageByNode``, when
    Ray reported one) as a :class:`NodeState`."""
    node_id = str(record.get("node_id", ""))
    resources: Mapping[str, float] = record.get("resources_total") or {}
    markers = [k[len(NODE_PREFIX) :] for k in resources if k.startswith(NODE_PREFIX)]
    devices = {
        k[len(DEVICE_PREFIX) :]: float(v)
        for k, v in resources.items()
        if k.startswith(DEVICE_PREFIX)
    }
    in_use = None
    if usage is not None:
        in_use = {t: _in_use(usage, DEVICE_PREFIX + t) or 0.0 for t in devices}
    return NodeState(
        name=markers[0] if markers else f"node-{node_id[:8]}",
        node_id=node_id,
        alive=record.get("state") == "ALIVE",
        address=str(record.get("node_ip") or ""),
        head=bool(record.get("is_head_node")),
        devices=devices,
        devices_in_use=in_use,
        cpus=float(resources.get("CPU", 0.0)),
        cpus_in_use=None if usage is None else _in_use(usage, "CPU"),
    )


def nodes_from_dashboard(
    nodes_doc: Mapping[str, Any], status_doc: Mapping[str, Any] | None
) -> tuple[NodeState, ...]:
    """The nodes in the answers of ``/api/v0/nodes`` and ``/api/cluster_status`` (``None``
    when the latter failed), sorted alive first, by name. A node the status does not cover
    has nothing known to be in use (``devices_in_use`` None), rather than nothing in use."""
    records = nodes_doc.get("data", {}).get("result", {}).get("result", [])
    by_node: Mapping[str, Any] = {}
    if status_doc is not None:
        report = status_doc.get("data", {}).get("clusterStatus", {}).get("loadMetricsReport")
        by_node = (report or {}).get("usageByNode") or {}
    nodes = [node_state(r, by_node.get(str(r.get("node_id")))) for r in records]
    return tuple(sorted(nodes, key=lambda n: (not n.alive, n.name)))


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


class RayJobsBackend:
    """Jobs on the Ray cluster whose dashboard (Jobs API) is at ``address``."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self.token = token
        self.jobs = RayJobs(address, token)

    def submit(self, submission: Submission) -> str:
        env = {JOB_TOKEN_ENV: submission.job_token}
        return self.jobs.submit(submission.submission_id, entrypoint(submission), env)

    def stop(self, job_id: str) -> None:
        self.jobs.stop(job_id)

    def status(self, job_id: str) -> BackendStatus:
        return backend_status(self.jobs.info(job_id))

    def logs(self, job_id: str) -> str:
        return self.jobs.logs(job_id)

    def ready(self) -> str | None:
        return self.jobs.ping()

    def _get(self, client: httpx.Client, path: str) -> Mapping[str, Any]:
        r = client.get(path)
        if r.status_code != 200:
            raise RayJobsError(f"{path} answered {r.status_code}: {r.text[:200].strip()}")
        doc = r.json()
        if not isinstance(doc, dict):
            raise RayJobsError(f"{path} answered with something other than a JSON object")
        return doc

    def dashboard_url(self) -> str | None:
        return self.address.rstrip("/")

    def cluster_state(self) -> ClusterState:
        """The nodes Ray knows and the ``device:TYPE`` resources they hold and use, read
        from Ray's dashboard; a failure is named in ``error``, never raised."""
        url = self.address.rstrip("/")
        token = self.token or ray_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with httpx.Client(base_url=url, headers=headers, timeout=CLUSTER_TIMEOUT_S) as c:
                nodes = self._get(c, f"/api/v0/nodes?limit={MAX_NODES_LISTED}")
                try:
                    status: Mapping[str, Any] | None = self._get(c, "/api/cluster_status")
                except (httpx.HTTPError, RayJobsError, ValueError):
                    status = None  # the nodes without what they use
        except (httpx.HTTPError, RayJobsError, ValueError) as e:
            why = str(e) if isinstance(e, RayJobsError) else _line(e)
            return ClusterState(error=f"Ray dashboard at {url}: {why}")
        return ClusterState(nodes_from_dashboard(nodes, status))


__all__ = [
    "JOB_TOKEN_ENV",
    "RayJobsBackend",
    "RayJobsError",
    "backend_status",
    "entrypoint",
    "nodes_from_dashboard",
]
