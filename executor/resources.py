"""The custom resources a pipeplan node advertises on Ray, named without Ray.

A node's devices are ``device:TYPE`` (count = how many, DESIGN.md's cluster format) and the
node itself is marked ``pipeplan_node:NAME``. :mod:`executor.live_cluster` starts and reads
nodes with them; the service's cluster page reads them from Ray's dashboard over HTTP
(:mod:`service.api.ray_jobs`) and so needs the names, not Ray.
"""

from __future__ import annotations

DEVICE_PREFIX = "device:"
NODE_PREFIX = "pipeplan_node:"


def device_resource(device_type: str) -> str:
    return f"{DEVICE_PREFIX}{device_type}"


def node_resource(node: str) -> str:
    return f"{NODE_PREFIX}{node}"
