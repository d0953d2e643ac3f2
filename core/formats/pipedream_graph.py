"""Read the text of a PipeDream ``graph.txt`` into its nodes and edges, in a topological order.

PipeDream's profiler (msr-fiddle/pipedream, ``profiler/*/profiles/<model>/graph.txt``) writes
one node per line, then one tab-indented edge per line::

    node2 -- Conv2d(3, 64, kernel_size=(11, 11), ...) -- forward_compute_time=22.316,
        backward_compute_time=6.405, activation_size=198246400.000, parameter_size=93184.000
    \tnode1 -- node2

(the node line is one line in the file). A multi-output module lists its activation sizes as
``[a; b; c]``, and a partitioned graph may end a node line with ``-- stage_id=N``. The figures
are kept as written (minibatch milliseconds and bytes: :mod:`core.formats.pipedream` converts
them). Node numbers are not a topological order: :func:`topological_order` makes one with
Kahn's algorithm, ties broken by node number, and names a cycle where there is one.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipeplan.core.errors import FormatError

_NODE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.+?) -- (?P<meta>forward_compute_time=.*?)"
    r"(?: -- stage_id=(?P<stage>-?\d+))?$"
)
_EDGE = re.compile(r"^(?P<src>\S+) -- (?P<dst>\S+)$")
_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_INPUT = re.compile(r"^Input\d*$")
_NUMBER_SUFFIX = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class PipeDreamNode:
    """One node line as written: minibatch milliseconds and bytes, plus where it was read."""

    id: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation_sizes: tuple[float, ...]  # one entry per output, bytes per minibatch
    parameter_size: float
    line: int
    text: str

    @property
    def activation_size(self) -> float:
        return sum(self.activation_sizes)

    @property
    def is_input(self) -> bool:
        return _INPUT.match(self.desc) is not None


@dataclass(frozen=True)
class PipeDreamEdge:
    src: str
    dst: str
    line: int
    text: str


def read_graph(text: str) -> tuple[dict[str, PipeDreamNode], list[PipeDreamEdge]]:
    """Node lines (unindented) and edge lines (indented), checked for duplicates and unknowns."""
    nodes: dict[str, PipeDreamNode] = {}
    edges: list[PipeDreamEdge] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if raw[0].isspace():
            edges.append(_parse_edge(line, number))
            continue
        node = _parse_node(line, number)
        if node.id in nodes:
            first = nodes[node.id]
            raise FormatError(
                f"line {number}: node {node.id!r} defined twice (first on line "
                f"{first.line}): {line!r}"
            )
        nodes[node.id] = node
    if not nodes:
        raise FormatError(
            "empty profile: no node lines (expected 'nodeN -- <module> -- "
            "forward_compute_time=..., ...')"
        )
    for e in edges:
        unknown = [x for x in (e.src, e.dst) if x not in nodes]
        if unknown:
            raise FormatError(f"line {e.line}: edge to unknown node {unknown[0]!r}: {e.text!r}")
    return nodes, edges


def topological_order(
    nodes: Sequence[PipeDreamNode], edges: Sequence[PipeDreamEdge]
) -> list[PipeDreamNode]:
    """Kahn's algorithm; among ready nodes the lowest node number (then line) goes first."""
    by_id = {n.id: n for n in nodes}
    succ: dict[str, set[str]] = {n.id: set() for n in nodes}
    for e in edges:
        succ[e.src].add(e.dst)
    indegree = {n.id: 0 for n in nodes}
    for targets in succ.values():
        for t in targets:
            indegree[t] += 1
    ready = [_tie_break(n) for n in nodes if indegree[n.id] == 0]
    heapq.heapify(ready)
    order: list[PipeDreamNode] = []
    while ready:
        node = by_id[heapq.heappop(ready)[2]]
        order.append(node)
        for t in succ[node.id]:
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, _tie_break(by_id[t]))
    if len(order) < len(nodes):
        left = {i for i, d in indegree.items() if d > 0}
        cycle = _cycle_in(left, succ)
        where = " -> ".join(f"{c} (line {by_id[c].line})" for c in cycle)
        raise FormatError(f"cycle in the graph: {where}")
    return order


def _parse_node(line: str, number: int) -> PipeDreamNode:
    m = _NODE.match(line)
    if not m:
        raise FormatError(
            f"line {number}: malformed node line (expected 'ID -- MODULE -- "
            f"forward_compute_time=..., backward_compute_time=..., activation_size=..., "
            f"parameter_size=...'; edge lines are indented): {line!r}"
        )
    values: dict[str, str] = {}
    for part in m["meta"].split(", "):
        key, eq, value = part.partition("=")
        if not eq or not value:
            raise FormatError(f"line {number}: malformed field {part!r} in {line!r}")
        values[key.strip()] = value.strip()
    missing = [k for k in _KEYS if k not in values]
    if missing:
        raise FormatError(f"line {number}: missing {', '.join(missing)} in {line!r}")
    fwd, bwd, params = (
        _number(values[k], k, number, line)
        for k in ("forward_compute_time", "backward_compute_time", "parameter_size")
    )
    act = values["activation_size"]
    items = act[1:-1].split(";") if act.startswith("[") and act.endswith("]") else [act]
    sizes = tuple(_number(x.strip(), "activation_size", number, line) for x in items)
    return PipeDreamNode(m["id"], m["desc"].strip(), fwd, bwd, sizes, params, number, line)


def _parse_edge(line: str, number: int) -> PipeDreamEdge:
    m = _EDGE.match(line)
    if not m:
        raise FormatError(
            f"line {number}: malformed edge line (expected 'nodeA -- nodeB'): {line!r}"
        )
    return PipeDreamEdge(m["src"], m["dst"], number, line)


def _number(value: str, key: str, number: int, line: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise FormatError(f"line {number}: {key}={value!r} is not a number: {line!r}") from None
    if not math.isfinite(x) or x < 0:
        raise FormatError(
            f"line {number}: {key} must be a finite number >= 0, got {value!r}: {line!r}"
        )
    return x


def _tie_break(node: PipeDreamNode) -> tuple[float, int, str]:
    m = _NUMBER_SUFFIX.search(node.id)
    return (int(m[1]) if m else math.inf, node.line, node.id)


def _cycle_in(left: set[str], succ: dict[str, set[str]]) -> list[str]:
    """A cycle among the nodes Kahn's algorithm could not order, in edge direction.

    Each such node has a predecessor that is also left, so walking predecessors must repeat.
    """
    pred: dict[str, list[str]] = {n: [] for n in left}
    for src in sorted(left):
        for dst in succ[src]:
            if dst in left:
                pred[dst].append(src)
    node = min(left)
    path: list[str] = []
    seen: dict[str, int] = {}
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = min(pred[node])
    cycle = path[seen[node] :] + [node]
    return cycle[::-1]
