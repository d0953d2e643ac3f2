"""What a live Ray cluster looks like to pipeplan: its nodes, their devices, as a spec.

A Ray node started by pipeplan advertises ``device:TYPE`` resources (count = how many
devices of the type it holds) and a marker resource ``pipeplan_node:NAME`` (DESIGN.md, data
formats; :func:`node_resources`). A node without a marker (a cluster started by other means)
is named ``node-<first 8 hex digits of its Ray node id>``. :func:`live_nodes` lists the
connected cluster's nodes and :func:`discover` describes it as a ``ClusterSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from pipeplan.core.cluster import ClusterSpec, DeviceType, Network, Node
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.resources import DEVICE_PREFIX, NODE_PREFIX, device_resource, node_resource

__all__ = [
    "DEFAULT_FLOPS",
    "DEVICE_PREFIX",
    "NODE_PREFIX",
    "LiveNode",
    "device_resource",
    "discover",
    "live_nodes",
    "node_resource",
    "node_resources",
    "nodes_from_ray",
]

DEFAULT_FLOPS = 1.0e12
"""FLOP/s given to a discovered device type that no reference spec describes."""


def node_resources(node: Node) -> dict[str, float]:
    """Custom resources a Ray node advertises for a spec node: its devices and its marker."""
    res = {device_resource(t): float(c) for t, c in node.devices.items() if c > 0}
    res[node_resource(node.name)] = 1.0
    return res


@dataclass(frozen=True)
class LiveNode:
    """A live Ray node: its pipeplan name, Ray node id and devices by type."""

    name: str
    node_id: str
    devices: Mapping[str, int]
    marked: bool
    memory_bytes: float = 0.0
    gpus: float = 0.0
    """Ray's ``GPU`` resource of the node: the GPUs Ray counted when the node started."""
    address: str = ""
    """The node's IP address (Ray's ``node:IP`` resource names it)."""


def nodes_from_ray(ray_nodes: Sequence[Mapping[str, Any]]) -> list[LiveNode]:
    """Turn ``ray.nodes()`` records into :class:`LiveNode` s (dead nodes left out)."""
    found = []
    for rec in ray_nodes:
        if not rec.get("Alive", False):
            continue
        res: Mapping[str, float] = rec.get("Resources", {})
        node_id = str(rec["NodeID"])
        markers = [k[len(NODE_PREFIX) :] for k in res if k.startswith(NODE_PREFIX)]
        devices = {
            k[len(DEVICE_PREFIX) :]: int(v) for k, v in res.items() if k.startswith(DEVICE_PREFIX)
        }
        name = markers[0] if markers else f"node-{node_id[:8]}"
        memory, gpus = float(res.get("memory", 0.0)), float(res.get("GPU", 0.0))
        address = str(rec.get("NodeManagerAddress", ""))
        found.append(LiveNode(name, node_id, devices, bool(markers), memory, gpus, address))
    return sorted(found, key=lambda n: n.name)


def live_nodes() -> list[LiveNode]:
    """The connected cluster's live nodes (needs :mod:`executor.runtime` connected, or a
    :class:`~executor.local_cluster.LocalCluster`)."""
    if not runtime.is_connected():
        raise ExecutorError(
            "not connected to a Ray cluster (use LocalCluster or executor.runtime.connect())"
        )
    return nodes_from_ray(ray.nodes())


def discover(
    reference: ClusterSpec | None = None,
    *,
    name: str = "discovered",
    default_flops: float = DEFAULT_FLOPS,
) -> ClusterSpec:
    """The connected cluster as a ``ClusterSpec``, from its nodes' ``device:TYPE`` resources.

    Ray does not know a device's speed or price: a type described by ``reference`` (the spec
    the cluster was started from) takes its numbers from there; any other type gets
    ``default_flops`` (so all such types look alike and nothing is emulated) and, as memory,
    its node's Ray memory divided by the node's device count. The network is
    ``reference.network`` or the defaults.
    """
    nodes = [n for n in live_nodes() if any(c > 0 for c in n.devices.values())]
    if not nodes:
        raise ExecutorError("the live cluster advertises no device:TYPE resources on any node")
    known = reference.device_types if reference is not None else {}
    types: dict[str, DeviceType] = {}
    for n in nodes:
        per_device_gb = max(n.memory_bytes / 1e9 / max(sum(n.devices.values()), 1), 0.1)
        for t in n.devices:
            if t in known:
                types[t] = known[t]
            elif t not in types or types[t].memory_gb > per_device_gb:
                types[t] = DeviceType(t, flops=default_flops, memory_gb=per_device_gb)
    network = reference.network if reference is not None else Network()
    spec_nodes = tuple(Node(n.name, {t: c for t, c in n.devices.items() if c > 0}) for n in nodes)
    return ClusterSpec(name, types, spec_nodes, network)
