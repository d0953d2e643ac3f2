"""TAPP's table (Mao et al. 2021, Table 3 style), measured on the local EMULATED cluster.

For AlexNet at 224 pixels, VGG-16 at 32 and Inception-V3 at 75, on ``local-pipeline``
(``--cluster``; one Ray node per cluster node, six devices, fast:mid:slow = 4:3:2; every
device is this machine's CPU, and a type ``k`` times slower than the fastest makes each
forward and backward last ``k x`` its CPU time), five ways to train:

- ``SingleCPU``: the whole model on one device of the slowest type (the paper's single
  device: the slowest kind alone);
- ``Pipe-Torch``: GPipe's equal split, equal layer counts over every device, fastest first;
- ``BSP``: synchronous data parallelism, one stage replicated on every device (TAPP's
  baseline; the ``data_parallel`` planner may keep only a prefix of the devices -- its
  choice is in the JSON as ``data_parallel_planner``);
- ``TAPP``: TAPP's own plan (the ``tapp`` planner's answer, when it is among the planners
  asked), measured as it is, so the table shows what the learned planner alone gives;
- ``Planned``: the best plan of the planners asked (``dp``, ``brute`` up to three stages and
  ``tapp`` with a small budget) and of ``genetic`` kept to two stages or more, by the cost
  model on the profile measured on the cluster
  (:func:`executor.measured_profile.measure_profile`);
- ``Pipelined``: the best of those plans that has several stages. TAPP's table compares
  pipelines with BSP; where the planners' optimum is one replicated stage (Inception-V3 on
  ``local-pipeline`` on slower machines: there its 313 layers' cost per call outweighs the
  replicas' ring inside one node) this row still shows the best pipeline, measured.
  Elsewhere it is the Planned plan (one run serves both rows).

The claims checked (and printed) per model: the pipelined plan (several stages) and the
planned plan (several stages or replicas) are each measured at least :data:`TARGET` x
faster than BSP.

Microbatch sizes of the first three: the best for each by the cost model on the measured
profile. Each plan trains ``--train-steps`` global batches of real data (scikit-learn's
digits resized to the model's input, ``data="digits"``) with SGD (momentum 0.9), the same
batches for every plan. Reported: single-step time (mean over the steps after the warm-up,
and the cost model's prediction), speed-up over BSP (measured), comm fraction (measured:
transfer / (transfer + forward and backward compute)), and training accuracy and loss after
the fixed number of steps (mean of the last three steps' batches, measured before each
step's update). Inception-V3 has batch norm: fine for timing (statistics per microbatch).
Each row's JSON also holds its stages' predicted and measured parts side by side
(:func:`bench.fidelity.stage_breakdown`: compute, transfer, update, all-reduce), so an error
can be traced to a term.

Planning as the service does once a cluster has been used: each model after the first is
planned (its candidates searched and compared, BSP's ``data_parallel`` choice too) on the
cluster calibrated (:func:`executor.calibrate.fit`) to every run of the models measured
before it, as runs already measured feed the calibration a ``pipeplan plan`` on that
cluster then uses. The first model has no runs before it and is planned on the spec itself.
``--uncalibrated-planning`` plans every model on the spec (the protocol of the runs before
2026-11-27 15:55). Each row's ``predicted_s`` is the uncalibrated prediction either way (the
table's errors are the profile's), and ``planning_predicted_s`` the one its plan was chosen by.

Calibration, judged on plans it did not see (no extra runs: the table's own): every measured
plan is predicted again under the calibration (:mod:`executor.calibrate`) fitted to the
other models' runs (``held-out model``) and to every other plan's (``held-out plan``), each
also fitted blind to the measured updates (``... without 8u``: the spec's update bandwidth
kept), so the table shows what the fitted update bandwidth (rule 8u) is worth where plans
replicate hundreds of MB of weights on one host (:func:`bench.common.held_out`).

    .venv/bin/python -m bench.tapp_table            # 3 models, dp + brute + tapp, 12 steps
    .venv/bin/python -m bench.tapp_table --quick    # 3 models, dp + brute, 4 steps
(either also searches ``genetic`` with two stages or more, for the Pipelined row)
Writes ``bench/results/tapp_table/<UTC date-time>.json`` (``--quick``: under
``bench/results/tapp_table_quick/``; :mod:`bench.record`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.common import (
    BLIND,
    ModelCase,
    Observed,
    fmt,
    held_out,
    model_keys,
    table,
    verdict,
    without_updates,
)
from bench.fidelity import (
    add_cluster_options,
    bsp_all,
    describe,
    fastest_first,
    profile_sizes,
    stage_breakdown,
)
from bench.record import BenchRun, display
from pipeplan.agents import Budget, Objective, Problem, make_planner
from pipeplan.agents.baselines import every_device
from pipeplan.agents.problem import ProblemError
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.held_out import relative_error
from pipeplan.core.observations import Observation
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.calibrate import fit
from pipeplan.executor.emulation import EMULATED_NOTE
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measure import Measurement
from pipeplan.executor.measured_profile import measure_profile
from pipeplan.executor.model import OptimizerConfig
from pipeplan.executor.pipeline import RunConfig, run

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "local-pipeline.yaml"
TARGET = 1.3
"""Planned must be measured at least this many times faster than BSP."""
MODELS: dict[str, ModelCase] = {
    "alexnet": ModelCase("AlexNet@224", "alexnet", 224, 32),
    "vgg16": ModelCase("VGG-16@32", "vgg16", 32, 32),
    "inception_v3": ModelCase("Inception-V3@75", "inception_v3", 75, 32),
}
METHODS = ("SingleCPU", "Pipe-Torch", "BSP", "TAPP", "Planned", "Pipelined")
"""The rows of a model's table; ``TAPP`` only where the ``tapp`` planner was asked and answered."""
PIPELINED = "genetic"
"""The planner searched for the best plan of several stages (its ``min_stages``; the other
planners search every stage count)."""
OPTIMIZER = OptimizerConfig("sgd", lr=0.01, momentum=0.9)
LAST = 3  # accuracy and loss: mean over this many final steps
STORE_MB = 1000
"""Object store per Ray node. BSP replicates VGG-16 (537 MB of parameters) on all six
devices, and the ring all-reduce's chunks fill each node's store: with 2400 MB per node (as
``bench.fidelity``) the machine reached Ray's memory monitor threshold and a replica was
killed, with 1000 MB it ran no slower (README, "TAPP's table and sweeps")."""


def best_microbatch(
    profile: ModelProfile,
    spec: ClusterSpec,
    batch: int,
    stages: list[tuple[tuple[int, int], tuple[str, ...]]],
    schedule: Schedule = Schedule.GPIPE,
) -> Plan:
    """The plan with these stages and the equal microbatch the cost model likes best."""
    replicas = max(len(d) for _, d in stages)
    plans = [
        Plan(batch, tuple(Stage(r, d, m) for r, d in stages), schedule)
        for m in range(replicas, batch + 1)
        if batch % m == 0
    ]
    return min(plans, key=lambda p: simulate(p, profile, spec).batch_time_s)


def single_device(profile: ModelProfile, spec: ClusterSpec, batch: int) -> Plan:
    """The whole model on one device of the slowest type (TAPP's SingleCPU)."""
    slowest = fastest_first(spec)[-1]
    return best_microbatch(profile, spec, batch, [((0, len(profile)), (slowest,))])


def pipe_torch(profile: ModelProfile, spec: ClusterSpec, batch: int) -> Plan:
    """Equal layer counts over every device, fastest first (``agents.baselines.every_device``)."""
    return every_device.pipe_torch_all(Problem(profile, spec, Objective.TIME, batch))


def plan_with(
    name: str,
    profile: ModelProfile,
    spec: ClusterSpec,
    batch: int,
    seconds: float,
    seed: int,
    **more: Any,
) -> tuple[Plan, float]:
    """A planner's best plan for the time objective and its search seconds (``more``: further
    planner options)."""
    options: dict[str, Any] = {"tapp": {"patience": 100}, "brute": {"max_stages": 3}}.get(name, {})
    options = {**options, **more}
    evaluations = {"tapp": 3000, "brute": 500_000}.get(name)
    problem = Problem(
        profile,
        spec,
        Objective.TIME,
        batch,
        seed=seed,
        budget=Budget(evaluations=evaluations, seconds=seconds),
    )
    r = make_planner(name, **options).plan(problem)
    return r.plan, r.wall_time_s


def best_candidate(candidates: dict[str, dict[str, Any]], min_stages: int = 1) -> str:
    """The name of the candidate predicted fastest among those with at least ``min_stages``
    stages."""
    kept = [n for n, c in candidates.items() if len(c["plan"]["stages"]) >= min_stages]
    if not kept:
        raise ValueError(f"no candidate plan has {min_stages} stages or more: {list(candidates)}")
    return min(kept, key=lambda n: candidates[n]["predicted_s"])


def tail(values: tuple[float, ...]) -> float:
    return statistics.fmean(values[-LAST:]) if values else math.nan


def row(
    method: str,
    plan: Plan,
    profile: ModelProfile,
    spec: ClusterSpec,
    m: Measurement | None,
    planning: ClusterSpec,
) -> dict[str, Any]:
    """One plan's row: predicted on ``spec`` (uncalibrated) and on ``planning`` (the cluster
    its plan was chosen on), and measured (``m``, None where the run failed)."""
    est = simulate(plan, profile, spec)
    return {
        "method": method,
        "plan": plan.to_dict(),
        "describe": describe(plan),
        "predicted_s": est.batch_time_s,
        "planning_predicted_s": simulate(plan, profile, planning).batch_time_s,
        "predicted_comm_fraction": est.comm_fraction,
        "measured_s": m.batch_time_s if m else None,
        "measured_std_s": m.batch_time_std_s if m else None,
        "comm_fraction": m.comm_fraction if m else None,
        "accuracy": tail(m.accuracies) if m else None,
        "loss": tail(m.losses) if m else None,
        "accuracies": list(m.accuracies) if m else None,
        "losses": list(m.losses) if m else None,
        "emulated": m.emulated if m else None,
        "stages": stage_breakdown(est, m, spec),
    }


def planning_spec(
    spec: ClusterSpec, observed: dict[tuple[str, str], Observed]
) -> tuple[ClusterSpec, list[str]]:
    """``spec`` calibrated to every run in ``observed`` (the models measured so far), and the
    models it was fitted to; ``spec`` itself and no model where nothing was measured yet."""
    runs = [o for seen in observed.values() for o in seen.runs]
    if not runs:
        return spec, []
    models = sorted({seen.model for seen in observed.values()})
    cal = fit(spec, runs, {"fitted_to_models": models}).calibration
    return spec.calibrated(cal), models


def model_table(
    case: ModelCase,
    spec: ClusterSpec,
    a: argparse.Namespace,
    console: Any,
    planning: ClusterSpec,
) -> tuple[dict[str, Any], dict[tuple[str, str], Observed]]:
    """The model's rows, and each plan measured (not a twin's run) for the calibrations. The
    planners search, and their candidates are compared, on ``planning`` (``spec``, or ``spec``
    calibrated to the runs before); the rows' ``predicted_s`` are on ``spec``."""
    t0 = time.perf_counter()
    sizes = profile_sizes(a.profile_batches, case.batch)
    profile = measure_profile(case.source, spec, batch_sizes=sizes, repeats=a.repeats)
    profile_s = time.perf_counter() - t0
    console.print(f"{case.label}: profile of {len(profile)} layers measured in {profile_s:.1f} s")
    plans: dict[str, Plan] = {
        "SingleCPU": single_device(profile, planning, case.batch),
        "Pipe-Torch": pipe_torch(profile, planning, case.batch),
        "BSP": bsp_all(profile, planning, case.batch),
    }
    candidates: dict[str, dict[str, Any]] = {}
    searches: list[tuple[str, str, dict[str, Any]]] = [(n, n, {}) for n in a.planners.split(",")]
    searches.append((f"{PIPELINED}>=2", PIPELINED, {"min_stages": 2}))
    for label, name, more in searches:
        try:
            plan, secs = plan_with(
                name, profile, planning, case.batch, a.plan_seconds, a.seed, **more
            )
        except ProblemError as e:  # brute's space too large (Inception-V3's 313 layers)
            console.print(f"  {label}: skipped ({str(e)[:100]}...)")
            continue
        pred = simulate(plan, profile, planning).batch_time_s
        candidates[label] = {"plan": plan.to_dict(), "predicted_s": pred, "search_s": secs}
        console.print(f"  {label}: {describe(plan)} predicted {pred * 1e3:.0f} ms ({secs:.1f} s)")
    best = best_candidate(candidates)
    piped = best_candidate(candidates, min_stages=2)
    if "tapp" in candidates:
        plans["TAPP"] = Plan.from_dict(candidates["tapp"]["plan"])
    plans["Planned"] = Plan.from_dict(candidates[best]["plan"])
    plans["Pipelined"] = Plan.from_dict(candidates[piped]["plan"])
    methods = [k for k in METHODS if k in plans]
    dp_choice, _ = plan_with("data_parallel", profile, planning, case.batch, a.plan_seconds, a.seed)
    config = RunConfig(
        steps=a.train_steps - a.warmup,
        warmup=a.warmup,
        optimizer=OPTIMIZER,
        data="digits",
        seed=a.seed,
        timeout_s=600,
    )
    measured: dict[str, Measurement | None] = {}
    same_as: dict[str, str] = {}
    errors: dict[str, str] = {}
    for method in methods:
        plan = plans[method]
        twin = next((k for k in measured if plans[k] == plan), None)
        if twin is not None:  # the very same plan: one run serves both rows
            measured[method], same_as[method] = measured[twin], twin
            continue
        t1 = time.perf_counter()
        try:
            measured[method] = run(plan, case.source, spec, config)
        except Exception as e:  # a failed plan is a row with its error
            measured[method] = None
            errors[method] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        m = measured[method]
        console.print(
            f"  {method:<10} {describe(plan):<70} "
            + (f"{m.batch_time_s * 1e3:.0f} ms" if m else f"ERROR {errors[method]}")
            + f" ({time.perf_counter() - t1:.0f} s)"
        )
    rows = [row(k, plans[k], profile, spec, measured[k], planning) for k in methods]
    by_method = {r["method"]: r for r in rows}
    bsp, single = measured["BSP"], measured["SingleCPU"]
    for r in rows:
        m = measured[r["method"]]
        r["speedup_vs_bsp"] = bsp.batch_time_s / m.batch_time_s if (m and bsp) else None
        r["predicted_speedup_vs_bsp"] = by_method["BSP"]["predicted_s"] / r["predicted_s"]
        r["speedup_vs_single"] = single.batch_time_s / m.batch_time_s if (m and single) else None
        r["same_plan_as"] = same_as.get(r["method"])
        r["error"] = errors.get(r["method"], "")
    observed = {
        (case.label, k): Observed(case.label, plans[k], profile, (Observation.of(m, profile),))
        for k, m in measured.items()
        if m is not None and k not in same_as
    }
    planned, pipelined = plans["Planned"], plans["Pipelined"]
    x, y = by_method["Planned"]["speedup_vs_bsp"], by_method["Pipelined"]["speedup_vs_bsp"]
    several = len(planned.stages) > 1 or any(len(st.devices) > 1 for st in planned.stages)
    claim = {
        "stages": len(planned.stages),
        "several_stages_or_replicas": several,
        "measured_speedup_vs_bsp": x,
        "target": TARGET,
        "met": bool(several and x is not None and x >= TARGET),
        "pipelined_stages": len(pipelined.stages),
        "pipelined_measured_speedup_vs_bsp": y,
        "pipelined_met": bool(len(pipelined.stages) > 1 and y is not None and y >= TARGET),
    }
    doc = {
        "model": case.label,
        "global_batch": case.batch,
        "claim": claim,
        "layers": len(profile),
        "profile_s": profile_s,
        "planned_by": best,
        "pipelined_by": piped,
        "planners": candidates,
        "data_parallel_planner": {
            "plan": dp_choice.to_dict(),
            "describe": describe(dp_choice),
            "predicted_s": simulate(dp_choice, profile, planning).batch_time_s,
        },
        "rows": rows,
    }
    return doc, observed


def calibrate_rows(
    docs: list[dict[str, Any]], observed: dict[tuple[str, str], Observed], spec: ClusterSpec
) -> dict[str, dict[str, float]]:
    """Put each measured row's held-out calibrated predictions and errors into its document
    (``calibrated_predicted_s``, ``calibrated_rel_error``; ``observed`` is keyed by model and
    method, and a row that shares its twin's run takes its twin's); returns the median and
    worst |error| over the plans measured, per kind and uncalibrated."""
    if not observed:
        return {}
    keys = list(observed)
    rows = [observed[k] for k in keys]
    predicted = held_out(rows, spec)[0]
    blind = held_out(without_updates(rows), spec)[0]
    by_plan = {
        k: {**p, **{kind + BLIND: v for kind, v in b.items()}}
        for k, p, b in zip(keys, predicted, blind, strict=True)
    }
    errors: dict[str, list[float]] = {}
    for d in docs:
        for row in d["rows"]:
            p = by_plan.get((d["model"], row["same_plan_as"] or row["method"]))
            if p is None or row["measured_s"] is None:
                continue
            row["calibrated_predicted_s"] = p
            row["calibrated_rel_error"] = {
                k: relative_error(v, row["measured_s"]) for k, v in p.items()
            }
            if row["same_plan_as"]:
                continue  # one run: counted once
            errors.setdefault("uncalibrated", []).append(
                abs(relative_error(row["predicted_s"], row["measured_s"]))
            )
            for k, e in row["calibrated_rel_error"].items():
                errors.setdefault(k, []).append(abs(e))
    return {k: verdict(v) for k, v in errors.items()}


def print_calibrated(
    docs: list[dict[str, Any]], verdicts: dict[str, dict[str, float]], console: Any
) -> None:
    """Each measured plan's error uncalibrated and under each held-out calibration."""
    kinds = [k for k in verdicts if k != "uncalibrated"]
    t = table(
        "error (predicted - measured) / measured, calibrations fitted on other plans",
        ("model", "method", "uncalibrated", *kinds),
        left=("model", "method"),
    )
    for d in docs:
        for r in d["rows"]:
            if r["measured_s"] is None or r["same_plan_as"]:
                continue
            cal = r.get("calibrated_rel_error", {})
            t.add_row(
                d["model"],
                r["method"],
                fmt(100 * relative_error(r["predicted_s"], r["measured_s"]), "+.1f") + "%",
                *(fmt(cal.get(k, math.nan) * 100, "+.1f") + "%" for k in kinds),
            )
    console.print(t)
    for k, v in verdicts.items():
        console.print(f"{k}: median |error| {v['median']:.1%}, worst {v['max']:.1%}")


def print_table(docs: list[dict[str, Any]], steps: int, cluster: str, console: Any) -> None:
    cols = ("model", "method", "plan", "step ms", "± std", "predicted ms", "speed-up vs BSP",
            "vs SingleCPU", "comm fraction", "train acc", "loss")  # fmt: skip
    t = table(
        f"TAPP table on {cluster}, EMULATED (single-step time; accuracy after {steps} "
        "steps on digits)",
        cols,
        left=("model", "method", "plan"),
    )
    for d in docs:
        for r in d["rows"]:
            by = {"Planned": d["planned_by"], "Pipelined": d["pipelined_by"]}.get(r["method"])
            method = r["method"] + (f" ({by})" if by else "")
            t.add_row(
                d["model"],
                method,
                r["describe"] + (f" = {r['same_plan_as']}" if r["same_plan_as"] else ""),
                fmt(r["measured_s"] and r["measured_s"] * 1e3, ".0f"),
                fmt(r["measured_std_s"] and r["measured_std_s"] * 1e3, ".0f"),
                fmt(r["predicted_s"] * 1e3, ".0f"),
                fmt(r["speedup_vs_bsp"], ".2f") + "x",
                fmt(r["speedup_vs_single"], ".2f") + "x",
                fmt(r["comm_fraction"], ".3f"),
                fmt(r["accuracy"], ".3f"),
                fmt(r["loss"], ".3f"),
            )
        t.add_section()
    console.print(t)
    for d in docs:
        c = d["claim"]
        console.print(
            f"{d['model']}: planned has {c['stages']} stage(s), measured "
            f"{fmt(c['measured_speedup_vs_bsp'], '.2f')}x faster than BSP (target {TARGET}x): "
            + ("met" if c["met"] else "NOT met")
            + f"; pipelined has {c['pipelined_stages']} stages, measured "
            f"{fmt(c['pipelined_measured_speedup_vs_bsp'], '.2f')}x: "
            + ("met" if c["pipelined_met"] else "NOT met")
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--planners", default="dp,brute,tapp", help="candidates for the Planned row")
    ap.add_argument("--plan-seconds", type=float, default=30.0, help="budget per planner")
    ap.add_argument("--train-steps", type=int, default=12, help="steps trained per plan")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the time")
    add_cluster_options(ap)
    ap.set_defaults(cluster=str(CLUSTER), object_store_mb=STORE_MB)
    ap.add_argument("--quick", action="store_true", help="dp only, 4 steps, 3 profile repeats")
    ap.add_argument(
        "--uncalibrated-planning",
        action="store_true",
        help="plan every model on the spec, not on the calibration fitted to the runs before",
    )
    a = ap.parse_args()
    if a.quick:
        a.planners, a.train_steps, a.repeats = "dp,brute", 4, 3
    if a.train_steps <= a.warmup:
        ap.error("--train-steps must exceed --warmup")
    models = model_keys(ap, a.models, known=MODELS)
    bench = BenchRun("tapp_table_quick" if a.quick else "tapp_table")
    spec = ClusterSpec.load(a.cluster)
    console = Console(width=170)
    console.print(f"[bold]{EMULATED_NOTE}[/bold]")
    t0 = time.perf_counter()
    docs = []
    observed: dict[tuple[str, str], Observed] = {}
    with LocalCluster(spec, object_store_mb=a.object_store_mb) as cluster:
        console.print(f"cluster {spec.name} up in {cluster.startup_s:.1f} s")
        for key in models:
            planning, fitted_to = spec, list[str]()
            if not a.uncalibrated_planning:
                planning, fitted_to = planning_spec(spec, observed)
            console.print(
                f"{MODELS[key].label}: planned on "
                + (
                    f"the calibration fitted to {', '.join(fitted_to)}'s runs"
                    if fitted_to
                    else "the spec (uncalibrated)"
                )
            )
            doc, seen = model_table(MODELS[key], spec, a, console, planning)
            doc["planned_on"] = {"calibrated_to_models": fitted_to}
            docs.append(doc)
            observed.update(seen)
    t1 = time.perf_counter()
    verdicts = calibrate_rows(docs, observed, spec)
    console.print(f"held-out calibrations fitted in {time.perf_counter() - t1:.0f} s")
    print_table(docs, a.train_steps, spec.name, console)
    print_calibrated(docs, verdicts, console)
    wall = time.perf_counter() - t0
    console.print(f"wall {wall / 60:.1f} min")
    doc = {
        "note": EMULATED_NOTE,
        "cluster": spec.to_dict(),
        "config": {
            "train_steps": a.train_steps,
            "warmup": a.warmup,
            "optimizer": OPTIMIZER.__dict__,
            "data": "digits",
            "planners": a.planners,
            "plan_seconds": a.plan_seconds,
            "profile_repeats": a.repeats,
            "profile_batch_sizes": a.profile_batches,
            "object_store_mb": a.object_store_mb,
            "accuracy": f"mean training-batch accuracy of the last {LAST} steps",
            "quick": a.quick,
            "planning": "uncalibrated"
            if a.uncalibrated_planning
            else "calibrated to the runs of the models before",
        },
        "wall_s": wall,
        "calibrated": verdicts,
        "models": docs,
    }
    out = bench.write(doc, out=Path(a.out) if a.out else None, indent=1)
    console.print(f"wrote {display(out)}")


if __name__ == "__main__":
    main()
