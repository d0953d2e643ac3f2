"""A real multi-node Ray cluster on this machine, started in this process.

:class:`LocalCluster` starts one Ray node per node of a :class:`~core.cluster.ClusterSpec`
(``ray.cluster_utils.Cluster``, through :mod:`executor.runtime`: loopback only, Ray's token
authentication on): each advertises its devices as ``device:TYPE`` resources and a
``pipeplan_node:NAME`` marker (:func:`executor.live_cluster.node_resources`). Every device is
the same CPU; speed differences are **emulated** by the stage workers
(:mod:`executor.emulation`), and numbers measured on such a cluster say so.

A cluster that outlives one command is :mod:`executor.local.persistent_cluster`'s; a running
cluster is joined with :func:`executor.runtime.connect`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from ray.cluster_utils import Cluster

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.errors import PipeplanError
from pipeplan.executor import runtime
from pipeplan.executor.accelerators import local_gpus
from pipeplan.executor.emulation import is_emulated, slowdown
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import node_resources
from pipeplan.executor.local.keep_awake import KeepAwake

__all__ = ["LocalCluster"]


class LocalCluster:
    """One Ray node per spec node on this machine; a context manager that stops them all.

    The first spec node is the head (the driver attaches there). ``num_cpus`` is Ray's
    logical CPU count per node: stage actors ask for none, so it only bounds Ray's pool of
    task workers (1 suits a 2-core machine). ``object_store_mb`` caps each node's store.
    ``keep_awake`` (default: when some device type is emulated slower than this machine):
    keep the cores out of idle while the cluster is up
    (:class:`executor.local.keep_awake.KeepAwake`), so that a compute right after an
    emulation sleep runs at the speed it was profiled at.
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
        awake = is_emulated(spec) if keep_awake is None else keep_awake
        self.keep_awake = KeepAwake() if awake else None
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
        if self.connect and runtime.is_connected():
            raise ExecutorError(
                f"cluster {self.spec.name!r}: this process is already connected to a Ray "
                "cluster; call executor.runtime.shutdown() first"
            )
        self._address_file = _remember_address_file()
        t0 = time.perf_counter()
        head, *workers = self.spec.nodes
        head_args: dict[str, Any] = {
            **self._node_args(head),
            "include_dashboard": False,
            "dashboard_port": runtime.free_port(),
        }
        if self.system_config:
            head_args["_system_config"] = self.system_config
        try:
            if self.keep_awake is not None:
                self.keep_awake.start()
            self._cluster = runtime.start_cluster(head_args)
            self._nodes[head.name] = self._cluster.head_node
            for node in workers:
                self._nodes[node.name] = self._cluster.add_node(**self._node_args(node))
            self._cluster.wait_for_nodes()
            if self.connect:
                runtime.connect(self._cluster.address)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def stop(self) -> None:
        """Disconnect and stop every node this cluster started (idempotent)."""
        if self.connect:
            runtime.shutdown()
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
            "num_gpus": local_gpus(self.spec, node),
            "object_store_memory": self.object_store_mb * 2**20,
            "resources": node_resources(node),
            "dashboard_agent_listen_port": runtime.free_port(),
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

    def add_node(self, node: Node) -> None:
        """Start one more Ray node for ``node`` (its devices and marker), as a machine that
        joins the cluster would; it is stopped with the others. For elastic tests."""
        if self._cluster is None:
            raise ExecutorError(f"cluster {self.spec.name!r}: not started")
        if node.name in self._nodes:
            raise ExecutorError(f"node {node.name!r}: already running")
        self._nodes[node.name] = self._cluster.add_node(**self._node_args(node))
        self._cluster.wait_for_nodes()


def _remember_address_file() -> tuple[Path, str | None]:
    """``ray.cluster_utils`` overwrites, then deletes, Ray's "current cluster" file, which
    other Ray users on this machine may rely on; keep its content to put it back."""
    path = runtime.address_file()
    return path, path.read_text() if path.exists() else None


def _restore_address_file(path: Path, content: str | None) -> None:
    if content is None:
        return
    with contextlib.suppress(OSError):
        path.write_text(content)
