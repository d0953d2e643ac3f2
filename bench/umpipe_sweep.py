"""UMPIPE's GPT depth sweep: DGAP's unequal microbatches against the best equal-microbatch
GPipe and 1F1B (PipeDream) plans, simulated for GPT-1 .. GPT-14 on two presets.

UMPIPE (Zhou et al., TPDS 2024) compares its DGAP plans with GPipe and PipeDream on GPT
models of 1 to 14 blocks. Here, for every depth and preset:

- ``dgap``: ``genetic`` (DGAP's two chromosomes, unequal per-stage microbatches) under GPipe;
- ``dgap-1f1b``: the same under 1F1B (unequal microbatches under 1F1B: issue #16);
- ``gpipe``: the best equal-microbatch GPipe plan: ``dp``'s (exact for equal microbatches
  under its bottleneck model, then simulated), and with ``--equal-genetic`` also
  ``genetic`` restricted to equal microbatches (``unequal=False``);
- ``1f1b``: the same under 1F1B (PipeDream's schedule);
- ``refined`` / ``refined-1f1b``: that best equal plan with DGAP's second chromosome alone
  re-chosen: per-stage microbatch sizes by coordinate descent over every size ``1 .. B``
  (remainders allowed), the stages and devices kept. Its gain over the equal plan is what
  unequal microbatches (and remainders) add to the best structure found, apart from how
  well a budgeted search finds structures.

Profiles are the zoo's GPT (sequence 64) profiled by FLOPs, with per-call weight reads on
each device type (:func:`bench.instances.weight_reads`: a fixed cost per call, which is what
unequal microbatches trade on; a purely per-sample profile makes the microbatch size matter
only through fill, drain and latencies). Batch 64, objective time. Every number is the cost
model's (simulated); none is measured here.

Prints a table per preset and writes ``bench/results/umpipe_sweep/<UTC date-time>.json`` and
``.png`` beside it (:mod:`bench.record`).

``--measure 2,4,6`` instead runs a small GPT of those depths (width 256, sequence 32) on the
local emulated cluster (``local-hetero``, EMULATED): its profile measured there
(:func:`executor.measured_profile.measure_profile`), then DGAP's GPipe plan, the best equal
GPipe and 1F1B plans (``dp``) and the re-chosen-microbatch ones, each predicted and run
for real (:func:`executor.pipeline.run`); writes
``bench/results/umpipe_sweep_measured/<UTC date-time>.json``.

    .venv/bin/python -m bench.umpipe_sweep [--depths 1-14] [--presets cloud-mix,tapp-paper]
    .venv/bin/python -m bench.umpipe_sweep --measure 2,4,6
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.common import table
from bench.instances import cluster, weight_reads
from bench.record import BenchRun, display
from pipeplan.agents import Budget, Problem
from pipeplan.agents.compare import Entry, run_entry
from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.models import profiler, zoo

BATCH, SEQUENCE, SEED = 64, 64, 0
PRESETS = ("cloud-mix", "tapp-paper")
Doc = dict[str, Any]


def gpt_profile(depth: int) -> ModelProfile:
    module, example = zoo.build("gpt", SEQUENCE, n_layer=depth)
    return profiler.profile_model(module, example, name=f"gpt{depth}", device_type=None)


def best(entries: list[tuple[str, Entry]], problem: Problem) -> Doc:
    """The best of some planners' plans: value, batch time, plan, who found it."""
    out: Doc = {"batch_time_s": math.inf, "by": None, "plan": None, "seconds": 0.0}
    for label, entry in entries:
        row = run_entry(entry, problem, catch_bugs=False)
        out["seconds"] += row.search_s
        if row.result is None:
            continue
        est = row.result.estimate
        if est.batch_time_s < out["batch_time_s"]:
            out.update(batch_time_s=est.batch_time_s, by=label, plan=row.result.plan.to_dict())
    return out


def refine(plan: Plan, profile: ModelProfile, spec: ClusterSpec) -> tuple[Plan, float]:
    """Coordinate descent over each stage's microbatch size (every size ``1 .. B``; the
    stages, devices and schedule kept): the best plan found and its batch time."""
    ev = BatchEvaluator(profile, spec)
    B = plan.global_batch

    def cost(plans: list[Plan]) -> Any:
        res = ev.evaluate(PlanBatch.from_plans(plans, spec), B, plan.schedule)
        return [t if ok else math.inf for t, ok in zip(res.batch_time_s, res.fits, strict=True)]

    best, value = plan, cost([plan])[0]
    improved = True
    while improved:
        improved = False
        for s in range(plan.num_stages):
            candidates = []
            for b in range(1, B + 1):
                stages = list(best.stages)
                st = stages[s]
                if b < st.replicas:
                    continue
                stages[s] = Stage(st.layers, st.devices, b)
                candidates.append(Plan(B, tuple(stages), plan.schedule))
            values = cost(candidates)
            k = min(range(len(values)), key=values.__getitem__)
            if values[k] < value * (1 - 1e-12):
                best, value, improved = candidates[k], values[k], True
    return best, value


def sweep_one(profile: ModelProfile, preset: str, evaluations: int, equal_genetic: bool) -> Doc:
    spec = cluster(preset)
    prof = weight_reads(profile, spec)
    budget = Budget(evaluations=evaluations, seconds=None)
    row: Doc = {"layers": len(prof)}
    for schedule in Schedule:
        problem = Problem(prof, spec, global_batch=BATCH, schedule=schedule, seed=SEED,
                          budget=budget)  # fmt: skip
        tag = "" if schedule is Schedule.GPIPE else "-1f1b"
        row[f"dgap{tag}"] = best([("genetic", Entry("genetic", "genetic"))], problem)
        equal = [("dp", Entry("dp", "dp"))]
        if equal_genetic:
            equal.append(("genetic-equal", Entry("genetic-equal", "genetic", {"unequal": False})))
        row[schedule.value] = best(equal, problem)
        if row[schedule.value]["plan"] is not None:
            plan, value = refine(Plan.from_dict(row[schedule.value]["plan"]), prof, spec)
            row[f"refined{tag}"] = {"batch_time_s": value, "plan": plan.to_dict()}
        else:
            row[f"refined{tag}"] = {"batch_time_s": math.inf, "plan": None}
    equal = min(row["gpipe"]["batch_time_s"], row["1f1b"]["batch_time_s"])
    row["gain_over_best_equal"] = equal / row["dgap"]["batch_time_s"] - 1.0
    unequal = min(row[k]["batch_time_s"] for k in ("dgap", "dgap-1f1b", "refined", "refined-1f1b"))
    row["best_unequal_gain"] = equal / unequal - 1.0
    row["refined_gain"] = row["gpipe"]["batch_time_s"] / row["refined"]["batch_time_s"] - 1.0
    row["refined_1f1b_gain"] = (
        row["1f1b"]["batch_time_s"] / row["refined-1f1b"]["batch_time_s"] - 1.0
    )
    return row


def microbatches(plan: Doc | None) -> str:
    if plan is None:
        return "-"
    return "/".join(str(s["microbatch"]) for s in plan["stages"])


def print_table(preset: str, rows: dict[int, Doc], console: Console) -> None:
    cols = ("depth", "layers", "DGAP unequal (GPipe)", "DGAP unequal (1F1B)", "best equal GPipe",
            "best equal 1F1B", "DGAP gain over best equal", "refined GPipe (gain)",
            "refined 1F1B (gain)", "refined GPipe microbatches")  # fmt: skip
    t = table(
        f"GPT depth sweep on {preset}: batch time (ms, simulated), B={BATCH}",
        cols,
        left=("refined GPipe microbatches",),
    )
    for depth, r in rows.items():
        t.add_row(
            str(depth),
            str(r["layers"]),
            f"{r['dgap']['batch_time_s'] * 1e3:.2f}",
            f"{r['dgap-1f1b']['batch_time_s'] * 1e3:.2f}",
            f"{r['gpipe']['batch_time_s'] * 1e3:.2f} ({r['gpipe']['by']})",
            f"{r['1f1b']['batch_time_s'] * 1e3:.2f} ({r['1f1b']['by']})",
            f"{r['gain_over_best_equal']:+.1%}",
            f"{r['refined']['batch_time_s'] * 1e3:.2f} ({r['refined_gain']:+.1%})",
            f"{r['refined-1f1b']['batch_time_s'] * 1e3:.2f} ({r['refined_1f1b_gain']:+.1%})",
            microbatches(r["refined"]["plan"]),
        )
    console.print(t)


def plot(doc: Doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(doc["presets"])
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        rows = doc["presets"][preset]
        depths = [int(d) for d in rows]
        for key, label in (
            ("dgap", "DGAP unequal (GPipe)"),
            ("dgap-1f1b", "DGAP unequal (1F1B)"),
            ("gpipe", "best equal GPipe"),
            ("1f1b", "best equal 1F1B (PipeDream)"),
            ("refined", "best equal GPipe, microbatches refined"),
            ("refined-1f1b", "best equal 1F1B, microbatches refined"),
        ):
            ax.plot(depths, [rows[str(d)][key]["batch_time_s"] * 1e3 for d in depths], "o-",
                    label=label, ms=3)  # fmt: skip
        ax.set_title(f"{preset}, batch {BATCH} (simulated)")
        ax.set_xlabel("GPT blocks")
        ax.set_ylabel("batch time (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def measure_depths(depths: list[int], evaluations: int, console: Console) -> Doc:
    """Plans of small GPTs on ``local-hetero``, predicted and run there (EMULATED)."""
    from pipeplan.executor.emulation import EMULATED_NOTE
    from pipeplan.executor.local_cluster import LocalCluster
    from pipeplan.executor.measured_profile import measure_profile
    from pipeplan.executor.model import ModelSource
    from pipeplan.executor.pipeline import RunConfig, run

    spec = cluster("local-hetero")
    batch = 16
    config = RunConfig(steps=3, warmup=1, data="synthetic", seed=SEED, timeout_s=600)
    doc: Doc = {"note": EMULATED_NOTE, "cluster": spec.name, "global_batch": batch, "runs": {}}
    console.print(EMULATED_NOTE)
    with LocalCluster(spec, object_store_mb=1200):
        for depth in depths:
            options = {"n_layer": depth, "d_model": 256, "n_head": 4, "n_ctx": 32,
                       "vocab_size": 4096}  # fmt: skip
            source = ModelSource("gpt", 32, options=options)
            prof = measure_profile(source, spec, batch_sizes=(4, 16), repeats=3)
            budget = Budget(evaluations=evaluations, seconds=None)
            plans: dict[str, Plan] = {}
            for schedule in Schedule:
                problem = Problem(prof, spec, global_batch=batch, schedule=schedule, seed=SEED,
                                  budget=budget)  # fmt: skip
                tag = "" if schedule is Schedule.GPIPE else "-1f1b"
                for label, entry in (
                    (f"dgap{tag}", Entry("genetic", "genetic")),
                    (f"{schedule.value}-equal", Entry("dp", "dp")),
                ):
                    row = run_entry(entry, problem, catch_bugs=False)
                    if row.result is not None:
                        plans[label] = row.result.plan
                if f"{schedule.value}-equal" in plans:
                    plans[f"refined{tag}"] = refine(plans[f"{schedule.value}-equal"], prof, spec)[0]
            runs: Doc = {}
            for label, plan in plans.items():
                predicted = simulate(plan, prof, spec).batch_time_s
                measured = run(plan, source, spec, config)
                runs[label] = {
                    "plan": plan.to_dict(),
                    "predicted_s": predicted,
                    "measured_s": measured.batch_time_s,
                    "measured_std_s": measured.batch_time_std_s,
                }
                console.print(
                    f"gpt{depth} {label:<14} {microbatches(plan.to_dict()):<12} predicted "
                    f"{predicted * 1e3:8.1f} ms, measured {measured.batch_time_s * 1e3:8.1f} ms "
                    f"(EMULATED)"
                )
            doc["runs"][str(depth)] = runs
    return doc


def parse_depths(text: str) -> list[int]:
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="1-14", help="e.g. 1-14 or 2,6,12")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--evaluations", type=int, default=4000, help="genetic's budget per run")
    ap.add_argument("--equal-genetic", action="store_true", help="genetic-equal beside dp")
    ap.add_argument("--measure", default="", help="depths to run on local-hetero, e.g. 2,4,6")
    a = ap.parse_args()
    console = Console(width=180)
    if a.measure:
        bench = BenchRun("umpipe_sweep_measured")
        measured = measure_depths(parse_depths(a.measure), a.evaluations, console)
        print(f"wrote {display(bench.write(measured))}")
        return
    bench = BenchRun("umpipe_sweep")
    doc: Doc = {
        "global_batch": BATCH,
        "sequence": SEQUENCE,
        "evaluations": a.evaluations,
        "equal_planners": ["dp", "genetic-equal"] if a.equal_genetic else ["dp"],
        "seed": SEED,
        "profile": "zoo GPT, FLOP-based, per-call weight reads (bench.instances.weight_reads)",
        "presets": {},
    }
    depths = parse_depths(a.depths)
    profiles = {d: gpt_profile(d) for d in depths}
    for preset in a.presets.split(","):
        rows = {d: sweep_one(profiles[d], preset, a.evaluations, a.equal_genetic) for d in depths}
        doc["presets"][preset] = {str(d): r for d, r in rows.items()}
        print_table(preset, rows, console)
    out = bench.write(doc)
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {display(out)} and .png")


if __name__ == "__main__":
    main()
