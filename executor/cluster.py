"""A real multi-node Ray cluster on this machine, and what a live cluster looks like.

:class:`LocalCluster` starts one Ray node per node of a :class:`~core.cluster.ClusterSpec`
in this process (``ray.cluster_utils.Cluster``): each advertises its devices as
``device:TYPE`` resources and a ``pipeplan_node:NAME`` marker (:mod:`executor.placement`),
binds loopback only, and runs with Ray's token authentication on. Every device is the same
CPU; speed differences are **emulated** by the stage workers, which make each forward and
backward last ``slowdown x`` its CPU time (sleeping the rest,
:func:`executor.stage.emulation_sleep`), with ``slowdown = fastest flops / type flops``
(:func:`slowdown`). Numbers measured on such a
cluster are emulated and say so.

:func:`connect` joins a running cluster instead, :func:`discover` describes it as a
``ClusterSpec``, and :func:`start_persistent` / :func:`status_persistent` /
:func:`stop_persistent` (from :mod:`executor.persistent`) run a ``ray start`` cluster that
outlives one command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
from ray.cluster_utils import Cluster

from core.cluster import ClusterSpec, DeviceType, Network, Node
from core.errors import PipeplanError
from executor.awake import KeepAwake
from executor.errors import ExecutorError
from executor.persistent import start_persistent, status_persistent, stop_persistent
from executor.placement import LiveNode, device_resource, node_resource, nodes_from_ray

__all__ = [
    "LocalCluster",
    "connect",
    "discover",
    "live_nodes",
    "node_resources",
    "slowdown",
    "start_persistent",
    "status_persistent",
    "stop_persistent",
]

DEFAULT_FLOPS = 1.0e12
"""FLOP/s given to a discovered device type that no reference spec describes."""


def slowdown(spec: ClusterSpec, device_type: str) -> float:
    """Emulation factor of a device type: ``headroom x fastest flops / its flops`` (the
    spec's ``emulation_headroom`` for the fastest type, usually 1)."""
    if device_type not in spec.device_types:
        raise PipeplanError(
            f"device type {device_type!r}: not in cluster {spec.name!r} "
            f"(types: {', '.join(spec.device_types)})"
        )
    return spec.emulation_headroom * spec.fastest_flops() / spec.device_types[device_type].flops


def node_resources(node: Node) -> dict[str, float]:
    """Custom resources a Ray node advertises for a spec node: its devices and its marker."""
    res = {device_resource(t): float(c) for t, c in node.devices.items() if c > 0}
    res[node_resource(node.name)] = 1.0
    return res


def ensure_token_auth() -> None:
    """Turn Ray's token authentication on for clusters this process starts, as ``ray.init()``
    does for a new local cluster: ``RAY_AUTH_MODE=token`` (unless set explicitly) and a token
    in ``~/.ray/auth_token`` (created when missing)."""
    from ray._private.authentication import authentication_token_setup as auth

    auth.enable_token_auth_by_default()
    auth.ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def _require_loopback() -> None:
    """Ray read ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when first imported; if it was imported
    before :mod:`executor`, apply the same switch (loopback addresses) now."""
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        ray_constants.ENABLE_RAY_CLUSTER = False


class LocalCluster:
    """One Ray node per spec node on this machine; a context manager that stops them all.

    The first spec node is the head (the driver attaches there). ``num_cpus`` is Ray's
    logical CPU count per node: stage actors ask for none, so it only bounds Ray's pool of
    task workers (1 suits a 2-core machine). ``object_store_mb`` caps each node's store.
    ``keep_awake`` (default: when some device type is emulated slower than this machine):
    keep the cores out of idle while the cluster is up (:class:`executor.awake.KeepAwake`),
    so that a compute right after an emulation sleep runs at the speed it was profiled at.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        object_store_mb: int = 200,
        num_cpus: float = 1,
        connect: bool = True,
        system_config: dict[str, Any] | None = None,
        keep_awake: bool | None = None,
    ) -> None:
        if object_store_mb < 75:
            raise PipeplanError(f"object_store_mb: Ray needs >= 75, got {object_store_mb}")
        self.spec = spec
        self.object_store_mb = object_store_mb
        self.num_cpus = num_cpus
        self.connect = connect
        self.system_config = system_config
        emulated = any(slowdown(spec, t) > 1.0 for t in spec.device_types)
        self.keep_awake = KeepAwake() if (emulated if keep_awake is None else keep_awake) else None
        self._cluster: Cluster | None = None
        self._nodes: dict[str, Any] = {}
        self._address_file: tuple[Path, str | None] | None = None
        self.startup_s = 0.0

    # --- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._cluster is not None:
            raise ExecutorError(f"cluster {self.spec.name!r}: already started")
        if self.connect and ray.is_initialized():
            raise ExecutorError(
                "this process is already connected to a Ray cluster; call ray.shutdown() first"
            )
        _require_loopback()
        ensure_token_auth()
        self._address_file = _remember_address_file()
        t0 = time.perf_counter()
        head, *workers = self.spec.nodes
        head_args: dict[str, Any] = {**self._node_args(head), "include_dashboard": False}
        if self.system_config:
            head_args["_system_config"] = self.system_config
        try:
            if self.keep_awake is not None:
                self.keep_awake.start()
            self._cluster = Cluster(initialize_head=True, head_node_args=head_args)
            self._nodes[head.name] = self._cluster.head_node
            for node in workers:
                self._nodes[node.name] = self._cluster.add_node(**self._node_args(node))
            self._cluster.wait_for_nodes()
            if self.connect:
                ray.init(address=self._cluster.address, logging_level=logging.WARNING)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> None:
        """Disconnect and stop every node this cluster started (idempotent)."""
        if self.connect and ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
            self._nodes.clear()
        if self._address_file is not None:
            _restore_address_file(*self._address_file)
            self._address_file = None
        if self.keep_awake is not None:
            self.keep_awake.stop()

    def _node_args(self, node: Node) -> dict[str, Any]:
        return {
            "num_cpus": self.num_cpus,
            "object_store_memory": self.object_store_mb * 2**20,
            "resources": node_resources(node),
        }

    # --- queries ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self._cluster is None:
            raise ExecutorError(f"cluster {self.spec.name!r}: not started")
        return str(self._cluster.address)

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(self._nodes)

    def slowdown(self, device_type: str) -> float:
        return slowdown(self.spec, device_type)

    def remove_node(self, name: str) -> None:
        """Kill one (non-head) node's processes, as if the machine died. For failure tests."""
        if self._cluster is None or name not in self._nodes:
            raise ExecutorError(f"node {name!r}: not running (nodes: {', '.join(self._nodes)})")
        if name == self.spec.nodes[0].name:
            raise ExecutorError(f"node {name!r}: the head node (the driver's) cannot be removed")
        self._cluster.remove_node(self._nodes.pop(name))


def _remember_address_file() -> tuple[Path, str | None]:
    """``ray.cluster_utils`` overwrites, then deletes, Ray's "current cluster" file, which
    other Ray users on this machine may rely on; keep its content to put it back."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    return path, path.read_text() if path.exists() else None


def _restore_address_file(path: Path, content: str | None) -> None:
    if content is None:
        return
    with contextlib.suppress(OSError):
        path.write_text(content)


# --- a live cluster -------------------------------------------------------------------------


def connect(address: str) -> None:
    """Attach this process to a running cluster (``host:port`` of its head), token auth on."""
    if ray.is_initialized():
        raise ExecutorError("this process is already connected to a Ray cluster")
    _require_loopback()
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    ray.init(address=address, logging_level=logging.WARNING)


def live_nodes() -> list[LiveNode]:
    """The connected cluster's live nodes (needs :func:`connect` or a :class:`LocalCluster`)."""
    if not ray.is_initialized():
        raise ExecutorError("not connected to a Ray cluster (use LocalCluster or connect())")
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
