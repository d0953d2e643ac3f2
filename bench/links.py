"""The local cluster's links, measured: how long a payload takes from one stage to the next.

The cost model charges a send ``latency + bytes / bandwidth`` (DESIGN.md rule 4) and the ring
all-reduce ``2 (r-1)`` such sends of ``params / r`` bytes (rule 8), with one latency and one
bandwidth per link class (``inter_node``, ``intra_node``). This benchmark measures those sends
the way the executor makes them and fits the two numbers per class.

A probe actor on the sending device returns a numpy array of ``S`` bytes (a stage's payload
is a dict of numpy arrays, :mod:`executor.payloads`) and notes when its method body ended; an
actor on the receiving device, called with that result before it exists (as
:mod:`executor.submit` chains a stage's operations), notes when its own method body began.
The difference is the send: serialisation into the sender's object store, the pull into the
receiver's (between Ray nodes), the dispatch of the waiting call. Sizes from 64 KB (a
microbatch's activations) to 256 MB (a ring chunk of VGG-16 on two replicas), each sent
``--repeats`` times; the fit minimises the relative errors of the medians (weighted linear
least squares), so a 64 KB send counts as much as a 256 MB one.

Both clocks are this machine's (``time.time()`` in two processes): the local cluster's nodes
are processes of one machine.

    .venv/bin/python -m bench.links                       # local-pipeline's nodes
    .venv/bin/python -m bench.links --cluster examples/clusters/local-hetero.yaml
Prints a table (measured median and range, the spec's prediction, the fit's) and writes
bench/results/links.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from core.cluster import ClusterSpec, Link
from executor.live_cluster import live_nodes
from executor.local_cluster import LocalCluster
from executor.pinning import actor_options

RESULTS = Path(__file__).parent / "results"
CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "local-pipeline.yaml"
SIZES_KB = (64, 512, 2048, 8192, 32768, 131072, 262144)
STORE_MB = 2400  # as bench.fidelity: a 256 MB payload and its copy fit without spilling


@ray.remote
class Probe:
    """One end of a measured send."""

    @ray.method(num_returns=2)
    def make(self, n_bytes: int) -> tuple[float, np.ndarray]:
        data = np.ones(n_bytes // 4, dtype=np.float32)
        return time.time(), data

    def take(self, data: np.ndarray) -> tuple[float, int]:
        return time.time(), int(data.nbytes)


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
    """``latency + bytes / bandwidth`` through the points, minimising relative errors."""
    x = np.asarray(sizes, float)
    y = np.asarray(seconds, float)
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if latency <= 0 or per_byte <= 0:
        raise ValueError(f"links: no positive fit (latency {latency}, s/byte {per_byte})")
    return Fit(float(latency), float(1.0 / per_byte))


def spec_fit(link: Link) -> Fit:
    return Fit(link.latency_s, link.bytes_per_s)


def measure_pair(src: str, dst: str, repeats: int) -> dict[int, list[float]]:
    """Seconds of each send from device ``src`` to device ``dst``, per size in bytes."""
    nodes = live_nodes()
    sender = Probe.options(**actor_options(src, nodes)).remote()  # type: ignore[attr-defined]
    receiver = Probe.options(**actor_options(dst, nodes)).remote()  # type: ignore[attr-defined]
    out: dict[int, list[float]] = {}
    try:
        ray.get([sender.make.remote(1024)[0], receiver.take.remote(np.ones(4))])  # warm both
        for kb in SIZES_KB:
            n = kb * 1024
            times = []
            for _ in range(repeats + 1):  # the first of each size warms the stores
                end, made = sender.make.remote(n)
                started, got = ray.get(receiver.take.remote(made))
                ended = ray.get(end)
                if got != n:
                    raise RuntimeError(f"links: sent {n} bytes, received {got}")
                times.append(started - ended)
                del end, made
            out[n] = times[1:]
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    return out


def pairs(spec: ClusterSpec) -> dict[str, tuple[str, str]]:
    """A device pair per link class the cluster has: two nodes' first devices, and two
    devices of one node."""
    devices = spec.device_ids
    by_node: dict[str, list[str]] = {}
    for d in devices:
        by_node.setdefault(d.split("/")[0], []).append(d)
    nodes = list(by_node)
    out = {}
    if len(nodes) > 1:
        out["inter_node"] = (by_node[nodes[0]][0], by_node[nodes[1]][0])
    shared = next((ds for ds in by_node.values() if len(ds) > 1), None)
    if shared:
        out["intra_node"] = (shared[0], shared[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(CLUSTER))
    ap.add_argument("--repeats", type=int, default=7, help="sends per size (after one warm-up)")
    ap.add_argument("--out", default=str(RESULTS / "links.json"))
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {a.repeats}")
    spec = ClusterSpec.load(a.cluster)
    console = Console(width=140)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    classes: dict[str, Any] = {}
    with LocalCluster(spec, object_store_mb=STORE_MB, keep_awake=False):
        for cls, (src, dst) in pairs(spec).items():
            times = measure_pair(src, dst, a.repeats)
            sizes = sorted(times)
            medians = [statistics.median(times[n]) for n in sizes]
            fit = fit_link(sizes, medians)
            given = spec_fit(getattr(spec.network, cls))
            classes[cls] = {
                "pair": [src, dst],
                "fit": fit.to_dict(),
                "spec": given.to_dict(),
                "sizes": [
                    {
                        "bytes": n,
                        "seconds": times[n],
                        "median_s": m,
                        "spec_s": given.predict(n),
                        "fit_s": fit.predict(n),
                    }
                    for n, m in zip(sizes, medians, strict=True)
                ],
            }
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()[0]
    for cls, c in classes.items():
        t = Table(title=f"{cls} ({c['pair'][0]} -> {c['pair'][1]}), ms", title_justify="left")
        for col in ("size", "measured median", "min-max", "spec", "fit", "spec err", "fit err"):
            t.add_column(col, justify="right")
        for r in c["sizes"]:
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
        f, s = c["fit"], c["spec"]
        console.print(
            f"{cls}: fit latency {f['latency_us']:.0f} us, bandwidth {f['bandwidth_gbps']:.2f} "
            f"Gbit/s (spec: {s['latency_us']:.0f} us, {s['bandwidth_gbps']:.2f} Gbit/s)"
        )
    console.print(f"wall {wall:.0f} s, load average {load0:.1f} -> {load1:.1f}")
    doc = {
        "cluster": spec.name,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load_average_start_end": [load0, load1],
        "repeats": a.repeats,
        "wall_s": wall,
        "classes": classes,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
