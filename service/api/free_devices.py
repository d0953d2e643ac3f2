"""``devices: free``: a plan or search job planned on the devices no reservation holds.

When such a job is submitted, its ``cluster`` document is narrowed to what the live cluster
has free right now (per node and type: Ray's ``device:TYPE`` less what placement groups and
actors hold), read from the backend (:class:`~service.api.backend.ClusterSource`). The job
then plans on that cluster, and its result names the devices it assumed
(``assumed_devices``). Devices are counted, not named: a plan on ``n1/mid:0`` of a narrowed
cluster runs on whichever ``mid`` of ``n1`` is free when it starts.
"""

from __future__ import annotations

import math
from typing import Any

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.service.api.backend import ClusterSource, ClusterState, JobsBackend
from pipeplan.service.tasks.requests import RequestError, cluster_spec

FREE = "free"


def free_cluster(cluster: ClusterSpec, state: ClusterState) -> ClusterSpec:
    """``cluster`` with each node's devices cut to those free in ``state`` (a node the
    live cluster does not have, or has no free device on, is left out); RequestError when
    nothing is free."""
    live = {n.name: n for n in state.nodes if n.alive}
    nodes = []
    for node in cluster.nodes:
        seen = live.get(node.name)
        if seen is None:
            continue
        used = seen.devices_in_use or {}
        free = {
            t: min(n, math.floor(seen.devices.get(t, 0.0) - used.get(t, 0.0) + 1e-9))
            for t, n in node.devices.items()
        }
        free = {t: n for t, n in free.items() if n > 0}
        if free:
            nodes.append(Node(node.name, free, kind=node.kind))
    if not nodes:
        held = ", ".join(sorted(live)) or "none alive"
        raise RequestError(
            f"devices: 'free', but no device of cluster {cluster.name!r} is free now "
            f"(nodes: {held}); submit without it to queue for them"
        )
    return ClusterSpec(
        cluster.name,
        cluster.device_types,
        tuple(nodes),
        cluster.network,
        cluster.emulation_headroom,
        cluster.calibration,
    )


def narrowed(spec: dict[str, Any], backend: JobsBackend) -> dict[str, Any]:
    """``spec`` with its ``cluster`` narrowed to the free devices when it asks for
    ``devices: free`` (module docstring); RequestError (422) naming ``devices`` when the
    backend cannot say what is free."""
    if spec.get("devices") != FREE:
        return spec
    if not isinstance(backend, ClusterSource):
        raise RequestError("devices: 'free' needs a service on a live Ray cluster")
    state = backend.cluster_state()
    if state.error is not None:
        raise RequestError(f"devices: 'free': cannot tell what is free: {state.error}")
    cluster = free_cluster(cluster_spec(spec["cluster"]), state)
    return spec | {"cluster": cluster.to_dict()}
