"""``pipeplan serve``: the control plane (FastAPI under uvicorn), its jobs run as Ray Jobs.

Settings come from ``PIPEPLAN_*`` variables, overridden by the flags
(:class:`~service.api.settings.Settings`). Without ``--ray-address`` the service runs its
jobs on an **embedded** cluster (``--cluster``, default the ``local-hetero`` preset): a
``ray start`` cluster with its dashboard (where Ray's Jobs API lives) on free loopback
ports, recorded under ``--state-dir``
(:mod:`executor.local.persistent_cluster`). It is a cluster of its own processes, so it
outlives a crash of the service; a service started again with the same state directory
reattaches to it, and a clean shutdown (Ctrl-C, SIGTERM) stops it, leaving no Ray process.

Jobs that need no device run in the service's **planner pool** (``pool_size`` workers, Ray
actors in the ``ray_namespace`` namespace, started with the service on its cluster and ended
with it; :mod:`service.api.pool`): the embedded cluster's, or the one ``pool_address`` names.

The API's socket is bound before the embedded cluster starts: a port that is taken is an
error at once, with no cluster started, and none of Ray's processes (which take free ports
of their own while they start) can take the service's port in the meantime.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer
import uvicorn

from pipeplan.executor.local.persistent_cluster import (
    STATE_FILE,
    PersistentCluster,
    default_state_dir,
    is_running,
    read_state,
    start_persistent,
    stop_persistent,
)
from pipeplan.executor.worker_pool import RayWorkers
from pipeplan.service.api.app import create_app
from pipeplan.service.api.backend import ClusterState
from pipeplan.service.api.pool import WARM_MODULES, PlannerPool
from pipeplan.service.api.ray_jobs import RayJobsBackend
from pipeplan.service.api.settings import Settings, SettingsError, check_bind, resolve_token
from pipeplan.service.cli.console import clean_errors, cluster_ref, say
from pipeplan.service.tasks.common import cluster_spec
from pipeplan.service.tasks.live import quiet_ray_logs

HANDLED = (signal.SIGINT, signal.SIGTERM)
OBJECT_STORE_MB = 500
"""Object store per node of the embedded cluster (as ``pipeplan cluster up``)."""


def serve_state_dir() -> Path:
    """Where the embedded cluster is recorded: beside ``pipeplan cluster up``'s record, not
    in it (``cluster down`` never stops the service's cluster)."""
    return default_state_dir().parent / "serve-cluster"


class Shutdown(Exception):
    """SIGTERM or SIGINT, after uvicorn has shut the server down gracefully."""


def _shutdown(signum: int, frame: FrameType | None) -> None:
    """Raise :class:`Shutdown` once; later signals are ignored, so that the embedded
    cluster's stop runs to its end (``kill -9`` still ends everything)."""
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)
    raise Shutdown(signal.Signals(signum).name)


def catch_shutdown() -> None:
    """From now on SIGINT and SIGTERM raise :class:`Shutdown` (uvicorn, which takes them
    while it serves, shuts down gracefully and then raises the signal again)."""
    for sig in HANDLED:
        signal.signal(sig, _shutdown)


@contextmanager
def embedded_cluster(ref: str, state_dir: Path) -> Iterator[PersistentCluster]:
    """The embedded cluster for the ``with`` body: the one recorded in ``state_dir`` if it
    still runs (reattached), else a new one for ``ref`` (a preset or a cluster file).
    Stopped when the body ends, however it ends, short of the process being killed."""
    state: PersistentCluster | None = None
    if (state_dir / STATE_FILE).exists():
        recorded = read_state(state_dir)
        if is_running(recorded):
            state = recorded
            say(f"reattached to the embedded Ray cluster at {state.address}")
        else:
            stop_persistent(state_dir)  # clears the record of a cluster that died
    if state is None:
        spec = cluster_spec(cluster_ref(ref))
        nodes = f"{len(spec.nodes)} node{'s' if len(spec.nodes) != 1 else ''}"
        say(f"starting the embedded Ray cluster {spec.name!r} ({nodes}) ...")
        quiet_ray_logs()
        state = start_persistent(spec, state_dir, object_store_mb=OBJECT_STORE_MB)
    try:
        yield state
    finally:
        say(f"stopping the embedded Ray cluster at {state.address}")
        stop_persistent(state_dir)


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening; uvicorn listens on it).

    Raises :class:`SettingsError` naming the address when it cannot be bound (taken, or not
    an address of this machine)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SettingsError(f"host: {host!r} cannot be resolved ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SettingsError(f"port: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


def default_pool_size(cluster: ClusterState) -> int:
    """The cluster's CPUs minus one (the rest for the jobs' drivers and Ray), at least one
    and at most 64: how many cost-model jobs run at once when ``pool_size`` is not set."""
    cpus = sum(n.cpus for n in cluster.nodes if n.alive)
    return max(1, min(64, int(cpus) - 1))


def planner_pool(
    settings: Settings, gcs_address: str | None, backend: RayJobsBackend
) -> PlannerPool | None:
    """The planner pool the settings ask for, on the cluster at ``gcs_address`` (the
    embedded one's; ``pool_address`` wins); None when ``pool_size`` is 0 or no address is
    known (said). Without ``pool_size``, sized by :func:`default_pool_size` from what
    ``backend``'s cluster has now."""
    address = settings.pool_address or gcs_address
    if settings.pool_size == 0:
        return None
    if address is None:
        say("planner pool: off (joining by ray_address: set pool_address, the GCS address)")
        return None
    size = settings.pool_size
    if size is None:
        cluster = backend.cluster_state()
        size = default_pool_size(cluster)
        if cluster.error:
            say(f"planner pool: cluster CPUs unknown ({cluster.error}); {size} worker")
    workers = RayWorkers(address, settings.ray_namespace, WARM_MODULES, prefix="planner")
    return PlannerPool(workers, size)


def run_server(
    settings: Settings,
    jobs_address: str,
    listener: socket.socket,
    gcs_address: str | None = None,
) -> None:
    """The app on uvicorn, on the bound ``listener``, until SIGINT or SIGTERM (then
    :class:`Shutdown`)."""
    backend = RayJobsBackend(jobs_address)
    pool = planner_pool(settings, gcs_address, backend)
    app = create_app(settings, backend=backend, pool=pool)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info")
    say(f"pipeplan service at {settings.public_url} (jobs on Ray at {jobs_address})")
    if pool is not None:
        say(f"planner pool: {pool.size} worker{'s' if pool.size != 1 else ''} (starting)")
    uvicorn.Server(config).run(sockets=[listener])


def settings_from(flags: dict[str, Any]) -> Settings:
    """The environment's settings with the flags that were given on top."""
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def announce_token(settings: Settings) -> None:
    token = resolve_token(settings)
    if token.path is None:
        say("API token: from PIPEPLAN_API_TOKEN")
    else:
        made = " (generated now)" if token.generated else ""
        say(f"API token file: {token.path}{made}")


@clean_errors
def serve_command(
    host: Annotated[str | None, typer.Option(help="address to bind [127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="port to listen on [8321]")] = None,
    db: Annotated[str | None, typer.Option(help="SQLAlchemy database URL")] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="join this Ray cluster's dashboard (Jobs API) address")
    ] = None,
    cluster: Annotated[
        str | None, typer.Option(help="embedded cluster: preset or file [local-hetero]")
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="where the embedded cluster is recorded")
    ] = None,
) -> None:
    """Run the service: the REST API, jobs as Ray Jobs (see API.md)."""
    if ray_address is not None and cluster is not None:
        say("error: --ray-address and --cluster: give one (join a cluster, or embed one)")
        raise typer.Exit(2)
    flags = {"host": host, "port": port, "db": db, "ray_address": ray_address, "cluster": cluster}
    try:
        settings = settings_from(flags)
        check_bind(settings)
        announce_token(settings)
        listener = bind_listener(settings.host, settings.port)
    except SettingsError as e:
        say(f"error: {e}")
        raise typer.Exit(2) from None
    with listener:
        catch_shutdown()
        try:
            if settings.ray_address is not None:
                run_server(settings, settings.ray_address, listener)
                return
            with embedded_cluster(settings.cluster, state_dir or serve_state_dir()) as state:
                say(f"Ray dashboard (Jobs API) at {state.dashboard_url}")
                run_server(settings, state.dashboard_url, listener, state.address)
        except Shutdown as e:
            say(f"stopped ({e})")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
