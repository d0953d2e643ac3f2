"""Reserving a plan's devices as one Ray placement group before any stage actor starts.

One bundle per device: its ``device:TYPE``, a sliver of its node's marker (so Ray places the
bundle on that node; a node without a marker is pinned by Ray's own ``node:IP`` resource),
and a GPU for a CUDA type. The group is named ``pipeplan:OWNER:TAG`` (the owner: the
service's job id, or a local run's), so a run that waits can say who holds what it needs.
Ray grants the whole group or nothing: two runs never hold half of each other's devices,
and a run that cannot have its devices waits in Ray's queue instead of failing. The stage
actors are then created in their bundles (:meth:`Reservation.options`).

Ray removes a placement group when the job (driver) that made it ends, however it ends;
:meth:`Reservation.release` removes it at once when the run closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeplan.core.cluster import parse_device_id
from pipeplan.executor import runtime
from pipeplan.executor.accelerators import CUDA
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import LiveNode, device_resource, node_resource
from pipeplan.executor.pinning import MARKER_SHARE

log = logging.getLogger("pipeplan.executor")

PREFIX = "pipeplan:"
"""Every pipeplan placement group's name is ``pipeplan:OWNER:TAG`` (a random tag: a job
may hold several groups at once, a search measuring plans side by side)."""


def owner_of(name: str) -> str | None:
    """The owner a pipeplan placement group's name names, else None (not ours)."""
    if not name.startswith(PREFIX):
        return None
    return name[len(PREFIX) :].rpartition(":")[0] or None


POLL_S = 1.0
"""How often a waiting reservation looks again at who holds its devices."""


class DevicesBusy(ExecutorError):
    """The devices stayed held by others past the run's ``wait_s``."""


@dataclass(frozen=True)
class Waiting:
    """Why a reservation is not granted yet: the devices it wants that are held now, and
    the owners of the placement groups holding them (``other actors`` when none does)."""

    devices: tuple[str, ...]
    held_by: tuple[str, ...]

    def text(self) -> str:
        held = ", ".join(self.held_by) or "other actors"
        return f"{len(self.devices)} device(s) {', '.join(self.devices)}, held by {held}"

    def to_dict(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "held_by": list(self.held_by)}


def bundle(device: str, nodes: Sequence[LiveNode], accelerator: str | None) -> dict[str, float]:
    """The resources one device's bundle holds (module docstring)."""
    node, dtype, _ = parse_device_id(device)
    live = next(n for n in nodes if n.name == node)
    resources = {device_resource(dtype): 1.0}
    if live.marked:
        resources[node_resource(node)] = MARKER_SHARE
    elif live.address:
        resources[f"node:{live.address}"] = MARKER_SHARE
    if accelerator == CUDA:
        resources["GPU"] = 1.0
    return resources


def strategy(devices: Sequence[str]) -> str:
    """``STRICT_PACK`` when every device is on one node, else ``PACK`` (the bundles' node
    resources place each bundle on its node either way)."""
    return "STRICT_PACK" if len({parse_device_id(d)[0] for d in devices}) == 1 else "PACK"


def held_devices(
    devices: Sequence[str], nodes: Sequence[LiveNode], free: Mapping[str, Mapping[str, float]]
) -> list[str]:
    """Those of ``devices`` whose node has fewer of their type free than wanted (``free``:
    Ray node id -> available resources), e.g. held by another run's placement group."""
    by_name = {n.name: n for n in nodes}
    wanted: dict[tuple[str, str], list[str]] = {}
    for d in devices:
        node, dtype, _ = parse_device_id(d)
        wanted.setdefault((node, dtype), []).append(d)
    return [
        d
        for (node, dtype), ds in wanted.items()
        if free.get(by_name[node].node_id, {}).get(device_resource(dtype), 0.0) + 1e-9 < len(ds)
        for d in ds
    ]


def holders(devices: Sequence[str], nodes: Sequence[LiveNode], own: str) -> Waiting:
    """Which of ``devices`` are held now (:func:`held_devices`), and the owners of the other
    pipeplan placement groups holding that type on those nodes."""
    by_name = {n.name: n for n in nodes}
    held = held_devices(devices, nodes, runtime.free_resources_by_node())
    owners: set[str] = set()
    busy_at = {(by_name[parse_device_id(d)[0]].node_id, parse_device_id(d)[1]) for d in held}
    for group in placement_group_table().values():
        name = str(group.get("name", ""))
        owner = owner_of(name)
        if owner is None or owner == own or group.get("state") != "CREATED":
            continue
        on_nodes = group.get("bundles_to_node_id", {})
        for index, res in group.get("bundles", {}).items():
            for key in res:
                if key.startswith("device:") and (on_nodes.get(index), key[7:]) in busy_at:
                    owners.add(owner)
    return Waiting(tuple(held), tuple(sorted(owners)))


@dataclass
class Reservation:
    """A granted placement group: bundle ``i`` holds ``devices[i]``."""

    group: PlacementGroup
    devices: tuple[str, ...]
    waited_s: float = 0.0

    def options(self, device: str) -> dict[str, Any]:
        """The ``scheduling_strategy`` that puts an actor in ``device``'s bundle."""
        index = self.devices.index(device)
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=index
            )
        }

    def release(self) -> None:
        """Remove the group (idempotent; the cluster may be gone already)."""
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)


@dataclass(frozen=True)
class Claimant:
    """Who this process's runs reserve devices for: the owner their placement groups are
    named after, how long they wait (None: as long as it takes), and whom they tell while
    they wait (``on_wait``) and once granted after a wait (``on_granted``, the seconds
    waited)."""

    owner: str
    wait_s: float | None = None
    on_wait: Callable[[Waiting], None] | None = None
    on_granted: Callable[[float], None] | None = None


_claimant = Claimant(f"local-{os.getpid()}")


def current_claimant() -> Claimant:
    return _claimant


@contextlib.contextmanager
def claiming(claimant: Claimant) -> Iterator[Claimant]:
    """Every run started in this process meanwhile reserves for ``claimant`` (the service's
    job runner names its job so; a local run goes by its process id)."""
    global _claimant
    before, _claimant = _claimant, claimant
    try:
        yield claimant
    finally:
        _claimant = before


def reserve(
    devices: Sequence[str],
    nodes: Sequence[LiveNode],
    accelerators: Sequence[str | None],
    owner: str,
    wait_s: float | None = None,
    on_wait: Callable[[Waiting], None] | None = None,
) -> Reservation:
    """Reserve ``devices`` (``accelerators``: each one's, for its GPU) as one placement
    group named for ``owner``. While they are held by others it waits, calling ``on_wait``
    each time who holds what changes; past ``wait_s`` seconds (None: no limit) it gives up
    with :class:`DevicesBusy` naming the devices and their holders."""
    bundles = [bundle(d, nodes, a) for d, a in zip(devices, accelerators, strict=True)]
    name = f"{PREFIX}{owner}:{secrets.token_hex(4)}"  # one owner may hold several at once
    group = placement_group(bundles, strategy=strategy(devices), name=name)
    start = time.monotonic()
    told: Waiting | None = None
    try:
        while True:
            ready, _ = ray.wait([group.ready()], timeout=POLL_S)
            if ready:
                return Reservation(group, tuple(devices), time.monotonic() - start)
            now = holders(devices, nodes, owner)
            if now.devices and now != told:
                if on_wait is not None:
                    on_wait(now)
                else:
                    log.warning("waiting for %s", now.text())
            told = now
            if wait_s is not None and time.monotonic() - start > wait_s:
                raise DevicesBusy(f"devices busy for {wait_s:g} s: {now.text()}")
    except BaseException:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
        raise


def claim(
    devices: Sequence[str], nodes: Sequence[LiveNode], accelerators: Sequence[str | None]
) -> Reservation:
    """:func:`reserve` ``devices`` for this process's claimant (:func:`claiming`): waits as
    long as it says, tells it while it waits and once the devices came after a wait."""
    who = current_claimant()
    granted = reserve(devices, nodes, accelerators, who.owner, who.wait_s, who.on_wait)
    if granted.waited_s > POLL_S and who.on_granted is not None:
        who.on_granted(granted.waited_s)
    return granted
