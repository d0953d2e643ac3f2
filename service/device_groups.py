"""A stage's devices as people read them at scale: counted by node kind and device type,
not listed id by id.

A plan on a data centre puts tens of devices on a stage, and a list of ids
(``a100x8-3/a100:5, ...``) hides what it says: how many devices of which type, on how many
nodes of which kind. :func:`group_devices` counts them; :func:`compact` writes the groups as
``4 nodes x 8 a100 (a100x8-0..3) + 2 v100 (v100x8-1)``: each group is devices of one type,
the same number on each of its nodes, and the nodes it is on. :func:`stage_labels` chooses
for a whole plan: its ids when it has at most :data:`IDS_UP_TO` devices (a plan on this
machine's presets reads best by id), else the compact form, so that each face (the CLI's
table, the dashboard) shows one plan one way. The ids themselves stay in the plan
document, ``--json`` and the dashboard's details element.

Only the ids are read, not the cluster: a node named ``KIND-k`` (``k`` an integer written
without leading zeros) is node ``k`` of kind ``KIND``, as a cluster's ``count:`` entries
expand; the compact form writes such nodes back as ranges (``a100x8-0..3,6``), which names
exactly the nodes it abbreviates whatever the cluster file said. Other node names stand
alone, listed by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeplan.core.cluster import parse_device_id

IDS_UP_TO = 8
"""A plan on at most this many devices shows its device ids; a larger one the compact form."""

_KIND_NODE = re.compile(r"^(?P<kind>.+)-(?P<index>0|[1-9][0-9]*)$")


def node_kind(node: str) -> tuple[str, int] | None:
    """``"a100x8-3"`` -> ``("a100x8", 3)``; None for a node that is not ``KIND-k``."""
    m = _KIND_NODE.match(node)
    return (m["kind"], int(m["index"])) if m else None


@dataclass(frozen=True)
class DeviceGroup:
    """Devices of one type, ``per_node`` on each of ``nodes``, all of kind ``kind`` (None:
    nodes not named ``KIND-k``)."""

    kind: str | None
    type: str
    per_node: int
    nodes: tuple[str, ...]

    @property
    def devices(self) -> int:
        return self.per_node * len(self.nodes)

    @property
    def where(self) -> str:
        """The nodes: ``a100x8-0..3,6`` for a kind's nodes, ``n0, n3`` for others."""
        if self.kind is None:
            return ", ".join(self.nodes)
        found = (node_kind(n) for n in self.nodes)
        return f"{self.kind}-{index_ranges(k[1] for k in found if k is not None)}"

    def __str__(self) -> str:
        if len(self.nodes) == 1:
            return f"{self.per_node} {self.type} ({self.where})"
        return f"{len(self.nodes)} nodes x {self.per_node} {self.type} ({self.where})"


def index_ranges(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6, 8, 9]`` -> ``"0..3,6,8..9"`` (sorted, each index once)."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def group_devices(devices: Sequence[str]) -> list[DeviceGroup]:
    """A stage's device ids as groups (key: node kind, device type, devices per node), in the
    order the stage first names them; a kind's nodes by index, other nodes as named."""
    per_node: dict[tuple[str, str], int] = {}
    for d in devices:
        node, type_, _ = parse_device_id(d)
        per_node[node, type_] = per_node.get((node, type_), 0) + 1
    members: dict[tuple[str | None, str, int], list[tuple[int, str]]] = {}
    for (node, type_), n in per_node.items():
        kind, index = node_kind(node) or (None, 0)
        members.setdefault((kind, type_, n), []).append((index, node))
    return [
        DeviceGroup(kind, type_, n, tuple(node for _, node in (sorted(nodes) if kind else nodes)))
        for (kind, type_, n), nodes in members.items()
    ]


def compact(devices: Sequence[str]) -> str:
    """A stage's devices as its groups, joined by ``+``: ``4 nodes x 8 a100 (a100x8-0..3)``."""
    return " + ".join(str(g) for g in group_devices(devices))


def stage_labels(stages: Sequence[Sequence[str]]) -> list[str]:
    """Each stage's devices for people: the ids (comma-separated) when the plan has at most
    :data:`IDS_UP_TO` devices, else :func:`compact`'s groups."""
    if sum(len(s) for s in stages) <= IDS_UP_TO:
        return [", ".join(s) for s in stages]
    return [compact(s) for s in stages]
