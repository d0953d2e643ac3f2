"""Plan quality of every planner against the exact optimum, on zoo models and PipeDream
profiles over the cluster presets and random heterogeneous clusters.

Per instance and objective: each planner's objective value, its ratio to the exact optimum
(``brute`` where its space is small enough, else ``dp`` — the table says which), search time
and evaluations; the best plan against ``data_parallel`` (TAPP's BSP) and ``uniform``
(GPipe's split); unequal microbatches (``genetic``) against the best equal-microbatch plan.
The cost objective's throughput target is half the throughput of the fastest plan found.

    .venv/bin/python -m bench.plan_quality            # the default set (about 20-40 min)
    .venv/bin/python -m bench.plan_quality --quick    # two models, two clusters
Writes bench/results/plan_quality.json and plan_quality.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agents import Budget, InfeasibleError, Objective, Problem, ProblemError, make_planner
from bench.instances import PIPEDREAM, PRESETS, ZOO, Instance, instances

RESULTS = Path(__file__).parent / "results"
# label -> (planner, options); "genetic[equal]" isolates what unequal microbatches buy
PLANNERS: dict[str, tuple[str, dict[str, Any]]] = {
    "uniform": ("uniform", {}),
    "balanced": ("balanced", {}),
    "data_parallel": ("data_parallel", {}),
    "greedy": ("greedy", {}),
    "pipedream_dp": ("pipedream_dp", {}),
    "dp": ("dp", {}),
    "brute": ("brute", {}),
    "genetic": ("genetic", {}),
    "genetic[equal]": ("genetic", {"unequal": False}),
    "bayes": ("bayes", {}),
}
EQUAL = (
    "uniform",
    "balanced",
    "data_parallel",
    "greedy",
    "pipedream_dp",
    "dp",
    "brute",
    "genetic[equal]",
)


@dataclass
class Run:
    label: str
    value: float  # objective value, inf when it failed
    batch_time_s: float
    throughput: float
    cost_per_sample: float
    seconds: float
    evaluations: int
    error: str = ""


def run(
    label: str,
    inst: Instance,
    objective: Objective,
    batch: int,
    target: float | None,
    seconds: float,
    seed: int,
) -> Run:
    name, options = PLANNERS[label]
    problem = Problem(
        inst.profile,
        inst.spec,
        objective,
        batch,
        min_throughput=target,
        seed=seed,
        budget=Budget(evaluations=None, seconds=seconds),
    )
    t0 = time.perf_counter()
    try:
        r = make_planner(name, **options).plan(problem)
    except (InfeasibleError, ProblemError) as e:
        return Run(
            label,
            math.inf,
            math.nan,
            math.nan,
            math.nan,
            time.perf_counter() - t0,
            0,
            str(e).splitlines()[0][:160],
        )
    e = r.estimate
    return Run(
        label,
        r.value,
        e.batch_time_s,
        e.throughput,
        e.cost_per_sample,
        r.wall_time_s,
        r.evaluations,
    )


def evaluate_instance(
    inst: Instance,
    objective: Objective,
    batch: int,
    target: float | None,
    labels: list[str],
    seconds: float,
    seed: int,
) -> dict[str, Any]:
    runs = {lb: run(lb, inst, objective, batch, target, seconds, seed) for lb in labels}
    exact_by = (
        "brute"
        if math.isfinite(runs.get("brute", Run("", math.inf, 0, 0, 0, 0, 0)).value)
        else "dp"
    )
    exact = runs[exact_by].value if exact_by in runs else math.inf
    best = min(r.value for r in runs.values())
    out: dict[str, Any] = {
        "instance": inst.name,
        "model": inst.model,
        "cluster": inst.cluster,
        "layers": len(inst.profile),
        "devices": len(inst.spec.device_ids),
        "objective": objective.value,
        "global_batch": batch,
        "min_throughput": target,
        "exact_by": exact_by if math.isfinite(exact) else None,
        "exact": exact,
        "best": best,
        "runs": {lb: r.__dict__ for lb, r in runs.items()},
    }
    for lb, r in runs.items():
        out["runs"][lb]["ratio_to_exact"] = r.value / exact if math.isfinite(exact) else None
        out["runs"][lb]["ratio_to_best"] = r.value / best if math.isfinite(best) else None
    if objective is not Objective.COST:
        for base in ("data_parallel", "uniform"):
            if base in runs and math.isfinite(runs[base].value):
                out[f"speedup_vs_{base}"] = runs[base].value / best
    eq = [runs[lb].value for lb in EQUAL if lb in runs]
    if "genetic" in runs and eq:
        out["uedp_gain"] = min(eq) / runs["genetic"].value - 1.0
    return out


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def instance_table(doc: dict[str, Any]) -> Table:
    obj = doc["objective"]
    head = f"{doc['instance']} — {obj}" + (
        f" (min {doc['min_throughput']:.1f} samples/s)" if doc["min_throughput"] else ""
    )
    t = Table(title=head, title_justify="left")
    value_col = "$/Msample" if obj == "cost" else "batch ms"
    for col in (
        "planner",
        value_col,
        f"vs exact ({doc['exact_by'] or 'none'})",
        "search s",
        "evals",
        "note",
    ):
        t.add_column(col, justify="left" if col in ("planner", "note") else "right")
    for lb, r in doc["runs"].items():
        v = r["value"] * (1e6 if obj == "cost" else 1e3)
        t.add_row(
            lb,
            _fmt(v),
            _fmt(r["ratio_to_exact"], ".4f"),
            _fmt(r["seconds"], ".2f"),
            str(r["evaluations"]),
            r["error"][:70],
        )
    return t


def summary_tables(docs: list[dict[str, Any]], labels: list[str]) -> list[Table]:
    s = Table(
        title="Per planner over all instances: ratio to exact (1.0 = optimal)", title_justify="left"
    )
    for col in ("planner", "solved", "median", "worst", "within 2%", "mean search s"):
        s.add_column(col, justify="left" if col == "planner" else "right")
    for lb in labels:
        ratios = [
            d["runs"][lb]["ratio_to_exact"]
            for d in docs
            if lb in d["runs"]
            and d["runs"][lb]["ratio_to_exact"] is not None
            and math.isfinite(d["runs"][lb]["ratio_to_exact"])
        ]
        secs = [d["runs"][lb]["seconds"] for d in docs if lb in d["runs"]]
        s.add_row(
            lb,
            f"{len(ratios)}/{len(docs)}",
            _fmt(statistics.median(ratios) if ratios else None, ".4f"),
            _fmt(max(ratios) if ratios else None, ".4f"),
            f"{sum(r <= 1.02 for r in ratios)}/{len(ratios)}",
            _fmt(statistics.mean(secs) if secs else None, ".2f"),
        )
    h = Table(
        title="Best plan against baselines (time objective) and unequal microbatches",
        title_justify="left",
    )
    for col in (
        "instance",
        "exact by",
        "vs data_parallel",
        ">= 1.3x",
        "vs uniform",
        "UEDP gain",
        ">= 5%",
    ):
        h.add_column(col, justify="left" if col in ("instance", "exact by") else "right")
    for d in docs:
        if d["objective"] == "cost":
            continue
        sp, gain = d.get("speedup_vs_data_parallel"), d.get("uedp_gain")
        h.add_row(
            d["instance"],
            str(d["exact_by"]),
            _fmt(sp, ".2f") + "x",
            "yes" if sp and sp >= 1.3 else "no",
            _fmt(d.get("speedup_vs_uniform"), ".2f") + "x",
            _fmt(gain * 100 if gain is not None else None, ".1f") + "%",
            "yes" if gain and gain >= 0.05 else "no",
        )
    return [s, h]


def draw(docs: list[dict[str, Any]], labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    med = []
    for lb in labels:
        r = [
            d["runs"][lb]["ratio_to_exact"]
            for d in docs
            if lb in d["runs"]
            and d["runs"][lb]["ratio_to_exact"]
            and math.isfinite(d["runs"][lb]["ratio_to_exact"])
        ]
        med.append(statistics.median(r) if r else float("nan"))
    axes[0].bar(labels, med, color="#4C72B0")
    axes[0].axhline(1.0, color="black", lw=0.8)
    axes[0].set_ylabel("median ratio to exact (lower is better)")
    axes[0].tick_params(axis="x", rotation=45)
    timed = [d for d in docs if d["objective"] != "cost" and d.get("speedup_vs_data_parallel")]
    axes[1].barh(
        [d["instance"] for d in timed],
        [d["speedup_vs_data_parallel"] for d in timed],
        color="#55A868",
    )
    axes[1].axvline(1.3, color="red", ls="--", lw=0.8, label="TAPP's 1.30x")
    axes[1].set_xlabel("best plan speed-up over data_parallel (cost model)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join([*PIPEDREAM, *ZOO]))
    ap.add_argument("--clusters", default=",".join([*PRESETS, "random1", "random2"]))
    ap.add_argument("--objectives", default="time,cost")
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0, help="time budget per planner run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="two models on two clusters")
    ap.add_argument("--out", default=str(RESULTS / "plan_quality.json"))
    a = ap.parse_args()
    models, clusters = a.models.split(","), a.clusters.split(",")
    if a.quick:
        models, clusters = ["pipedream-alexnet", "alexnet"], ["local-hetero", "random1"]
    labels = [p for p in a.planners.split(",") if p]
    unknown = [p for p in labels if p not in PLANNERS]
    if unknown:
        ap.error(f"--planners: unknown {unknown} (known: {', '.join(PLANNERS)})")
    console, docs = Console(width=160), []
    for inst in instances(models, clusters):
        fastest = None
        for obj in [Objective(o) for o in a.objectives.split(",")]:
            target = None
            if obj is Objective.COST:
                if fastest is None:
                    fastest = evaluate_instance(
                        inst, Objective.TIME, a.batch, None, ["dp"], a.seconds, a.seed
                    )
                bt = fastest["runs"]["dp"]["batch_time_s"]
                target = 0.5 * a.batch / bt if math.isfinite(bt) else None
            doc = evaluate_instance(inst, obj, a.batch, target, labels, a.seconds, a.seed)
            if obj is Objective.TIME:
                fastest = doc if "dp" in doc["runs"] else fastest
            docs.append(doc)
            console.print(instance_table(doc))
    for t in summary_tables(docs, labels):
        console.print(t)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"batch": a.batch, "seconds_per_planner": a.seconds, "seed": a.seed, "instances": docs},
            indent=1,
            default=str,
        )
        + "\n"
    )
    draw(docs, labels, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
