"""The local cluster's links, measured: how long a payload takes from one stage to the next.

The cost model charges a send ``latency + bytes / bandwidth`` (DESIGN.md rule 4) and the ring
all-reduce ``2 (r-1)`` such sends of ``params / r`` bytes (rule 8), with one latency and one
bandwidth per link class (``inter_node``, ``intra_node``). This benchmark measures those sends
the way the executor makes them and fits the two numbers per class.

A probe actor on the sending device and one on the receiving device join a gloo process group
as a run's stage actors do (:mod:`executor.transport`); the receiver posts its receive, the
sender notes when it posts its send of ``S`` bytes and the receiver when the bytes have
arrived. The difference is the send as a stage makes it. Sizes from 64 KB (a microbatch's
activations) to 256 MB (a ring chunk of VGG-16 on two replicas), each sent ``--repeats``
times; the fit minimises the relative errors of the medians (weighted linear least squares),
so a 64 KB send counts as much as a 256 MB one.

Both clocks are this machine's (``time.time()`` in two processes): the local cluster's nodes
are processes of one machine.

An all-reduce sends differently: in a ring every replica sends a chunk to the next one at the
same time, ``2 (r-1)`` rounds in a row. The ring part sums as a replicated stage does
(gloo's ``dist.all_reduce``; replicas of one node through shared memory,
:mod:`executor.shared_sum`) over ``r`` probe actors (all the cluster's devices, as BSP; and the
devices of its largest node) on ``r`` chunks and divides its time by the rounds: per round,
against the spec's ``latency + chunk / bandwidth`` for the link class the cost model
gives those devices. On one machine the replicas' concurrent sends share its cores and its
loopback, so a round is not a lone send. Last, the bench fits one line per class to what a
plan sends: lone sends up to 8 MB (activations) and the ring's rounds together.

    .venv/bin/python -m bench.links                       # local-pipeline's nodes
    .venv/bin/python -m bench.links --cluster examples/clusters/local-hetero.yaml
Prints a table (measured median and range, the spec's prediction, the fit's) and writes
``bench/results/links/<UTC date-time>.json`` (:mod:`bench.record`; another cluster than
``local-pipeline``: ``bench/results/links_<cluster>/``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from rich.console import Console
from scipy.optimize import nnls

from bench.common import OUT_HELP, table
from bench.record import BenchRun, display, load_average
from pipeplan.core.cluster import ClusterSpec, Link, parse_device_id
from pipeplan.executor import shared_sum, transport
from pipeplan.executor.live_cluster import live_nodes
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.pinning import actor_options

DEFAULT_CLUSTER = "local-pipeline"
CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / f"{DEFAULT_CLUSTER}.yaml"
SIZES_KB = (64, 512, 2048, 8192, 32768, 131072, 262144)
RING_CHUNKS_KB = (4096, 16384, 65536, 131072)
"""Ring chunks: params / r, e.g. ResNet-50 (25 MB) to VGG-16 (138 MB) on four replicas."""
ACTIVATION_MAX = 8 * 2**20
"""Lone sends up to this size count as activations in the combined fit."""
STORE_MB = 300  # payloads travel over the process group, not through the object store


@ray.remote
class Probe:
    """One rank of a measured process group (as the stage actors form one)."""

    def open(self, world: int) -> tuple[str, int]:
        self.sock = transport.listen(ray.util.get_node_ip_address())
        self.store = transport.open_store(self.sock, world, 120.0)
        address, port = self.sock.getsockname()[:2]
        return str(address), int(port)

    def join(
        self, address: str, port: int, rank: int, nodes: tuple[str, ...], max_floats: int = 0
    ) -> bool:
        """Join the group; whether its ranks sum through shared memory (all on one node).
        ``max_floats``: the largest all-reduce to come, whose gradient regions the shared
        segment is made to hold (as a stage's holds its gradients)."""
        ranks = tuple(range(len(nodes)))
        spec = transport.GroupSpec(address, port, rank, (ranks,), "gloo", 120.0, nodes)
        transport.join(spec, getattr(self, "store", None))
        self.shared = None
        if shared_sum.enabled():
            name = f"pipeplan-links-{address}-{port}"
            layout = _layout(max_floats) if max_floats else None
            self.shared = shared_sum.open_shared_sum(None, ranks, rank, nodes[rank], name, layout)
        return self.shared is not None

    def send(self, n_bytes: int, dst: int) -> float:
        """Post a send of ``n_bytes``; the moment it was posted (a stage's op end)."""
        buffer = torch.ones(n_bytes, dtype=torch.uint8)
        posted = time.time()
        transport.isend(buffer, dst, 0).wait()
        return posted

    def recv(self, n_bytes: int, src: int) -> tuple[float, int]:
        """Receive ``n_bytes`` (posted ahead, as a stage does); the moment it arrived."""
        (got,) = transport.recv_all([(torch.empty(n_bytes, dtype=torch.uint8), src, 0)], 120.0)
        return time.time(), int(got.numel())

    def all_reduce(self, n_floats: int) -> tuple[float, float]:
        """One all-reduce of ``n_floats`` after a barrier: its start and end. Replicas of
        one node sum as a stage's do: in place in their gradient regions of the shared
        segment where those fit (the backward wrote the gradients there, untimed), else
        through its chunk buffers; others with gloo's ``all_reduce``."""
        flat = torch.ones(n_floats, dtype=torch.float32)
        shared = self.shared.for_params(_layout(n_floats)) if self.shared is not None else None
        if shared is not None and shared.layout is not None:
            shared.grad_view("g").copy_(flat)
        torch.distributed.barrier()
        t0 = time.time()
        if shared is not None and shared.layout is not None:
            shared.sum_regions({"g"})
        elif shared is not None:
            shared.sum_(flat)
        else:
            torch.distributed.all_reduce(flat)
        return t0, time.time()

    def leave(self) -> None:
        transport.leave()


def _layout(n_floats: int) -> shared_sum.ArenaLayout:
    """The gradient regions' layout of one float32 parameter ``g`` of ``n_floats``."""
    shape_only = torch.empty(1, dtype=torch.float32).expand(n_floats)  # nothing allocated
    layout = shared_sum.ArenaLayout.of({"g": shape_only})
    assert layout is not None
    return layout


def group(devices: list[str], max_floats: int = 0) -> list[Any]:
    """One probe actor per device, joined in one gloo group (rank = position);
    ``max_floats``: the largest all-reduce the group will make (:meth:`Probe.join`)."""
    nodes = live_nodes()
    actors = [Probe.options(**actor_options(d, nodes)).remote() for d in devices]  # type: ignore[attr-defined]
    address, port = ray.get(actors[0].open.remote(len(actors)))
    where = tuple(parse_device_id(d)[0] for d in devices)
    ray.get([a.join.remote(address, port, r, where, max_floats) for r, a in enumerate(actors)])
    return actors


@dataclass(frozen=True)
class Fit:
    latency_s: float
    bytes_per_s: float

    def predict(self, n_bytes: float) -> float:
        return self.latency_s + n_bytes / self.bytes_per_s

    def to_dict(self) -> dict[str, float]:
        """As a cluster spec's link: microseconds and Gbit/s."""
        return {"latency_us": self.latency_s * 1e6, "bandwidth_gbps": self.bytes_per_s * 8e-9}


def fit_link(sizes: list[int], seconds: list[float]) -> Fit:
    """``latency + bytes / bandwidth`` through the points, minimising relative errors, with
    neither term below zero (a shared-memory sum has next to no latency: its best line may
    pass through the origin)."""
    x = np.asarray(sizes, float)
    y = np.asarray(seconds, float)
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (latency, per_byte), _ = nnls(a, np.ones_like(y))
    if per_byte <= 0:
        raise ValueError(f"links: no positive fit (latency {latency}, s/byte {per_byte})")
    return Fit(float(latency), float(1.0 / per_byte))


def spec_fit(link: Link) -> Fit:
    return Fit(link.latency_s, link.bytes_per_s)


def measure_pair(src: str, dst: str, repeats: int) -> dict[int, list[float]]:
    """Seconds of each send from device ``src`` to device ``dst``, per size in bytes: from the
    moment the sender posts it to the moment the receiver has it."""
    sender, receiver = group([src, dst])
    out: dict[int, list[float]] = {}
    try:
        for kb in SIZES_KB:
            n = kb * 1024
            times = []
            for _ in range(repeats + 1):  # the first of each size warms the connection
                got = receiver.recv.remote(n, 0)
                posted = ray.get(sender.send.remote(n, 1))
                arrived, size = ray.get(got)
                if size != n:
                    raise RuntimeError(f"links: sent {n} bytes, received {size}")
                times.append(arrived - posted)
            out[n] = times[1:]
    finally:
        for a in (sender, receiver):
            ray.kill(a)
    return out


def rounds(replicas: int) -> int:
    """Messages each replica sends in a ring all-reduce: ``2 (r-1)`` (rule 8)."""
    return 2 * (replicas - 1)


def measure_ring(devices: list[str], repeats: int) -> dict[int, list[float]]:
    """Seconds per round of an all-reduce over ``devices`` (gloo's, as the replicas of a
    stage run it), per chunk size in bytes: ``all_reduce`` of ``r`` chunks, from the latest
    start to the latest end over the replicas, divided by its ``2 (r-1)`` rounds."""
    r = len(devices)
    actors = group(devices, max(RING_CHUNKS_KB) * 1024 * r // 4)
    out: dict[int, list[float]] = {}
    try:
        for kb in RING_CHUNKS_KB:
            n = kb * 1024
            times = []
            for _ in range(repeats + 1):  # the first of each size warms the connections
                spans = ray.get([a.all_reduce.remote(n * r // 4) for a in actors])
                start, end = max(t0 for t0, _ in spans), max(t1 for _, t1 in spans)
                times.append((end - start) / rounds(r))
            out[n] = times[1:]
    finally:
        for a in actors:
            ray.kill(a)
    return out


def devices_by_node(spec: ClusterSpec) -> dict[str, list[str]]:
    by_node: dict[str, list[str]] = {}
    for d in spec.device_ids:
        by_node.setdefault(spec.device(d).node, []).append(d)
    return by_node


def rings(spec: ClusterSpec) -> dict[str, list[str]]:
    """The rings measured: every device (as BSP), and the devices of the largest node."""
    by_node = devices_by_node(spec)
    out = {"all devices": list(spec.device_ids)}
    node, largest = max(by_node.items(), key=lambda kv: len(kv[1]))
    if 1 < len(largest) < len(spec.device_ids):
        out[f"node {node}"] = largest
    return out


def pairs(spec: ClusterSpec) -> dict[str, tuple[str, str]]:
    """A device pair per link class the cluster has: two nodes' first devices, and two
    devices of one node."""
    by_node = devices_by_node(spec)
    nodes = list(by_node)
    out = {}
    if len(nodes) > 1:
        out["inter_node"] = (by_node[nodes[0]][0], by_node[nodes[1]][0])
    shared = next((ds for ds in by_node.values() if len(ds) > 1), None)
    if shared:
        out["intra_node"] = (shared[0], shared[1])
    return out


def summarise(times: dict[int, list[float]], link: Link) -> dict[str, Any]:
    """The line fitted to the medians of ``times`` (seconds per size in bytes), the spec's
    ``link``, and per size the measured seconds, their median and both predictions."""
    sizes = sorted(times)
    medians = [statistics.median(times[n]) for n in sizes]
    fit, given = fit_link(sizes, medians), spec_fit(link)
    rows = [
        {
            "bytes": n,
            "seconds": times[n],
            "median_s": m,
            "spec_s": given.predict(n),
            "fit_s": fit.predict(n),
        }
        for n, m in zip(sizes, medians, strict=True)
    ]
    return {"fit": fit.to_dict(), "spec": given.to_dict(), "rows": rows}


def print_rows(console: Console, title: str, rows: list[dict[str, Any]]) -> None:
    t = table(title, ("size", "measured median", "min-max", "spec", "fit", "spec err", "fit err"))
    for r in rows:
        m = r["median_s"]
        t.add_row(
            f"{r['bytes'] / 2**20:g} MiB",
            f"{m * 1e3:.1f}",
            f"{min(r['seconds']) * 1e3:.1f}-{max(r['seconds']) * 1e3:.1f}",
            f"{r['spec_s'] * 1e3:.1f}",
            f"{r['fit_s'] * 1e3:.1f}",
            f"{(r['spec_s'] - m) / m:+.0%}",
            f"{(r['fit_s'] - m) / m:+.0%}",
        )
    console.print(t)


def fit_line(fit: dict[str, float], spec: dict[str, float]) -> str:
    return (
        f"latency {fit['latency_us']:.0f} us, bandwidth {fit['bandwidth_gbps']:.2f} Gbit/s "
        f"(spec: {spec['latency_us']:.0f} us, {spec['bandwidth_gbps']:.2f} Gbit/s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(CLUSTER))
    ap.add_argument("--repeats", type=int, default=7, help="sends per size (after one warm-up)")
    ap.add_argument("--ring-repeats", type=int, default=3, help="all-reduces per chunk size")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    a = ap.parse_args()
    for name in ("repeats", "ring_repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    spec = ClusterSpec.load(a.cluster)
    bench = BenchRun("links" if spec.name == DEFAULT_CLUSTER else f"links_{spec.name}")
    console = Console(width=140)
    t0 = time.perf_counter()
    classes: dict[str, Any] = {}
    ring_docs: dict[str, Any] = {}
    with LocalCluster(spec, object_store_mb=STORE_MB, keep_awake=False):
        for cls, (src, dst) in pairs(spec).items():
            got = summarise(measure_pair(src, dst, a.repeats), getattr(spec.network, cls))
            classes[cls] = {
                "pair": [src, dst],
                "fit": got["fit"],
                "spec": got["spec"],
                "sizes": got["rows"],
            }
        for name, devices in rings(spec).items():
            cls = "inter_node" if len({spec.device(d).node for d in devices}) > 1 else "intra_node"
            got = summarise(measure_ring(devices, a.ring_repeats), getattr(spec.network, cls))
            ring_docs[name] = {
                "devices": devices,
                "class": cls,
                "rounds": rounds(len(devices)),
                "fit": got["fit"],
                "spec": got["spec"],
                "chunks": got["rows"],
            }
    wall = time.perf_counter() - t0
    for cls, c in classes.items():
        print_rows(console, f"{cls}: one send ({c['pair'][0]} -> {c['pair'][1]}), ms", c["sizes"])
        console.print(f"{cls}: fit {fit_line(c['fit'], c['spec'])}")
    for name, g in ring_docs.items():
        title = (
            f"ring all-reduce over {name} ({len(g['devices'])} replicas, {g['class']}): "
            f"ms per round, by chunk"
        )
        print_rows(console, title, g["chunks"])
        console.print(f"{name}: fit {fit_line(g['fit'], g['spec'])}")
    combined: dict[str, Any] = {}
    for cls, c in classes.items():
        points = [(r["bytes"], r["median_s"]) for r in c["sizes"] if r["bytes"] <= ACTIVATION_MAX]
        points += [
            (r["bytes"], r["median_s"])
            for g in ring_docs.values()
            if g["class"] == cls
            for r in g["chunks"]
        ]
        fit = fit_link([n for n, _ in points], [t for _, t in points])
        worst = max(abs(fit.predict(n) - t) / t for n, t in points)
        combined[cls] = {"fit": fit.to_dict(), "points": len(points), "worst_rel_error": worst}
        console.print(
            f"{cls}, sends up to {ACTIVATION_MAX / 2**20:g} MiB and ring rounds together: fit "
            f"{fit_line(fit.to_dict(), c['spec'])}; worst error {worst:.0%} of {len(points)}"
        )
    load0, load1 = bench.load_before[0], load_average()[0]
    console.print(f"wall {wall:.0f} s, load average {load0:.1f} -> {load1:.1f}")
    doc = {
        "cluster": spec.name,
        "repeats": a.repeats,
        "ring_repeats": a.ring_repeats,
        "wall_s": wall,
        "classes": classes,
        "rings": ring_docs,
        "combined": combined,
    }
    out = bench.write(doc, out=Path(a.out) if a.out else None, indent=1)
    console.print(f"wrote {display(out)}")


if __name__ == "__main__":
    main()
