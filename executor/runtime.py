"""The one owner of Ray in this process: start, connect, shut down, and Ray's private API.

Every ``ray.init`` / ``ray.shutdown`` of the project goes through here, and so does every
call into ``ray._private`` (and ``ray._common``): when Ray renames one, this is the only
file to change.

**Loopback.** Ray decides which address a node binds from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, which it reads once, into
``ray._private.ray_constants.ENABLE_RAY_CLUSTER``, when it is first imported; unless that is
off, a node started on this machine binds the machine's external address (DESIGN.md, "Facts
about this environment"). :func:`use_loopback` turns it off both ways -- in the environment,
for the node and worker processes about to start, and in the already imported constant, for
this process -- and is called right before a local cluster starts or a loopback address is
joined. So no import needs a side effect, and importing Ray first changes nothing.

**Ports.** Ray's default ports (6379, 8265, 52365) may belong to another Ray on this
machine: a cluster started here gets free ports (:func:`free_port`) where Ray takes them.

**Token authentication** stays on (Ray 2.60's default): a cluster started here gets
``RAY_AUTH_MODE=token`` and a token in ``~/.ray/auth_token`` (created when missing); joining
a cluster needs its token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or that file).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import ray
from ray._common.utils import get_ray_address_file
from ray._private import ray_constants, services
from ray._private.authentication import authentication_token_setup as token_setup
from ray._private.state import actors as actor_table
from ray._private.state import available_resources_per_node
from ray.cluster_utils import Cluster
from ray.exceptions import AuthenticationError

from pipeplan.executor.errors import ExecutorError

__all__ = [
    "LOOPBACK_ENV",
    "actors",
    "address_file",
    "connect",
    "connect_in_job",
    "ensure",
    "ensure_token_auth",
    "free_port",
    "free_resources_by_node",
    "is_connected",
    "keep_given_node_ip",
    "keep_signal_handlers",
    "shutdown",
    "start_cluster",
    "start_local",
    "use_loopback",
]

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch: ``0`` keeps the nodes this machine starts on 127.0.0.1."""
FAILURE_HANDLER_ENV = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost"})
DEFAULT_NUM_CPUS = 2
DEFAULT_OBJECT_STORE_MEMORY = 200 * 2**20
"""Bytes of object store of :func:`start_local`'s node (Ray's own default is 30% of RAM)."""
MIN_OBJECT_STORE_MEMORY = 75 * 2**20
"""The smallest object store Ray accepts."""


def use_loopback() -> None:
    """Keep Ray nodes started from now on (in this process and its children) on loopback."""
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def keep_signal_handlers() -> None:
    """Leave this process's signal handling alone when it connects as a driver from now on:
    Ray otherwise installs its failure signal handler, which takes SIGTERM before the
    process's own handler and makes a process that shuts down gracefully on SIGTERM (the
    service) abort at exit."""
    os.environ[FAILURE_HANDLER_ENV] = "1"
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` (an address of this machine) right now: Ray's default
    ports may be another Ray's on this machine, so every port of a node started here is
    given explicitly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ensure_token_auth(create_token_if_missing: bool = True) -> None:
    """Turn Ray's token authentication on, as ``ray.init()`` does for a new local cluster:
    ``RAY_AUTH_MODE=token`` unless set explicitly, and a token (created when missing, if
    ``create_token_if_missing``; otherwise a missing token is an :class:`ExecutorError`)."""
    token_setup.enable_token_auth_by_default()
    try:
        token_setup.ensure_token_if_auth_enabled(None, create_token_if_missing)
    except AuthenticationError as e:
        raise ExecutorError(
            "token authentication is on but no token was found (set RAY_AUTH_TOKEN or "
            f"RAY_AUTH_TOKEN_PATH, or write ~/.ray/auth_token): {e}"
        ) from None


def is_connected() -> bool:
    """Whether this process is connected to a Ray cluster."""
    return bool(ray.is_initialized())


def _refuse_if_connected(action: str) -> None:
    if is_connected():
        raise ExecutorError(
            f"{action}: this process is already connected to a Ray cluster; call "
            "executor.runtime.shutdown() first"
        )


def _is_loopback(address: str) -> bool:
    """Whether ``address`` (``host:port``, or a URL) names this machine's loopback."""
    host = urlsplit(address if "://" in address else f"//{address}").hostname
    return host in LOOPBACK_HOSTS


def start_local(
    num_cpus: int = DEFAULT_NUM_CPUS, object_store_memory: int = DEFAULT_OBJECT_STORE_MEMORY
) -> None:
    """Start a new single-node Ray in this process (never a ``ray start`` cluster found on
    disk) and connect to it: loopback, token authentication, no dashboard. ``num_cpus``
    bounds Ray's task workers; ``object_store_memory`` (bytes) caps its object store."""
    if num_cpus < 1:
        raise ExecutorError(f"num_cpus: must be >= 1, got {num_cpus!r}")
    if object_store_memory < MIN_OBJECT_STORE_MEMORY:
        raise ExecutorError(
            f"object_store_memory: Ray needs >= {MIN_OBJECT_STORE_MEMORY} bytes, "
            f"got {object_store_memory!r}"
        )
    _refuse_if_connected("start_local")
    use_loopback()
    ensure_token_auth()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        object_store_memory=object_store_memory,
        include_dashboard=False,
        dashboard_port=free_port(),
        log_to_driver=False,
        configure_logging=False,
        logging_level=logging.WARNING,
    )


def connect(address: str) -> None:
    """Join a running cluster at ``address`` (``host:port`` of its head's GCS): a ``ray
    start`` cluster or a KubeRay one, on this machine or across the network. A loopback
    address keeps this process on loopback; any other head is joined as it is (Ray finds
    this machine's node of the cluster, e.g. one ``pipeplan cluster join`` started)."""
    _refuse_if_connected(f"connect {address!r}")
    if _is_loopback(address):
        use_loopback()
    ensure_token_auth(create_token_if_missing=False)
    ray.init(address=address, logging_level=logging.WARNING)


def connect_in_job() -> None:
    """Join the cluster this process runs in as a Ray Job's entrypoint (``ray.init()`` with
    no address: Ray's job supervisor sets ``RAY_ADDRESS`` for the entrypoint)."""
    address = os.environ.get("RAY_ADDRESS", "")
    if not address:
        raise ExecutorError(
            "connect_in_job: RAY_ADDRESS is not set, so this is not a Ray Job's entrypoint; "
            "use connect(address) or start_local()"
        )
    _refuse_if_connected("connect_in_job")
    if _is_loopback(address):
        use_loopback()
    ray.init(logging_level=logging.WARNING)


def ensure(num_cpus: int = DEFAULT_NUM_CPUS) -> bool:
    """Use the cluster this process is connected to, or :func:`start_local` one with
    ``num_cpus``; True if it started one (the caller then owns it and shuts it down)."""
    if is_connected():
        return False
    start_local(num_cpus=num_cpus)
    return True


def shutdown() -> None:
    """Disconnect from the cluster (and stop it, if :func:`start_local` started it)."""
    if is_connected():
        ray.shutdown()


# --- for LocalCluster, the pipeline and `ray start` -------------------------------------------


def start_cluster(head_args: dict[str, Any]) -> Cluster:
    """A ``ray.cluster_utils.Cluster`` with its head node (``head_args``), on loopback and
    with token authentication; the caller adds the other nodes and connects."""
    use_loopback()
    ensure_token_auth()
    return Cluster(initialize_head=True, head_node_args=head_args)


def address_file() -> Path:
    """Ray's "current cluster" file, which ``ray.cluster_utils`` overwrites and deletes."""
    return Path(get_ray_address_file(None))


def free_resources_by_node() -> dict[str, dict[str, float]]:
    """Resources free right now on each live node of the connected cluster, by Ray node id."""
    return {
        str(node_id): {str(k): float(v) for k, v in free.items()}
        for node_id, free in available_resources_per_node().items()
    }


def actors() -> list[dict[str, Any]]:
    """Every actor the connected cluster knows (alive or dead), as Ray's state records
    (``ActorClassName``, ``State``, ``Address`` ...)."""
    return [dict(a) for a in actor_table().values()]


def _given_host(host: str) -> str:
    return host


def keep_given_node_ip() -> None:
    """Make this process's Ray keep a node address as given: Ray turns 127.0.0.1 into the
    machine's external address (``services.resolve_ip_for_localhost``) unless
    :data:`LOOPBACK_ENV` is ``0``, and with that setting ``ray start`` refuses worker nodes."""
    services.resolve_ip_for_localhost = _given_host
