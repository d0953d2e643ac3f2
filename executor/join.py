"""A machine joins a running Ray cluster as one node of a spec (``pipeplan cluster join``).

:func:`join` runs ``ray start --address HEAD:PORT --block`` on this machine for one spec node:
token authentication on (``RAY_AUTH_MODE=token``; the cluster's token must be here already,
``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), the node's devices
advertised as ``device:TYPE`` resources with its ``pipeplan_node:NAME`` marker
(:func:`executor.live_cluster.node_resources`, what the executor pins stages by), as many
GPUs as the node has CUDA devices in the spec (after checking that this machine has them,
:func:`executor.accelerators.check_machine`), and every port Ray would otherwise take by
default given explicitly (free ports of the node's address).

The node's address (``node_ip``) defaults to the address this machine's routing table uses
to reach the head (:func:`route_ip`): the one the head and the other nodes can reach it at
on that network. The node binds that address, loopback or not: a machine that joins a
cluster over the network is reachable on it by design (keep such networks private, and the
token secret); clusters this machine starts for itself stay on loopback
(:mod:`executor.local_cluster`, :mod:`executor.local.persistent_cluster`).

What :func:`join` started (process ids with their start times) is recorded in
``STATE_DIR/NAME.json`` (default :func:`default_join_dir`); :func:`leave` stops exactly
those processes (and their children, such as the node's Ray workers) and nothing else.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.errors import PipeplanError
from pipeplan.executor import runtime
from pipeplan.executor.accelerators import check_machine
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import node_resources
from pipeplan.executor.local.persistent_cluster import (
    ProcessRecord,
    any_alive,
    default_state_dir,
    launch,
    process_tree,
    ray_start_command,
    stop_processes,
    wait_started,
)

__all__ = [
    "JoinedNode",
    "default_join_dir",
    "join",
    "joined_nodes",
    "leave",
    "parse_address",
    "route_ip",
]


def default_join_dir() -> Path:
    """``$XDG_CACHE_HOME/pipeplan/joined`` (``~/.cache/pipeplan/joined`` by default)."""
    return default_state_dir().parent / "joined"


@dataclass(frozen=True)
class JoinedNode:
    """What :func:`join` started, as saved in ``NAME.json``."""

    name: str
    address: str
    """The head's ``HOST:PORT``."""
    node_ip: str
    resources: dict[str, float]
    gpus: int
    processes: tuple[ProcessRecord, ...]
    log: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["processes"] = [asdict(p) for p in self.processes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JoinedNode:
        procs = tuple(ProcessRecord(**p) for p in d["processes"])
        return cls(
            d["name"],
            d["address"],
            d["node_ip"],
            dict(d["resources"]),
            int(d["gpus"]),
            procs,
            d["log"],
        )

    @property
    def running(self) -> bool:
        """Whether a process it started still runs (same PID and start time)."""
        return any_alive(self.processes)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for an IPv6 host) of a head's GCS, checked."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PipeplanError(
            f"address: expected HOST:PORT of the head (e.g. 10.0.0.1:6380), got {address!r}"
        )
    return host, int(port)


def route_ip(address: str) -> str:
    """This machine's address on the route to ``address`` (``HOST:PORT``): what the OS picks
    as the source of a packet to the head (no packet is sent)."""
    host, port = parse_address(address)
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(target)
            return str(s.getsockname()[0])
    except OSError as e:
        raise ExecutorError(f"address {address!r}: no route to the head from here ({e})") from None


def _check_ip(node_ip: str) -> str:
    try:
        return str(ipaddress.ip_address(node_ip))
    except ValueError:
        raise PipeplanError(
            f"node_ip: expected an IP address of this machine, got {node_ip!r}"
        ) from None


def _spec_node(spec: ClusterSpec, name: str) -> Node:
    for node in spec.nodes:
        if node.name == name:
            return node
    raise PipeplanError(
        f"node: {name!r} is not a node of cluster {spec.name!r} "
        f"(nodes: {', '.join(n.name for n in spec.nodes)})"
    )


def _state_file(state_dir: Path, name: str) -> Path:
    return state_dir / f"{name}.json"


def _node_command(
    address: str, node: Node, node_ip: str, gpus: int, object_store_mb: int, num_cpus: int | None
) -> list[str]:
    host, port = parse_address(address)
    head = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    cmd = [
        *ray_start_command(),  # keeps a loopback node_ip as given
        "--block",
        f"--address={head}",
        f"--node-ip-address={node_ip}",
        f"--num-gpus={gpus}",
        f"--object-store-memory={object_store_mb * 2**20}",
        f"--resources={json.dumps(node_resources(node))}",
        f"--node-manager-port={runtime.free_port(node_ip)}",
        f"--object-manager-port={runtime.free_port(node_ip)}",
        f"--dashboard-agent-listen-port={runtime.free_port(node_ip)}",
        f"--dashboard-agent-grpc-port={runtime.free_port(node_ip)}",
        f"--metrics-export-port={runtime.free_port(node_ip)}",
        f"--runtime-env-agent-port={runtime.free_port(node_ip)}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    return cmd


def join(
    address: str,
    spec: ClusterSpec,
    node_name: str,
    *,
    node_ip: str | None = None,
    state_dir: Path | None = None,
    object_store_mb: int = 500,
    num_cpus: int | None = None,
    timeout_s: float = 120.0,
) -> JoinedNode:
    """Start a Ray node on this machine for spec node ``node_name`` and join it to the cluster
    at ``address`` (module docstring); ``num_cpus`` None lets Ray count this machine's."""
    parse_address(address)
    node = _spec_node(spec, node_name)
    if object_store_mb < 75:
        raise PipeplanError(f"object_store_mb: Ray needs >= 75, got {object_store_mb}")
    if num_cpus is not None and num_cpus < 0:
        raise PipeplanError(f"num_cpus: must be >= 0, got {num_cpus}")
    gpus = check_machine(spec, node)
    ip = _check_ip(node_ip) if node_ip is not None else route_ip(address)
    state_dir = state_dir or default_join_dir()
    state_dir.mkdir(parents=True, exist_ok=True)
    path = _state_file(state_dir, node.name)
    if path.exists() and JoinedNode.from_dict(json.loads(path.read_text())).running:
        raise ExecutorError(
            f"node {node.name!r} has already joined from this machine (state in {path}); "
            "`pipeplan cluster leave` first"
        )
    runtime.ensure_token_auth(create_token_if_missing=False)
    cmd = _node_command(address, node, ip, gpus, object_store_mb, num_cpus)
    log = state_dir / f"{node.name}.log"
    proc = launch(cmd, log)
    try:
        wait_started(proc, log, timeout_s)
    except BaseException:
        stop_processes(process_tree(proc.pid), grace_s=10.0)
        raise
    joined = JoinedNode(
        node.name,
        address,
        ip,
        node_resources(node),
        gpus,
        tuple(process_tree(proc.pid)),
        str(log),
    )
    path.write_text(json.dumps(joined.to_dict(), indent=2))
    return joined


def joined_nodes(state_dir: Path | None = None) -> list[JoinedNode]:
    """Every node :func:`join` recorded in ``state_dir``, by name."""
    state_dir = state_dir or default_join_dir()
    if not state_dir.is_dir():
        return []
    return [
        JoinedNode.from_dict(json.loads(p.read_text())) for p in sorted(state_dir.glob("*.json"))
    ]


def leave(
    node_name: str | None = None, state_dir: Path | None = None, *, grace_s: float = 15.0
) -> list[tuple[JoinedNode, int]]:
    """Stop the node(s) :func:`join` started from this machine (``node_name``, else all of
    them): only their recorded processes and those processes' children. Returns each node
    with how many of its processes were running."""
    state_dir = state_dir or default_join_dir()
    nodes = joined_nodes(state_dir)
    if node_name is not None:
        nodes = [n for n in nodes if n.name == node_name]
        if not nodes:
            known = ", ".join(n.name for n in joined_nodes(state_dir)) or "none"
            raise ExecutorError(
                f"node {node_name!r}: not joined from this machine (joined: {known}; "
                f"state in {state_dir})"
            )
    stopped = []
    for n in nodes:
        stopped.append((n, stop_processes(list(n.processes), grace_s)))
        _state_file(state_dir, n.name).unlink(missing_ok=True)
    return stopped
