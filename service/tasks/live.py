"""Where real work runs, for the use-cases that run models (``run``, ``search``, ``profile``
with ``measure``, the demo): a connected cluster and the model to build on it.

By default a use-case starts a :class:`~executor.local_cluster.LocalCluster` for its cluster
spec (on loopback) and stops it when done; an ``address`` (``HOST:PORT``, loopback or a head
across the network, whose other machines ran ``pipeplan cluster join``) joins a running Ray
cluster instead, and ``auto`` the one ``pipeplan cluster up`` started (its state lives in
``$XDG_CACHE_HOME/pipeplan/cluster``, with the spec it was started from). On a joined
cluster the spec still names the cluster the plan was made for (its device types' flops set
the emulated slowdowns); without one the spec saved by ``cluster up`` is used, else the live
cluster as :func:`~executor.live_cluster.discover` sees it (nothing emulated).

**The cluster they run on.** Work never starts a private cluster where it already has one:
without an ``address``, a process that is connected to Ray keeps that cluster, and a Ray
Job's entrypoint (``RAY_ADDRESS`` set by Ray's job supervisor, as ``ray.init()`` itself
reads it) joins its job's cluster. Only a process with neither starts one of its own. So
PPO's env runners, a parallel reward's tasks and a measured reward's stage actors all run
on the cluster the search runs on, whether it came from ``--address``, the job or this
process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.profile import ModelProfile
from pipeplan.executor import runtime
from pipeplan.executor.emulation import is_emulated
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import discover
from pipeplan.executor.local.persistent_cluster import default_state_dir, is_running, read_state
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measured_profile import call_sizes, measure_profile
from pipeplan.executor.model import ModelSource
from pipeplan.models.spec import InputDtype
from pipeplan.service.tasks.common import RequestError
from pipeplan.service.tasks.progress import Reporter
from pipeplan.service.tasks.requests import ModelFields, check_source

SPEC_FILE = "spec.json"
"""Next to the persistent cluster's state file: the spec ``cluster up`` started."""

JOB_ADDRESS_ENV = "RAY_ADDRESS"
"""Set by Ray's job supervisor for a Ray Job's entrypoint: its cluster's address."""

RUN_OBJECT_STORE_MB = 1024
"""Object store per Ray node of the clusters the use-cases start: activations and the
replicas' all-reduce chunks pass through it (AlexNet's gradients alone are 230 MB), and a
store that spills to disk makes the spilling dominate the measured batch time. Shared
memory is only taken as it is used."""


def state_dir() -> Path:
    """Where ``pipeplan cluster up`` records its cluster."""
    return default_state_dir()


def saved_spec() -> ClusterSpec | None:
    """The spec ``cluster up`` started, if it saved one."""
    path = state_dir() / SPEC_FILE
    return ClusterSpec.load(path) if path.exists() else None


def resolve_address(address: str) -> str:
    """``auto``: the address of the running ``pipeplan cluster up`` cluster."""
    if address != "auto":
        return address
    try:
        state = read_state(state_dir())
    except ExecutorError:
        raise RequestError(
            f"address auto: no pipeplan cluster is running (none recorded in {state_dir()}); "
            "start one with `pipeplan cluster up --spec C`"
        ) from None
    if not is_running(state):
        raise RequestError(
            f"address auto: the cluster recorded in {state_dir()} ({state.address}) is not "
            "running; `pipeplan cluster down` clears the record"
        )
    return state.address


def quiet_ray_logs() -> None:
    """Ray's start-up chatter (token auth on, address file overwritten) is not for users."""
    for name in ("ray", "ray._private", "ray.cluster_utils"):
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def _local(spec: ClusterSpec, reporter: Reporter) -> Iterator[ClusterSpec]:
    cluster = LocalCluster(spec, object_store_mb=RUN_OBJECT_STORE_MB)
    with reporter.step(f"starting local cluster {spec.name!r} ({len(spec.nodes)} Ray nodes)"):
        cluster.start()
    reporter.note(
        f"local cluster {spec.name!r} up in {cluster.startup_s:.0f} s "
        f"({', '.join(cluster.node_names)})"
    )
    try:
        yield spec
    finally:
        cluster.stop()


def job_address() -> str | None:
    """The cluster of the Ray Job this process is the entrypoint of (``RAY_ADDRESS``), if
    any."""
    return os.environ.get(JOB_ADDRESS_ENV) or None


@contextmanager
def _joined(spec: ClusterSpec | None, reference: ClusterSpec | None) -> Iterator[ClusterSpec]:
    """The spec to run plans for on the connected cluster: ``spec``, else the live cluster
    as :func:`~executor.live_cluster.discover` sees it (``reference`` naming its types)."""
    if spec is not None:
        yield spec
    else:
        yield discover(reference, name=reference.name if reference else "discovered")


@contextmanager
def live_cluster(
    spec: ClusterSpec | None, address: str | None, reporter: Reporter
) -> Iterator[ClusterSpec]:
    """A connected Ray cluster for the ``with`` body: the cluster at ``address``
    (disconnected afterwards); without one, the cluster this process is connected to, else
    its Ray Job's (``RAY_ADDRESS``, disconnected afterwards), else a new local cluster for
    ``spec`` (stopped afterwards). Yields the spec to run plans for (module docstring)."""
    quiet_ray_logs()
    if address is None and runtime.is_connected():
        with _joined(spec, None) as live:
            yield live
        return
    if address is None and job_address() is None:
        if spec is None:
            raise RequestError("cluster: required unless address joins a running cluster")
        with _local(spec, reporter) as live:
            yield live
        return
    if address is None:
        runtime.connect_in_job()
        reference = spec
    else:
        target = resolve_address(address)
        reference = spec if spec is not None else (saved_spec() if address == "auto" else None)
        runtime.connect(target)
    try:
        with _joined(spec, reference) as live:
            yield live
    finally:
        runtime.shutdown()


@contextmanager
def ray_for_search(address: str | None, reporter: Reporter) -> Iterator[None]:
    """The Ray cluster a search's workers run on (PPO's env runners, a parallel reward's
    tasks): the cluster at ``address``, else the one this process is connected to, else its
    Ray Job's (``RAY_ADDRESS``), else a single-node local Ray started for the search and
    stopped after it. A cluster joined here is left afterwards."""
    quiet_ray_logs()
    if address is not None:
        runtime.connect(resolve_address(address))
        started = True
    elif runtime.is_connected():
        started = False
    elif job_address() is not None:
        runtime.connect_in_job()
        started = True
    else:
        with reporter.step("starting a local Ray for the search's workers"):
            started = runtime.ensure()
    try:
        yield
    finally:
        if started:
            runtime.shutdown()


def model_source(
    model: str | None,
    input_size: int | None,
    profile: ModelProfile | None,
    seed: int = 0,
    *,
    options: Mapping[str, Any] | None = None,
    input_shape: Sequence[int] | None = None,
    input_dtype: str | None = None,
    example: str | None = None,
) -> ModelSource:
    """What the executor builds: ``model`` (a zoo name, ``package.module:factory`` or
    ``hf:ClassName``, with its ``options`` and input), or the zoo model a profile names (its
    name, and its input's last dimension as the input size). The reference's form is
    checked here (:func:`~service.tasks.requests.check_source`); nothing is imported (a
    factory is imported where the model is built)."""
    check_source(
        model,
        input_size,
        profile,
        options=options,
        input_shape=input_shape,
        input_dtype=input_dtype,
        example=example,
    )
    if model is not None:
        return ModelSource(
            model,
            input_size,
            seed=seed,
            options=dict(options or {}),
            input_shape=None if input_shape is None else tuple(input_shape),
            input_dtype=cast(InputDtype | None, input_dtype),
            example_ref=example,
        )
    assert profile is not None  # one of the two, checked above
    size = profile.input_shape[-1] if profile.input_shape else None
    return ModelSource(profile.name, size, seed=seed)


def source_of(request: ModelFields, profile: ModelProfile | None = None) -> ModelSource:
    """:func:`model_source` of a request's model fields (``model``, ``input_size``,
    ``seed`` where it has them, and :class:`~service.tasks.requests.ModelFields`)."""
    return model_source(
        getattr(request, "model", None),
        getattr(request, "input_size", None),
        profile,
        getattr(request, "seed", 0),
        options=request.model_options,
        input_shape=request.input_shape,
        input_dtype=request.input_dtype,
        example=request.example,
    )


def measure_on_cluster(
    source: ModelSource,
    spec: ClusterSpec,
    reporter: Reporter,
    device_types: list[str] | None = None,
    global_batch: int | None = None,
) -> ModelProfile:
    """The model's profile timed on the connected cluster, with timings for
    ``device_types`` (default: every type of ``spec``); at the batch sizes plans of
    ``global_batch`` run (:func:`~executor.measured_profile.call_sizes`) when it is given."""
    types = device_types or sorted(spec.counts_by_type())
    t0 = time.perf_counter()
    with reporter.step(f"measuring the profile of {source.name} on the cluster"):
        if global_batch is None:
            prof = measure_profile(source, spec, device_types=types)
        else:
            sizes = call_sizes(global_batch)
            prof = measure_profile(source, spec, device_types=types, batch_sizes=sizes)
    emulated = spec.emulated_slower or is_emulated(spec, types)
    reporter.note(
        f"measured the profile of {source.name} on the cluster in "
        f"{time.perf_counter() - t0:.0f} s (timings for {', '.join(types)}"
        + (", EMULATED: scaled by each type's slowdown)" if emulated else ")")
    )
    return prof
