"""A ``ray start`` cluster that outlives one command (``pipeplan cluster up`` / ``down``).

:func:`start_persistent` runs one ``ray start --block`` per spec node (the first is the
head) with token authentication (``RAY_AUTH_MODE=token``), loopback addresses
(``--node-ip-address=127.0.0.1`` kept as given by
:mod:`executor.local.loopback_ray_start`, dashboard on 127.0.0.1) and free ports, each node
advertising its ``device:TYPE`` resources and its ``pipeplan_node:NAME`` marker. It records
the address, the dashboard URL and every process it started (PID and start time) in
``STATE_DIR/cluster.json``; :func:`stop_persistent` stops exactly those processes (and their
children, such as Ray workers) and nothing else.

Every node gets a Ray temp folder of the cluster's own (``--temp-dir``), removed when the
cluster stops. Ray's job supervisor hands a Ray Job's driver the address of the newest
cluster recorded in its node's temp folder; in Ray's default one, shared by every cluster on
the machine, a cluster someone started later would take the drivers of this cluster's jobs.
``ray status --address ADDRESS`` and the dashboard show the cluster meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray  # noqa: F401  (importing Ray puts its bundled psutil on the path)

# isort: split
import psutil

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import node_resources

STATE_FILE = "cluster.json"


def default_state_dir() -> Path:
    """``$XDG_CACHE_HOME/pipeplan/cluster`` (``~/.cache/pipeplan/cluster`` by default)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pipeplan" / "cluster"


@dataclass(frozen=True)
class ProcessRecord:
    """A process we started: PID plus start time, so a reused PID is never signalled."""

    pid: int
    create_time: float
    name: str


@dataclass(frozen=True)
class PersistentCluster:
    """What :func:`start_persistent` started, as saved in the state file."""

    name: str
    address: str
    dashboard_url: str
    nodes: tuple[str, ...]
    processes: tuple[ProcessRecord, ...]
    log_dir: str
    temp_dir: str = ""
    """The nodes' Ray temp folder ("": Ray's default, for a state file written before)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = list(self.nodes)
        d["processes"] = [asdict(p) for p in self.processes]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PersistentCluster:
        procs = tuple(ProcessRecord(**p) for p in d["processes"])
        return cls(
            d["name"],
            d["address"],
            d["dashboard_url"],
            tuple(d["nodes"]),
            procs,
            d["log_dir"],
            d.get("temp_dir", ""),
        )


def _ray_exe() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else "ray"


def ray_start_command() -> list[str]:
    """``ray start`` through :mod:`executor.local.loopback_ray_start`, which keeps 127.0.0.1
    as given."""
    return [sys.executable, "-m", "pipeplan.executor.local.loopback_ray_start", "start"]


def _node_command(
    node: Node, head_port: int | None, address: str | None, object_store_mb: int, temp_dir: str
) -> list[str]:
    resources = node_resources(node)
    cmd = [
        *ray_start_command(),
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        "--num-cpus=1",
        f"--object-store-memory={object_store_mb * 2**20}",
        f"--resources={json.dumps(resources)}",
        f"--dashboard-agent-listen-port={runtime.free_port()}",
        f"--metrics-export-port={runtime.free_port()}",
        f"--runtime-env-agent-port={runtime.free_port()}",
        "--disable-usage-stats",
    ]
    if head_port is not None:
        cmd += [
            "--head",
            f"--port={head_port}",
            "--dashboard-host=127.0.0.1",
            f"--ray-client-server-port={runtime.free_port()}",
        ]
    else:
        cmd.append(f"--address={address}")
    return cmd


def node_env(head: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "token"
    # The in-process switch to loopback (executor.runtime.use_loopback) makes `ray start`
    # refuse worker nodes; here --node-ip-address=127.0.0.1, kept as given by
    # executor.local.loopback_ray_start, holds every node on loopback instead. The head
    # keeps the switch on: its processes (the dashboard agent's job manager, Ray Jobs'
    # drivers) join the cluster with ray.init, which would otherwise turn 127.0.0.1 into the
    # machine's external address, where nothing listens.
    env[runtime.LOOPBACK_ENV] = "0" if head else "1"
    return env


def wait_started(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until ``ray start`` reports its node up (nodes start one at a time: on a busy
    2-core machine, concurrent registrations can time out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise ExecutorError(f"ray start exited with {proc.returncode}; {log}:\n{tail}")
        if "Ray runtime started" in log.read_text(errors="replace"):
            return
        time.sleep(0.5)
    raise ExecutorError(f"ray start did not finish in {timeout_s:.0f} s; see {log}")


def ray_status(address: str, timeout_s: float = 60.0) -> str:
    """``ray status`` of a loopback cluster. (A plain ``ray status --address 127.0.0.1:P``
    would look for the GCS on the machine's external address: Ray's CLI rewrites 127.0.0.1
    unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which this sets.)"""
    env = {**node_env(), runtime.LOOPBACK_ENV: "0"}
    res = subprocess.run(
        [_ray_exe(), "status", f"--address={address}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    if res.returncode:
        raise ExecutorError(f"ray status --address={address} failed:\n{res.stderr[-2000:]}")
    return res.stdout


def _wait_nodes(address: str, count: int, procs: list[subprocess.Popen[bytes]], t: float) -> None:
    """Until ``ray status`` lists ``count`` active nodes."""
    deadline = time.monotonic() + t
    out = ""
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise ExecutorError(f"a ray start process exited with {dead[0].returncode}")
        try:
            out = ray_status(address)
        except (ExecutorError, subprocess.TimeoutExpired) as e:
            out = str(e)
        active = out.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in out else ""
        if active.count("node_") >= count:
            return
        time.sleep(1.0)
    raise ExecutorError(f"{count} nodes did not join in {t:.0f} s; last ray status:\n{out}")


def process_tree(pid: int) -> list[ProcessRecord]:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in procs:
        try:
            found.append(ProcessRecord(p.pid, p.create_time(), p.name()))
        except psutil.NoSuchProcess:
            continue
    return found


def launch(cmd: list[str], log: Path, head: bool = False) -> subprocess.Popen[bytes]:
    """Start one ``ray start --block`` in its own session, its output going to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, env=node_env(head), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def start_persistent(
    spec: ClusterSpec,
    state_dir: Path | None = None,
    *,
    object_store_mb: int = 500,
    timeout_s: float = 180.0,
) -> PersistentCluster:
    """Start a ``ray start`` cluster for ``spec`` and record it under ``state_dir``
    (default :func:`default_state_dir`). Refuses while a recorded cluster still runs."""
    state_dir = state_dir or default_state_dir()
    state_dir.mkdir(parents=True, exist_ok=True)
    if (state_dir / STATE_FILE).exists() and is_running(read_state(state_dir)):
        running = read_state(state_dir)
        raise ExecutorError(
            f"a pipeplan cluster is already running at {running.address} (state in "
            f"{state_dir}); stop it first"
        )
    runtime.ensure_token_auth()  # ray start --head refuses token mode without a token file
    port, dash = runtime.free_port(), runtime.free_port()
    address = f"127.0.0.1:{port}"
    # Short, under the system's temp folder: Ray's socket paths live below it.
    temp_dir = tempfile.mkdtemp(prefix="pipeplan-ray-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, node in enumerate(spec.nodes):
            cmd = _node_command(node, port if i == 0 else None, address, object_store_mb, temp_dir)
            if i == 0:
                cmd.append(f"--dashboard-port={dash}")
            log = state_dir / f"{node.name}.log"
            procs.append(launch(cmd, log, head=i == 0))
            wait_started(procs[-1], log, timeout_s)
        _wait_nodes(address, len(spec.nodes), procs, timeout_s)
    except BaseException:
        stop_processes([r for p in procs for r in process_tree(p.pid)], grace_s=10.0)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    records = tuple(r for p in procs for r in process_tree(p.pid))
    state = PersistentCluster(
        spec.name,
        address,
        f"http://127.0.0.1:{dash}",
        tuple(n.name for n in spec.nodes),
        records,
        str(state_dir),
        temp_dir,
    )
    (state_dir / STATE_FILE).write_text(json.dumps(state.to_dict(), indent=2))
    return state


def read_state(state_dir: Path | None = None) -> PersistentCluster:
    path = (state_dir or default_state_dir()) / STATE_FILE
    if not path.exists():
        raise ExecutorError(f"no pipeplan cluster recorded in {path.parent}")
    return PersistentCluster.from_dict(json.loads(path.read_text()))


def is_running(state: PersistentCluster) -> bool:
    """Whether any process of the recorded cluster still runs (same PID and start time)."""
    return any_alive(state.processes)


def status_persistent(state_dir: Path | None = None) -> str:
    """``ray status`` of the recorded cluster."""
    return ray_status(read_state(state_dir).address)


def stop_persistent(state_dir: Path | None = None, *, grace_s: float = 15.0) -> int:
    """Stop the recorded cluster's processes (and their children); returns how many ran."""
    state_dir = state_dir or default_state_dir()
    state = read_state(state_dir)
    stopped = stop_processes(list(state.processes), grace_s)
    if state.temp_dir:
        shutil.rmtree(state.temp_dir, ignore_errors=True)
    (state_dir / STATE_FILE).unlink()
    return stopped


def _matching(records: list[ProcessRecord]) -> list[Any]:
    """Live processes that are the recorded ones (same PID *and* start time) or children."""
    found: dict[int, Any] = {}
    for r in records:
        try:
            p = psutil.Process(r.pid)
            if abs(p.create_time() - r.create_time) > 0.01:
                continue
            found[p.pid] = p
            for c in p.children(recursive=True):
                found[c.pid] = c
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def any_alive(records: tuple[ProcessRecord, ...]) -> bool:
    return bool(_matching(list(records)))


def stop_processes(records: list[ProcessRecord], grace_s: float) -> int:
    """SIGTERM the ``ray start`` roots (they stop their node), then stragglers; SIGKILL last."""
    procs = _matching(records)
    count = len(procs)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        _, procs = psutil.wait_procs(procs, timeout=wait)
        if not procs:
            break
    return count
