"""Real devices: which torch device a stage runs on, and whether its node can run it.

A device type with ``accelerator: cuda`` (:class:`core.cluster.DeviceType`) is a GPU. Its
stage actors and profilers ask Ray for ``num_gpus: 1`` besides ``device:TYPE``
(:func:`executor.pinning.actor_options`); Ray then shows the actor its one GPU through
``CUDA_VISIBLE_DEVICES``, so inside the actor the device is always ``cuda:0``
(:func:`torch_device`). Every other type runs on the CPU.

**How the executor knows that a node has CUDA.** Two checks, for two different failures:

- Before anything starts, the driver reads Ray's own ``GPU`` resource of each live node
  (:attr:`executor.live_cluster.LiveNode.gpus`: Ray counts a node's GPUs when the node
  starts, and ``pipeplan cluster join`` sets it from the spec after checking the machine):
  a plan that puts more CUDA devices on a node than Ray counts GPUs there is refused, naming
  the device type and the node (:func:`check_nodes`). Without this check the actors would
  wait, pending, for GPUs that never come, until the start timeout; the resource is in the
  node list the driver reads anyway, so the check costs nothing.
- When a stage actor starts, it checks ``torch.cuda.is_available()`` in its own process
  (:func:`local_device`): Ray may count a GPU that this process's torch cannot use (a
  CPU-only torch build, a broken driver). That failure comes back through the actor's start
  and names the stage, device and node (:mod:`executor.waiting`).

``pipeplan cluster join`` checks the machine itself before it starts a node
(:func:`check_machine`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import torch

from pipeplan.core.cluster import ClusterSpec, Node, parse_device_id
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import LiveNode

__all__ = [
    "CUDA",
    "accelerator_of",
    "accelerators",
    "check_machine",
    "check_nodes",
    "cuda_devices_of",
    "has_accelerators",
    "local_device",
    "synchronize",
    "torch_device",
]

CUDA = "cuda"


def accelerator_of(spec: ClusterSpec, device_type: str) -> str | None:
    """The accelerator of ``device_type`` in ``spec`` (None: a CPU type, or not in it)."""
    described = spec.device_types.get(device_type)
    return described.accelerator if described is not None else None


def has_accelerators(spec: ClusterSpec) -> bool:
    """Whether some device type of ``spec`` is a real accelerator (a GPU)."""
    return any(t.accelerator is not None for t in spec.device_types.values())


def cuda_devices_of(spec: ClusterSpec, node: Node) -> dict[str, int]:
    """How many devices of each CUDA type ``node`` holds (types without CUDA left out)."""
    return {t: c for t, c in node.devices.items() if c > 0 and accelerator_of(spec, t) == CUDA}


def local_gpus(spec: ClusterSpec, node: Node) -> int:
    """How many GPUs a node of a local cluster (all nodes on this machine) tells Ray it has:
    its CUDA devices in ``spec``, at most this machine's CUDA devices, which the nodes share.
    None where this machine has no CUDA, so that a plan of CUDA devices is refused before any
    actor starts."""
    wanted = sum(cuda_devices_of(spec, node).values())
    return min(wanted, torch.cuda.device_count()) if wanted else 0


def torch_device(accelerator: str | None) -> torch.device:
    """The torch device a stage of a type with ``accelerator`` computes on, inside its Ray
    actor: the CPU, or the one GPU Ray gave the actor (``cuda:0`` of its
    ``CUDA_VISIBLE_DEVICES``)."""
    if accelerator is None:
        return torch.device("cpu")
    if accelerator == CUDA:
        return torch.device(CUDA, 0)
    raise ExecutorError(f"accelerator: {accelerator!r} is not one the executor runs ({CUDA})")


def local_device(accelerator: str | None, device_type: str, node: str) -> torch.device:
    """:func:`torch_device`, after checking that this process can use it (called where the
    stage runs): a CUDA type on a process without CUDA is an :class:`ExecutorError`."""
    device = torch_device(accelerator)
    if device.type == CUDA and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ExecutorError(
            f"device type {device_type} needs CUDA but node {node} has none "
            f"(torch.cuda.is_available() is False in this actor's process; torch "
            f"{torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r})"
        )
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that a clock read
    next times the compute itself; nothing to wait for on the CPU."""
    if device.type == CUDA:
        torch.cuda.synchronize(device)


def accelerators(spec: ClusterSpec) -> dict[str, str | None]:
    """Every device type of ``spec`` and its accelerator (None: the CPU)."""
    return {name: t.accelerator for name, t in spec.device_types.items()}


def check_nodes(
    accelerators: Mapping[str, str | None], devices: Iterable[str], nodes: Sequence[LiveNode]
) -> None:
    """Refuse, before any actor starts, to run ``devices`` (ids ``NODE/TYPE:INDEX``) of CUDA
    types (``accelerators``: device type -> accelerator) on a live node with fewer GPUs
    (Ray's ``GPU`` resource) than it would use."""
    by_name: Mapping[str, LiveNode] = {n.name: n for n in nodes}
    wanted: dict[str, list[str]] = {}
    for d in devices:
        node, dtype, _ = parse_device_id(d)
        if accelerators.get(dtype) == CUDA:
            wanted.setdefault(node, []).append(d)
    for node, used in sorted(wanted.items()):
        live = by_name.get(node)
        gpus = live.gpus if live is not None else 0.0
        dtype = parse_device_id(used[0])[1]
        if gpus <= 0:
            raise ExecutorError(
                f"device type {dtype} needs CUDA but node {node} has none (Ray counts no GPU "
                f"on it; devices {', '.join(used)})"
            )
        if gpus + 1e-9 < len(used):
            raise ExecutorError(
                f"node {node}: {len(used)} CUDA devices ({', '.join(used)}) but Ray counts "
                f"{gpus:g} GPUs on it"
            )


def check_machine(spec: ClusterSpec, node: Node, cuda_count: int | None = None) -> int:
    """Refuse to start a Ray node for ``node`` on this machine when it has fewer CUDA devices
    (``cuda_count``, default what torch sees here) than the spec gives the node; returns
    how many GPUs the node should advertise (its CUDA devices in the spec)."""
    wanted = cuda_devices_of(spec, node)
    needed = sum(wanted.values())
    if not needed:
        return 0
    have = torch.cuda.device_count() if cuda_count is None else cuda_count
    first = sorted(wanted)[0]
    if have == 0:
        raise ExecutorError(
            f"device type {first} needs CUDA but node {node.name} has none (torch sees no "
            "CUDA device on this machine)"
        )
    if have < needed:
        kinds = ", ".join(f"{c} {t}" for t, c in sorted(wanted.items()))
        raise ExecutorError(
            f"node {node.name}: the spec gives it {needed} CUDA devices ({kinds}) but this "
            f"machine has {have}"
        )
    return needed
