"""Provisioning from a catalogue (HeterPS): planners over models x catalogues x throughput
targets, on the cost objective.

Per instance and planner: $/sample (cost model), its ratio to ``provision_dp``'s (exact for
the bottleneck bound over node-exclusive one-kind stages; the simulation chooses among its
candidates, so another planner may come out lower: a ratio < 1), whether the target is met,
search time, and the saving against two naive rentals at the same plan's throughput need:

- **fastest kind only**: ``provision_dp`` on the catalogue cut to the kind of the fastest
  device type (its cheapest plan meeting the target; "none" when that kind cannot);
- **everything**: every node of the catalogue rented, at the planner's throughput
  (``catalogue $/hour / 3600 / throughput``).

Targets are multiples of the throughput of the cheapest single-node plan of the instance.

    .venv/bin/python -m bench.provisioning --quick      # < 2 minutes
    .venv/bin/python -m bench.provisioning              # the full sweep
Writes ``bench/results/provisioning/<UTC date-time>.json`` (``--quick``: under
``provisioning_quick/``; :mod:`bench.record`; ``--out`` elsewhere); failures are recorded as
``null`` values with their one-line reason.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import common
from bench.common import OUT_HELP, fmt
from bench.record import BenchRun, display, load_average
from pipeplan.agents.problem import Budget, Objective, Problem
from pipeplan.agents.provision.rental import kind_of, rental
from pipeplan.agents.registry import make_planner
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import ModelProfile
from pipeplan.service.tasks.common import PRESETS_DIR, zoo_profile
from pipeplan.service.tasks.progress import QUIET

Doc = dict[str, Any]


@dataclass(frozen=True)
class Setup:
    """What one run sweeps."""

    models: tuple[tuple[str, int], ...]  # zoo name, input size
    catalogues: tuple[str, ...]
    multiples: tuple[float, ...]  # targets, x the cheapest single-node throughput
    planners: dict[str, dict[str, Any]]
    batch: int
    seconds: float  # search budget of the search planners


QUICK = Setup(
    models=(("alexnet", 224),),
    catalogues=("cloud-catalogue", "cloud-catalogue-small"),
    multiples=(0.5, 1.5, 2.5),
    planners={
        "provision_dp": {},
        "heterps_cpu_gpu": {},
        "heterps_rl": {"iterations": 15},
        "greedy": {},
        "genetic": {},
        "tapp": {},
    },
    batch=256,
    seconds=3.0,
)
FULL = Setup(
    models=(("alexnet", 224), ("vgg16", 64)),
    catalogues=("cloud-catalogue", "cloud-catalogue-small"),
    multiples=(0.5, 1.0, 2.0, 2.5),
    planners={
        "provision_dp": {},
        "heterps_cpu_gpu": {},
        "heterps_rl": {},
        "greedy": {},
        "genetic": {},
        "tapp": {},
    },
    batch=256,
    seconds=8.0,
)


def catalogue(name: str) -> ClusterSpec:
    """A preset catalogue; ``-small``: the same kinds, at most 4 nodes of each."""
    base = ClusterSpec.load(PRESETS_DIR / f"{name.removesuffix('-small')}.yaml")
    if not name.endswith("-small"):
        return base
    doc = base.to_dict()
    for entry in doc["nodes"]:
        if "count" in entry:
            entry["count"] = min(entry["count"], 4)
    return ClusterSpec.from_dict(doc | {"name": name})


def only_kind(cluster: ClusterSpec, kind: str) -> ClusterSpec:
    nodes = tuple(n for n in cluster.nodes if kind_of(n) == kind)
    return ClusterSpec(f"{cluster.name}:{kind}", cluster.device_types, nodes, cluster.network)


def fastest_kind(cluster: ClusterSpec) -> str:
    return max(
        (kind_of(n) for n in cluster.nodes),
        key=lambda k: max(
            cluster.device_types[t].flops
            for n in cluster.nodes
            if kind_of(n) == k
            for t in n.devices
        ),
    )


def problem(profile: ModelProfile, cluster: ClusterSpec, tp: float, setup: Setup) -> Problem:
    budget = Budget(evaluations=None, seconds=setup.seconds)
    return Problem(profile, cluster, Objective.COST, setup.batch, min_throughput=tp, budget=budget)


def base_throughput(profile: ModelProfile, cluster: ClusterSpec, setup: Setup) -> float:
    """The throughput of the cheapest plan at any speed (target 0)."""
    return (
        make_planner("provision_dp").plan(problem(profile, cluster, 0.0, setup)).estimate.throughput
    )


def run_one(name: str, options: dict[str, Any], p: Problem) -> Doc:
    start = time.perf_counter()
    try:
        r = make_planner(name, **options).plan(p)
    except PipeplanError as e:
        return {"cost_per_sample": None, "error": str(e).splitlines()[0][:300],
                "seconds": time.perf_counter() - start}  # fmt: skip
    hired = rental(r.plan, p.cluster, r.estimate)
    return {
        "cost_per_sample": hired.cost_per_sample,
        "price_per_hour": hired.price_per_hour,
        "throughput": hired.throughput,
        "met": hired.throughput >= (p.min_throughput or 0) and r.estimate.fits,
        "nodes": hired.nodes,
        "seconds": time.perf_counter() - start,
    }


def instance(model: str, size: int, cat: str, setup: Setup, console: Console) -> list[Doc]:
    profile = zoo_profile(model, size, QUIET)
    cluster = catalogue(cat)
    everything = sum(cluster.device_type(d).price_per_hour for d in cluster.device_ids)
    fast = fastest_kind(cluster)
    base = base_throughput(profile, cluster, setup)
    rows = []
    for mult in setup.multiples:
        tp = mult * base
        p = problem(profile, cluster, tp, setup)
        only = run_one("provision_dp", {}, problem(profile, only_kind(cluster, fast), tp, setup))
        runs = {name: run_one(name, opts, p) for name, opts in setup.planners.items()}
        exact = runs["provision_dp"]["cost_per_sample"]
        for doc in runs.values():
            c = doc["cost_per_sample"]
            if c is not None:
                doc["vs_exact"] = c / exact if exact else None
                doc["saving_vs_fastest_kind"] = (
                    1 - c / only["cost_per_sample"] if only["cost_per_sample"] else None
                )
                doc["saving_vs_everything"] = 1 - c / (everything / 3600 / doc["throughput"])
        rows.append({"model": model, "input_size": size, "catalogue": cat, "target": tp,
                     "multiple": mult, "fastest_kind": fast, "fastest_kind_only": only,
                     "planners": runs})  # fmt: skip
        console.print(f"{model} on {cat} at {tp:,.0f} samples/s: done")
    return rows


def table(rows: list[Doc]) -> Table:
    cols = ("model", "catalogue", "target/s", "planner", "$/sample", "vs exact", "met",
            "search s", "save vs fastest", "save vs all", "rental")  # fmt: skip
    left = ("model", "catalogue", "planner", "rental")
    t = common.table("provisioning: $/sample against provision_dp", cols, left)
    for row in rows:
        for name, d in row["planners"].items():
            rent = (
                ", ".join(f"{k} x{n}" for k, n in d.get("nodes", {}).items())
                or d.get("error", "")[:40]
            )
            t.add_row(
                row["model"], row["catalogue"], f"{row['target']:,.0f}", name,
                fmt(d["cost_per_sample"], ".3e"), fmt(d.get("vs_exact"), ".3f"),
                "yes" if d.get("met") else "no", f"{d['seconds']:.2f}",
                fmt(d.get("saving_vs_fastest_kind"), ".1%"),
                fmt(d.get("saving_vs_everything"), ".1%"),
                rent,
            )  # fmt: skip
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model, fewer targets (< 2 min)")
    ap.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = ap.parse_args()
    bench = BenchRun("provisioning_quick" if args.quick else "provisioning")
    setup = QUICK if args.quick else FULL
    console = Console(width=160)
    start = time.perf_counter()
    rows = []
    for model, size in setup.models:
        for cat in setup.catalogues:
            rows += instance(model, size, cat, setup, console)
    console.print(table(rows))
    doc = {
        "quick": args.quick,
        "batch": setup.batch,
        "search_seconds": setup.seconds,
        "wall_s": time.perf_counter() - start,
        "rows": rows,
    }
    out = bench.write(doc, out=args.out, indent=1)
    console.print(f"wrote {display(out)} in {doc['wall_s']:.0f} s (load average {load_average()})")


if __name__ == "__main__":
    main()
