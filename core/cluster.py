"""Cluster specifications: device types, nodes, links and device ids ``NODE/TYPE:INDEX``."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeplan.core import _io, rules
from pipeplan.core.calibration import Calibration
from pipeplan.core.errors import FormatError
from pipeplan.core.limits import MAX_DEVICES_PER_NODE, MAX_NODES, check_limit

DeviceId = str
_ID = re.compile(r"^(?P<node>[^/\s]+)/(?P<type>[^:/\s]+):(?P<index>\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


ACCELERATORS = ("cuda",)
"""What a device type's ``accelerator`` may name: ``cuda`` is a GPU its stages run on."""


@dataclass(frozen=True)
class DeviceType:
    """A kind of device: peak FLOP/s, memory, memory bandwidth and on-demand price;
    ``accelerator`` (``cuda``) when it is a GPU that real stages run on (None: the CPU)."""

    name: str
    flops: float
    memory_gb: float
    memory_bandwidth_gbps: float = 100.0
    price_per_hour: float = 0.0
    accelerator: str | None = None

    def __post_init__(self) -> None:
        where = f"device_types.{self.name}"
        for key in ("flops", "memory_gb", "memory_bandwidth_gbps"):
            if not getattr(self, key) > 0:
                raise FormatError(f"{where}.{key}: must be > 0, got {getattr(self, key)!r}")
        if self.price_per_hour < 0:
            raise FormatError(f"{where}.price_per_hour: must be >= 0, got {self.price_per_hour!r}")
        if self.accelerator is not None and self.accelerator not in ACCELERATORS:
            raise FormatError(
                f"{where}.accelerator: {self.accelerator!r} is not one of "
                f"{', '.join(ACCELERATORS)} (leave it out for a CPU type)"
            )

    @property
    def memory_bytes(self) -> float:
        return float(rules.capacity_bytes(self.memory_gb))

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "flops": self.flops,
            "memory_gb": self.memory_gb,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "price_per_hour": self.price_per_hour,
        }
        return doc | ({"accelerator": self.accelerator} if self.accelerator else {})


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth in Gbit/s and latency in microseconds (rule 4's sends), and
    optionally its own ``all_reduce`` bandwidth and latency for rule 8's ring rounds.

    A ring round is not a lone send: every replica sends at once and adds what it receives.
    Where the replicas share a host (the emulated local clusters) a round moves its chunk
    at another rate than a stage's activations do (``python -m bench.links`` measures both);
    without ``all_reduce`` the ring uses the link's own numbers."""

    bandwidth_gbps: float
    latency_us: float
    ring_bandwidth_gbps: float | None = None
    ring_latency_us: float | None = None

    def __post_init__(self) -> None:
        check_link(
            self.bandwidth_gbps, self.latency_us, self.ring_bandwidth_gbps, self.ring_latency_us
        )

    @property
    def latency_s(self) -> float:
        return float(rules.latency_s(self.latency_us))

    @property
    def bytes_per_s(self) -> float:
        return float(rules.bytes_per_s(self.bandwidth_gbps))

    @property
    def ring_latency_s(self) -> float:
        """Rule 8's latency per ring round: ``all_reduce.latency_us``, else the link's."""
        us = self.latency_us if self.ring_latency_us is None else self.ring_latency_us
        return float(rules.latency_s(us))

    @property
    def ring_bytes_per_s(self) -> float:
        """Rule 8's bandwidth of a ring round: ``all_reduce.bandwidth_gbps``, else the link's."""
        gbps = self.bandwidth_gbps if self.ring_bandwidth_gbps is None else self.ring_bandwidth_gbps
        return float(rules.bytes_per_s(gbps))

    def transfer_s(self, nbytes: float) -> float:
        """One transfer over this link class (rule 4)."""
        return float(rules.transfer_s(nbytes, self.bytes_per_s, self.latency_s))

    def allreduce_s(self, params_bytes: float, replicas: int) -> float:
        """A ring all-reduce of ``params_bytes`` over ``replicas`` on this link class (rule 8)."""
        return float(
            rules.allreduce_s(params_bytes, replicas, self.ring_bytes_per_s, self.ring_latency_s)
        )

    def fitted(self, bandwidth_gbps: float, latency_us: float) -> Link:
        """This link with a calibration's fitted send numbers; its ``all_reduce`` (measured
        ring rounds) stays."""
        return replace(self, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)

    def ring_fitted(self, bandwidth_gbps: float, latency_us: float) -> Link:
        """This link with a calibration's fitted ring round (its ``all_reduce``); its sends
        stay."""
        return replace(self, ring_bandwidth_gbps=bandwidth_gbps, ring_latency_us=latency_us)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us}
        if self.ring_bandwidth_gbps is not None:
            doc["all_reduce"] = {
                "bandwidth_gbps": self.ring_bandwidth_gbps,
                "latency_us": self.ring_latency_us,
            }
        return doc


def check_link(
    bandwidth_gbps: float,
    latency_us: float,
    ring_bandwidth_gbps: float | None,
    ring_latency_us: float | None,
    where: str = "network",
) -> None:
    """Refuse a link's numbers that no link has, naming the field under ``where`` (a spec's
    ``network.inter_node``, or ``network`` for a :class:`Link` built in code)."""
    if not bandwidth_gbps > 0:
        raise FormatError(f"{where}.bandwidth_gbps: must be > 0, got {bandwidth_gbps!r}")
    if latency_us < 0:
        raise FormatError(f"{where}.latency_us: must be >= 0, got {latency_us!r}")
    if (ring_bandwidth_gbps is None) != (ring_latency_us is None):
        raise FormatError(
            f"{where}.all_reduce: needs both bandwidth_gbps and latency_us, got "
            f"{ring_bandwidth_gbps!r} and {ring_latency_us!r}"
        )
    if ring_bandwidth_gbps is not None and not ring_bandwidth_gbps > 0:
        raise FormatError(
            f"{where}.all_reduce.bandwidth_gbps: must be > 0, got {ring_bandwidth_gbps!r}"
        )
    if ring_latency_us is not None and not ring_latency_us >= 0:
        raise FormatError(f"{where}.all_reduce.latency_us: must be >= 0, got {ring_latency_us!r}")


@dataclass(frozen=True)
class Network:
    intra_node: Link = Link(100.0, 5.0)
    inter_node: Link = Link(10.0, 50.0)


@dataclass(frozen=True)
class Node:
    """A machine: how many devices of each type it holds.

    ``count: N`` makes it a catalogue entry, ``N`` identical nodes to rent from: a
    :class:`ClusterSpec` holds them expanded, named ``NAME-0 .. NAME-(N-1)``, each with
    ``kind`` = ``NAME`` (what the provisioning objective reports counts of) and no count.
    """

    name: str
    devices: Mapping[str, int] = field(default_factory=dict)
    count: int | None = None
    kind: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", _io.FrozenMap(dict(self.devices)))


@dataclass(frozen=True)
class Device:
    """One device of the cluster."""

    id: DeviceId
    node: str
    type: str
    index: int


def parse_device_id(device_id: str) -> tuple[str, str, int]:
    """``"n1/t4:0"`` -> ``("n1", "t4", 0)``; a clear error otherwise."""
    m = _ID.match(device_id) if isinstance(device_id, str) else None
    if not m:
        raise FormatError(f"device id {device_id!r}: expected NODE/TYPE:INDEX, e.g. 'n1/t4:0'")
    return m["node"], m["type"], int(m["index"])


def device_id(node: str, type_: str, index: int) -> DeviceId:
    return f"{node}/{type_}:{index}"


@dataclass(frozen=True)
class ClusterSpec:
    """A heterogeneous cluster: device types, nodes and the two link classes."""

    name: str
    device_types: Mapping[str, DeviceType]
    nodes: tuple[Node, ...]
    network: Network = Network()
    emulation_headroom: float = 1.0
    """Only for a cluster *emulated* on one machine (``executor``): the fastest type runs this
    many times slower than the machine's core, every other type in proportion, so that
    waiting for a core on a busy machine is absorbed by the emulation instead of adding to
    it (``emulation: {headroom: 1.5}`` in the file; 1 = the fastest type is the core)."""
    calibration: Calibration | None = None
    """What measured runs taught the cost model about this cluster (:mod:`core.calibration`):
    compute scales, call overheads and update bandwidths per type, fitted links, a per-step
    overhead."""
    _devices: Mapping[DeviceId, Device] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = self.emulation_headroom
        if isinstance(h, bool) or not isinstance(h, int | float) or not h >= 1.0:
            raise FormatError(f"cluster {self.name!r}.emulation.headroom: must be >= 1, got {h!r}")
        object.__setattr__(self, "device_types", _io.FrozenMap(dict(self.device_types)))
        if not self.nodes:
            raise FormatError(f"cluster {self.name!r}.nodes: empty; a cluster needs >= 1 node")
        object.__setattr__(self, "nodes", _expand(self.name, tuple(self.nodes), self.device_types))
        devices: dict[DeviceId, Device] = {}
        for node in self.nodes:
            for t, count in node.devices.items():
                for k in range(count):
                    d = Device(device_id(node.name, t, k), node.name, t, k)
                    devices[d.id] = d
        if not devices:
            raise FormatError(f"cluster {self.name!r}: no devices on any node")
        object.__setattr__(self, "_devices", _io.FrozenMap(devices))
        if self.calibration is not None:
            self.calibration.check_types(self.device_types)

    # --- devices ------------------------------------------------------------------------------

    @property
    def device_ids(self) -> tuple[DeviceId, ...]:
        """Every device id, node by node, type by type (a stable order)."""
        return tuple(self._devices)

    def device(self, device_id: DeviceId) -> Device:
        if device_id not in self._devices:
            parse_device_id(device_id)  # a malformed id gets the format message
            raise FormatError(
                f"device id {device_id!r}: not in cluster {self.name!r} "
                f"(devices: {', '.join(self.device_ids)})"
            )
        return self._devices[device_id]

    def device_type(self, device_id: DeviceId) -> DeviceType:
        return self.device_types[self.device(device_id).type]

    def memory_bandwidth_gbps(self, type_name: str) -> float:
        """The bandwidth rule 8's update uses on a type: the calibration's fitted one where it
        has it, else the spec's ``memory_bandwidth_gbps``."""
        cal = self.calibration
        if cal is not None and type_name in cal.memory_bandwidth_gbps:
            return float(cal.memory_bandwidth_gbps[type_name])
        return self.device_types[type_name].memory_bandwidth_gbps

    def link(self, a: Iterable[DeviceId], b: Iterable[DeviceId]) -> Link:
        """Inter-node if any pair of the two sets crosses nodes, else intra-node."""
        nodes = {self.device(d).node for d in a} | {self.device(d).node for d in b}
        return self.links.inter_node if len(nodes) > 1 else self.links.intra_node

    @property
    def links(self) -> Network:
        """The link classes the cost model uses: the calibration's fitted sends and ring
        rounds where it has them, else the spec's ``network``."""
        cal = self.calibration
        if cal is None or not (cal.network or cal.all_reduce):
            return self.network

        def link(name: str) -> Link:
            out: Link = getattr(self.network, name)
            if name in cal.network:
                out = out.fitted(*cal.network[name])
            if name in cal.all_reduce:
                out = out.ring_fitted(*cal.all_reduce[name])
            return out

        return Network(intra_node=link("intra_node"), inter_node=link("inter_node"))

    def calibrated(self, calibration: Calibration | None) -> ClusterSpec:
        """This cluster with another calibration (None: uncalibrated)."""
        return ClusterSpec(
            self.name,
            self.device_types,
            self.nodes,
            self.network,
            self.emulation_headroom,
            calibration,
        )

    def fastest_flops(self) -> float:
        used = {d.type for d in self._devices.values()}
        return max(self.device_types[t].flops for t in used)

    def counts_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self._devices.values():
            out[d.type] = out.get(d.type, 0) + 1
        return out

    # --- documents ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        net = self.network
        return {
            "name": self.name,
            "device_types": {n: t.to_dict() for n, t in self.device_types.items()},
            "nodes": _node_docs(self.nodes),
            "network": {
                "intra_node": net.intra_node.to_dict(),
                "inter_node": net.inter_node.to_dict(),
            },
        } | (
            ({"emulation": {"headroom": self.emulation_headroom}} if self.emulated_slower else {})
            | ({"calibration": self.calibration.to_dict()} if self.calibration else {})
        )

    @property
    def emulated_slower(self) -> bool:
        """Whether an emulation runs even the fastest type slower than the machine's core."""
        return self.emulation_headroom != 1.0

    @classmethod
    def from_dict(cls, doc: Any) -> ClusterSpec:
        name = _io.text(doc, "name", "cluster")
        types_doc = _io.field(doc, "device_types", "cluster")
        if not isinstance(types_doc, Mapping) or not types_doc:
            raise FormatError(
                f"cluster.device_types: expected a non-empty object, got {types_doc!r}"
            )
        types = {}
        for t, d in types_doc.items():
            where = f"device_types.{t}"
            types[str(t)] = DeviceType(
                name=str(t),
                flops=_io.number(d, "flops", where),
                memory_gb=_io.number(d, "memory_gb", where),
                memory_bandwidth_gbps=_io.number(d, "memory_bandwidth_gbps", where, 100.0),
                price_per_hour=_io.number(d, "price_per_hour", where, 0.0),
                accelerator=_accelerator(d, where),
            )
        nodes_doc = _io.field(doc, "nodes", "cluster")
        if not isinstance(nodes_doc, list):
            raise FormatError(f"cluster.nodes: expected a list, got {nodes_doc!r}")
        check_limit("cluster.nodes", len(nodes_doc), MAX_NODES, "nodes", FormatError)
        nodes = []
        for i, n in enumerate(nodes_doc):
            devs = _io.field(n, "devices", f"nodes[{i}]")
            if not isinstance(devs, Mapping):
                raise FormatError(f"nodes[{i}].devices: expected an object, got {devs!r}")
            count = _io.field(n, "count", f"nodes[{i}]", None)
            if count is not None:
                count = _io.integer(n, "count", f"nodes[{i}]", minimum=1)
            node_name = _io.text(n, "name", f"nodes[{i}]")
            nodes.append(Node(node_name, {str(k): v for k, v in devs.items()}, count))
        net_doc = _io.field(doc, "network", "cluster", {}) or {}
        network = Network(
            intra_node=_link(net_doc, "intra_node", Network.intra_node),
            inter_node=_link(net_doc, "inter_node", Network.inter_node),
        )
        emulation = _io.field(doc, "emulation", "cluster", {}) or {}
        if not isinstance(emulation, Mapping):
            raise FormatError(f"cluster.emulation: expected an object, got {emulation!r}")
        headroom = _io.number(emulation, "headroom", "emulation", 1.0, minimum=1.0)
        calibration = _io.field(doc, "calibration", "cluster", None)
        return cls(
            name,
            types,
            tuple(nodes),
            network,
            headroom,
            None if calibration is None else Calibration.from_dict(calibration),
        )

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        return cls.from_dict(_io.read_document(path))

    def save(self, path: str | Path) -> None:
        p = Path(path)
        if p.suffix.lower() == ".json":
            _io.write_json(p, self.to_dict())
        else:
            _io.write_yaml(p, self.to_dict())


def _accelerator(doc: Any, where: str) -> str | None:
    value = _io.field(doc, "accelerator", where, None)
    if value is not None and not isinstance(value, str):
        raise FormatError(f"{where}.accelerator: expected a name such as 'cuda', got {value!r}")
    return value


def _link(net_doc: Any, key: str, default: Link) -> Link:
    d = _io.field(net_doc, key, "network", None)
    if d is None:
        return default
    where, ring_where = f"network.{key}", f"network.{key}.all_reduce"
    bandwidth = _io.number(d, "bandwidth_gbps", where, default.bandwidth_gbps)
    latency = _io.number(d, "latency_us", where, default.latency_us)
    _io.known_keys(d, where, LINK_KEYS | {"all_reduce"})
    ring = d.get("all_reduce")
    ring_bandwidth = ring_latency = None
    if ring is not None:
        ring_bandwidth = _io.number(ring, "bandwidth_gbps", ring_where)
        ring_latency = _io.number(ring, "latency_us", ring_where)
        _io.known_keys(ring, ring_where, LINK_KEYS)
    check_link(bandwidth, latency, ring_bandwidth, ring_latency, where)
    return Link(bandwidth, latency, ring_bandwidth, ring_latency)


LINK_KEYS = frozenset({"bandwidth_gbps", "latency_us"})
"""A link's numbers, and its ``all_reduce``'s."""


def _expand(
    cluster: str, nodes: tuple[Node, ...], types: Mapping[str, DeviceType]
) -> tuple[Node, ...]:
    """Every node checked, then each ``count: N`` entry replaced by its ``N`` nodes
    ``NAME-k`` of kind ``NAME``. The node limit counts the expanded nodes and is checked
    before any is made."""
    for i, node in enumerate(nodes):
        _check_node(i, node, types)
    total = sum(1 if n.count is None else n.count for n in nodes)
    check_limit(
        f"cluster {cluster!r}.nodes (counts included)", total, MAX_NODES, "nodes", FormatError
    )
    out: list[Node] = []
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if node.count is None:
            made = [node]
        else:
            made = [
                Node(f"{node.name}-{k}", node.devices, kind=node.name) for k in range(node.count)
            ]
        for m in made:
            if m.name in seen:
                how = f" (node {m.name!r} of its count)" if m.kind else ""
                raise FormatError(f"nodes[{i}].name: {m.name!r} appears twice{how}")
            seen.add(m.name)
        out += made
    return tuple(out)


def _node_docs(nodes: tuple[Node, ...]) -> list[dict[str, Any]]:
    """The nodes as documents: a run of nodes ``KIND-0 .. KIND-(N-1)`` of one kind and the
    same devices is written back as one entry with ``count: N``."""
    docs: list[dict[str, Any]] = []
    i = 0
    while i < len(nodes):
        node, n = nodes[i], 1
        if node.kind is not None and node.name == f"{node.kind}-0":
            while (
                i + n < len(nodes)
                and nodes[i + n].kind == node.kind
                and nodes[i + n].name == f"{node.kind}-{n}"
                and nodes[i + n].devices == node.devices
            ):
                n += 1
            docs.append({"name": node.kind, "devices": dict(node.devices), "count": n})
        else:
            docs.append({"name": node.name, "devices": dict(node.devices)})
        i += n
    return docs


def _check_node(i: int, node: Node, types: Mapping[str, DeviceType]) -> None:
    """A node's name (safe), count (>= 1 when given) and device counts (known types, >= 0,
    within the limit), checked before any of its devices is made."""
    if not _NAME.match(node.name):
        raise FormatError(
            f"nodes[{i}].name: {node.name!r} may hold only letters, digits, '_', '.', '-'"
        )
    c = node.count
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise FormatError(f"nodes[{i}] ({node.name}).count: expected an integer >= 1, got {c!r}")
    where = f"nodes[{i}] ({node.name}).devices"
    for t, count in node.devices.items():
        if t not in types:
            raise FormatError(
                f"{where}: unknown device type {t!r} (known: {', '.join(sorted(types)) or 'none'})"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise FormatError(f"{where}.{t}: expected a count >= 0, got {count!r}")
    total = sum(node.devices.values())
    check_limit(where, total, MAX_DEVICES_PER_NODE, "devices on one node", FormatError)
