"""What a plan rents: ``{node kind: count}`` of the nodes whose devices it uses, and prices.

A node of a catalogue entry (``count: N``) has the entry's name as its ``kind``; a plain node
is a kind of its own. The cost objective (rule 10) charges the devices a plan uses; a cloud
bills whole instances, so the rental also says what the rented nodes cost in full
(``node_price_per_hour``; the two agree when the plan uses every device of its nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.costmodel import Estimate
from pipeplan.core.plan import Plan


def kind_of(node: Node) -> str:
    """A node's kind: its catalogue entry's name, or its own name."""
    return node.kind or node.name


@dataclass(frozen=True)
class Rental:
    """The nodes a plan rents, by kind, and what they cost."""

    nodes: dict[str, int]
    """Node kind -> how many of its nodes the plan uses devices of."""
    devices: dict[str, int]
    """Device type -> how many of them the plan uses."""
    price_per_hour: float
    """$ per hour of the devices the plan uses (rule 10: what the cost objective charges)."""
    node_price_per_hour: float
    """$ per hour of the rented nodes in full (what a cloud that rents whole nodes bills)."""
    cost_per_sample: float
    throughput: float
    """Samples per second, from the cost model."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": dict(self.nodes),
            "devices": dict(self.devices),
            "price_per_hour": self.price_per_hour,
            "node_price_per_hour": self.node_price_per_hour,
            "cost_per_sample": self.cost_per_sample,
            "throughput": self.throughput,
        }


def rental(plan: Plan, cluster: ClusterSpec, estimate: Estimate) -> Rental:
    """The rental of ``plan`` on ``cluster``, priced with its ``estimate``; kinds and types in
    the cluster's order."""
    used = set(plan.devices)
    by_name = {n.name: n for n in cluster.nodes}
    rented = {cluster.device(d).node for d in used}
    nodes: dict[str, int] = {}
    node_price = 0.0
    for node in cluster.nodes:
        if node.name in rented:
            nodes[kind_of(node)] = nodes.get(kind_of(node), 0) + 1
            node_price += sum(
                c * cluster.device_types[t].price_per_hour
                for t, c in by_name[node.name].devices.items()
            )
    devices: dict[str, int] = {}
    for d in cluster.device_ids:
        if d in used:
            t = cluster.device(d).type
            devices[t] = devices.get(t, 0) + 1
    return Rental(
        nodes=nodes,
        devices=devices,
        price_per_hour=estimate.cost_per_hour,
        node_price_per_hour=node_price,
        cost_per_sample=estimate.cost_per_sample,
        throughput=estimate.throughput,
    )
