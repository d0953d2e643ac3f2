"""The plan drawn on the server as SVG: its stages x devices, and its Gantt chart from the
cost model's timeline (the same boxes and colours as :mod:`service.gantt`'s PNG).

Stages are rows and devices columns, grouped by node: a cell is filled when the stage runs
a replica on that device, so idle devices (the ``cost`` objective leaves some) show as
empty columns. A plan on more than :data:`~service.device_groups.IDS_UP_TO` devices (the
size at which its stages are written as counts, not ids) has a column per node instead,
grouped by node kind, and a cell says how many devices of which type the stage has there.
The Gantt chart has one row per stage, its compute (forward, backward,
update, all-reduce) above and its sends beneath, over the batch's milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec, parse_device_id
from pipeplan.core.costmodel import Estimate
from pipeplan.core.plan import Plan
from pipeplan.service.device_groups import IDS_UP_TO, node_kind, stage_labels
from pipeplan.service.gantt import COLOURS, LABELS
from pipeplan.service.web.svg import Scale, Svg, nice_ticks, tick_label

STAGE_COLOURS = (
    "#4C72B0",
    "#55A868",
    "#C44E52",
    "#8172B3",
    "#CCB974",
    "#64B5CD",
    "#DD8452",
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
)
MAX_GRID_DEVICES = 64
"""A cluster with more devices shows only the plan's own (a catalogue may hold thousands)."""
MAX_GANTT_EVENTS = 6000
"""A timeline with more boxes is not drawn: the page would carry megabytes of SVG."""
COMPUTE = ("F", "B", "update", "allreduce")


def stage_colour(s: int) -> str:
    return STAGE_COLOURS[s % len(STAGE_COLOURS)]


def grid_devices(plan: Plan, cluster: ClusterSpec | None) -> list[str]:
    """The columns: every device of ``cluster`` when it is small, else the plan's own, in
    the cluster's order (node by node) when the cluster knows them."""
    used = set(plan.devices)
    if cluster is not None:
        ids = list(cluster.device_ids)
        if len(ids) <= MAX_GRID_DEVICES and used <= set(ids):
            return ids
        order = {d: i for i, d in enumerate(ids)}
        return sorted(used, key=lambda d: (order.get(d, len(order)), d))
    return sorted(used, key=lambda d: (parse_device_id(d)[0], d))


def _node_spans(devices: Sequence[str]) -> list[tuple[str, int, int]]:
    """``(node, first column, columns)`` of each run of one node's devices."""
    spans: list[tuple[str, int, int]] = []
    for i, d in enumerate(devices):
        node = parse_device_id(d)[0]
        if spans and spans[-1][0] == node:
            spans[-1] = (node, spans[-1][1], spans[-1][2] + 1)
        else:
            spans.append((node, i, 1))
    return spans


def plan_grid_svg(plan: Plan, cluster: ClusterSpec | None = None) -> str:
    """Stages (rows) x devices (columns, grouped by node), a filled cell per replica; on a
    plan of more than :data:`IDS_UP_TO` devices, stages x nodes (:func:`node_grid_svg`)."""
    if len(plan.devices) > IDS_UP_TO:
        return node_grid_svg(plan, cluster)
    devices = grid_devices(plan, cluster)
    labels = [d.split("/", 1)[1] for d in devices]
    col = max(56.0, 7.4 * max(len(x) for x in labels) + 12)
    left, top, row, right = 170.0, 50.0, 38.0, 120.0
    width = left + col * len(devices) + right
    svg = Svg(width, top + row * plan.num_stages + 8, f"plan: {plan.num_stages} stages")
    svg.data |= {"stages": plan.num_stages, "devices": len(set(plan.devices))}
    for node, first, n in _node_spans(devices):
        x = left + first * col
        svg.rect(x + 1, 2, n * col - 2, 20, "#eef1f6", rx=3)
        svg.text(x + n * col / 2, 17, node, 13, text_anchor="middle", font_weight="bold")
    for i, label in enumerate(labels):
        svg.text(left + (i + 0.5) * col, 40, label, 12, text_anchor="middle", fill="#555")
    column = {d: i for i, d in enumerate(devices)}
    for s, stage in enumerate(plan.stages):
        y = top + s * row
        svg.rect(4, y + 4, 10, row - 8, stage_colour(s), rx=2)
        svg.text(22, y + 16, f"stage {s}", 13, font_weight="bold")
        svg.text(22, y + 31, f"layers [{stage.start}, {stage.end})", 12, fill="#555")
        for i in range(len(devices)):
            svg.rect(left + i * col + 1, y + 2, col - 2, row - 4, "#f6f7f9", rx=3)
        for k, d in enumerate(stage.devices):
            share = rules.replica_samples(stage.microbatch, stage.replicas, k)
            x = left + column[d] * col
            svg.rect(x + 1, y + 2, col - 2, row - 4, stage_colour(s), rx=3, class_="replica")
            svg.title(
                f"stage {s} on {d}: layers [{stage.start}, {stage.end}), "
                f"{share} samples of each microbatch of {stage.microbatch}"
            )
        info = f"mb {stage.microbatch} x {plan.microbatches(s)}"
        svg.text(left + col * len(devices) + 10, y + 24, info, 12, fill="#333")
    return svg.render("plan-grid", fill=False)


def grid_nodes(plan: Plan, cluster: ClusterSpec | None) -> list[str]:
    """The node grid's columns: every node of ``cluster`` when it has at most
    :data:`MAX_GRID_DEVICES` devices, else the plan's own nodes, in the cluster's order
    when it knows them, else by kind and index."""
    used = {parse_device_id(d)[0] for d in plan.devices}
    if cluster is not None:
        names = [n.name for n in cluster.nodes]
        if len(cluster.device_ids) <= MAX_GRID_DEVICES and used <= set(names):
            return names
        order = {n: i for i, n in enumerate(names)}
        return sorted(used, key=lambda n: (order.get(n, len(order)), n))
    return sorted(used, key=lambda n: node_kind(n) or (n, -1))


def _kind_spans(nodes: Sequence[str]) -> list[tuple[str, int, int]]:
    """``(kind, first column, columns)`` of each run of one kind's nodes; a node that is
    not ``KIND-k`` is a run of its own, named by itself."""
    spans: list[tuple[str, int, int]] = []
    for i, node in enumerate(nodes):
        found = node_kind(node)
        if found is not None and spans and spans[-1][0] == found[0]:
            spans[-1] = (found[0], spans[-1][1], spans[-1][2] + 1)
        else:
            spans.append((found[0] if found else node, i, 1))
    return spans


def _counts_by_node(devices: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """A stage's device ids by node, then by type."""
    out: dict[str, dict[str, list[str]]] = {}
    for d in devices:
        node, type_, _ = parse_device_id(d)
        out.setdefault(node, {}).setdefault(type_, []).append(d)
    return out


def node_grid_svg(plan: Plan, cluster: ClusterSpec | None = None) -> str:
    """Stages (rows) x nodes (columns, grouped by kind): a filled cell where the stage has
    devices on the node, saying how many of which type (its title lists their ids)."""
    nodes = grid_nodes(plan, cluster)
    stage_nodes = [_counts_by_node(stage.devices) for stage in plan.stages]
    cells = {
        (s, node): " + ".join(f"{len(ids)} {t}" for t, ids in by_type.items())
        for s, by_node in enumerate(stage_nodes)
        for node, by_type in by_node.items()
    }
    widest = max([len(c) for c in cells.values()] + [len(n) for n in nodes if not node_kind(n)])
    col = max(56.0, 7.0 * widest + 12)
    left, top, row, right = 170.0, 50.0, 38.0, 120.0
    width = left + col * len(nodes) + right
    svg = Svg(width, top + row * plan.num_stages + 8, f"plan: {plan.num_stages} stages")
    svg.data |= {"stages": plan.num_stages, "devices": len(plan.devices), "nodes": len(nodes)}
    for kind, first, n in _kind_spans(nodes):
        x = left + first * col
        svg.rect(x + 1, 2, n * col - 2, 20, "#eef1f6", rx=3)
        svg.text(x + n * col / 2, 17, kind, 13, text_anchor="middle", font_weight="bold")
    for i, node in enumerate(nodes):
        found = node_kind(node)
        label = str(found[1]) if found else ""
        svg.text(left + (i + 0.5) * col, 40, label, 12, text_anchor="middle", fill="#555")
    for s, stage in enumerate(plan.stages):
        y = top + s * row
        svg.rect(4, y + 4, 10, row - 8, stage_colour(s), rx=2)
        svg.text(22, y + 16, f"stage {s}", 13, font_weight="bold")
        svg.text(22, y + 31, f"layers [{stage.start}, {stage.end})", 12, fill="#555")
        for i, node in enumerate(nodes):
            x = left + i * col
            if (s, node) not in cells:
                svg.rect(x + 1, y + 2, col - 2, row - 4, "#f6f7f9", rx=3)
                continue
            svg.rect(x + 1, y + 2, col - 2, row - 4, stage_colour(s), rx=3, class_="node-cell")
            ids = [d for by_type in stage_nodes[s][node].values() for d in by_type]
            svg.title(f"stage {s} on {node}: {cells[s, node]} ({', '.join(ids)})")
            svg.text(x + col / 2, y + 23, cells[s, node], 12, text_anchor="middle", fill="white")
        info = f"mb {stage.microbatch} x {plan.microbatches(s)}"
        svg.text(left + col * len(nodes) + 10, y + 24, info, 12, fill="#333")
    return svg.render("plan-grid", fill=False)


def _gantt_labels(est: Estimate) -> list[str]:
    """A stage's devices under its name: ``TYPE:INDEX`` ids on a small plan, else counts."""
    if sum(len(st.devices) for st in est.stages) > IDS_UP_TO:
        return stage_labels([st.devices for st in est.stages])
    return [", ".join(d.split("/", 1)[1] for d in st.devices) for st in est.stages]


def gantt_svg(est: Estimate) -> str | None:
    """The schedule of one batch: a row per stage (compute above, sends beneath); None
    when it has more than :data:`MAX_GANTT_EVENTS` boxes."""
    if len(est.timeline) > MAX_GANTT_EVENTS:
        return None
    stages = len(est.stages)
    left, top, row, bottom, width = 110.0, 40.0, 40.0, 34.0, 980.0
    end_ms = est.batch_time_s * 1e3
    ticks = nice_ticks(end_ms)
    x = Scale(0.0, max(ticks[-1], end_ms, 1e-9), left, width - 16)
    height = top + row * stages + bottom
    svg = Svg(width, height, f"Gantt chart: {end_ms:.3g} ms per batch")
    svg.data |= {"batch-time-ms": f"{end_ms:.6g}", "boxes": len(est.timeline), "stages": stages}
    kinds = sorted({e.kind for e in est.timeline}, key=list(COLOURS).index)
    lx = left
    for k in kinds:
        svg.rect(lx, 8, 12, 12, COLOURS[k], rx=2)
        svg.text(lx + 16, 18, LABELS[k], 11)
        lx += 30 + 6.5 * len(LABELS[k])
    for t in ticks:
        svg.line(x(t), top - 4, x(t), top + row * stages, "#e3e5e8")
        svg.text(x(t), height - bottom + 16, tick_label(t), 10, text_anchor="middle", fill="#555")
    svg.text((left + width) / 2, height - 4, "time in the batch (ms, cost model)", 11,
             text_anchor="middle")  # fmt: skip
    for s, label in enumerate(_gantt_labels(est)):
        y = top + s * row
        svg.text(8, y + 14, f"stage {s}", 11, font_weight="bold")
        svg.text(8, y + 27, label if len(label) <= 18 else label[:17] + "…", 9, fill="#555")
    for e in est.timeline:
        y = top + e.stage * row
        y, h = (y + 3, 20.0) if e.kind in COMPUTE else (y + 26, 8.0)
        x0, x1 = x(e.start * 1e3), x(e.end * 1e3)
        svg.rect(x0, y, max(x1 - x0, 0.6), h, COLOURS[e.kind], class_=f"op op-{e.kind}")
        svg.title(
            f"stage {e.stage} {LABELS[e.kind]}"
            + (f" of microbatch {e.microbatch}" if e.kind in ("F", "B", "send", "grad") else "")
            + f": {e.start * 1e3:.3f} - {e.end * 1e3:.3f} ms"
        )
        if e.kind in ("F", "B") and x1 - x0 > 14:
            svg.text((x0 + x1) / 2, y + 14, str(e.microbatch), 9, text_anchor="middle",
                     fill="white")  # fmt: skip
    return svg.render("gantt")
