"""Pinning actors to devices: a plan's feasibility on the live cluster, and actor options.

Every such actor (stage workers and profilers alike) runs in a process started with
:data:`WORKER_ENV`.

A stage replica for device ``NAME/TYPE:INDEX`` asks for one ``device:TYPE`` and a sliver of
``NAME``'s marker resource (:mod:`executor.live_cluster`), so Ray puts it on that node and
never puts more actors of a type on a node than the node has devices. A node without a
marker (a cluster started by other means) is reached with node affinity instead. A device of
a CUDA type (:mod:`executor.accelerators`) also asks for ``num_gpus: 1``: Ray then gives the
actor one of the node's GPUs, alone, through ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeplan.core.cluster import parse_device_id
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan
from pipeplan.executor.accelerators import CUDA
from pipeplan.executor.live_cluster import LiveNode, device_resource, node_resource

MARKER_SHARE = 0.001
"""How much of a node marker one actor asks for (so up to 1000 actors fit on a node)."""


WORKER_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
"""glibc malloc settings of every stage and profiler actor: keep freed memory for reuse, as
an accelerator's caching allocator (CUDA's) does.

By default glibc maps every block above its mmap threshold (32 MiB at most) afresh and
unmaps it when freed, and hands freed heap tops back to the OS. A backward then page-faults
its large gradients into existence on every call (VGG-16's classifier: a 411 MB weight
gradient, about half of that backward's CPU time in system time), and how long the kernel
takes varies with what else holds memory, so a pipeline stage measured far more than the
profiler had for the same layers (README, the ``bench.fidelity`` row). No mmap
(``MALLOC_MMAP_MAX_=0``: every block comes from the heap) and a trim threshold that is never
reached keep an actor's activations and gradients in memory it has touched already: an
operation costs its kernels' time, the same in the profiler and in a stage. This is also
what PyTorch's CPU performance guides recommend (a caching malloc such as jemalloc or
tcmalloc). Other C libraries ignore these variables."""


def check_shares(plan: Plan) -> None:
    """Refuse a plan with a stage whose microbatch, or whose last microbatch (the remainder),
    has fewer samples than the stage has replicas (the cost model costs such a stage, a
    replica without a sample paying its fixed cost per call, rule 2i; a run needs >= 1
    sample each)."""
    for i, stage in enumerate(plan.stages):
        if stage.microbatch < stage.replicas:
            raise PlanError(
                f"stages[{i}].microbatch: {stage.microbatch} samples cannot be shared by "
                f"{stage.replicas} replicas (need >= 1 sample each)"
            )
        rest = plan.samples(i, plan.microbatches(i) - 1)
        if rest < stage.replicas:
            raise PlanError(
                f"stages[{i}].microbatch: the last microbatch's {rest} samples (the remainder "
                f"of global_batch {plan.global_batch}) cannot be shared by {stage.replicas} "
                "replicas (need >= 1 sample each)"
            )


def check_feasible(plan: Plan, nodes: Sequence[LiveNode]) -> None:
    """Refuse a plan the live cluster cannot run, with the reason; before any actor starts.

    Every device id must name a live node, a device type that node has, and (per node and
    type) no more devices than it has; every stage needs at least one sample per replica.
    """
    check_shares(plan)
    by_name = {n.name: n for n in nodes}
    types = sorted({t for n in nodes for t, c in n.devices.items() if c > 0})
    wanted: dict[tuple[str, str], list[str]] = {}
    for i, stage in enumerate(plan.stages):
        for d in stage.devices:
            node, dtype, _ = parse_device_id(d)
            if dtype not in types:
                raise PlanError(
                    f"stages[{i}].devices: {d!r} needs device type {dtype!r}, which the live "
                    f"cluster does not have (types: {', '.join(types) or 'none'})"
                )
            if node not in by_name:
                raise PlanError(
                    f"stages[{i}].devices: {d!r} names node {node!r}, not in the live cluster "
                    f"(nodes: {', '.join(sorted(by_name)) or 'none'})"
                )
            wanted.setdefault((node, dtype), []).append(d)
    for (node, dtype), devices in wanted.items():
        have = by_name[node].devices.get(dtype, 0)
        if len(devices) > have:
            raise PlanError(
                f"plan: {len(devices)} {dtype!r} devices on node {node!r} "
                f"({', '.join(devices)}) but the live node has {have}"
            )


def actor_options(
    device: str, nodes: Sequence[LiveNode], accelerator: str | None = None
) -> dict[str, Any]:
    """``.options(...)`` that pin a stage replica to its device's node and type, with one GPU
    when the device's type has ``accelerator`` ``cuda``."""
    node, dtype, _ = parse_device_id(device)
    live = next(n for n in nodes if n.name == node)
    options: dict[str, Any] = {
        "num_cpus": 0,
        "num_gpus": 1 if accelerator == CUDA else 0,
        "max_restarts": 0,
        "runtime_env": {"env_vars": dict(WORKER_ENV)},
    }
    resources = {device_resource(dtype): 1.0}
    if live.marked:
        resources[node_resource(node)] = MARKER_SHARE
    else:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(live.node_id, soft=False)
    options["resources"] = resources
    return options
