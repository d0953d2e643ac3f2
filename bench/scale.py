"""Planners at production scale: generated profiles of 13B-70B GPTs, ViT-H/14 and ResNet-152
on the clusters of 64, 328 and 1,024 devices under ``examples/clusters/scale/``.

Per instance (model x cluster): the lower bound on the batch time (:mod:`core.bounds`: all
compute over the cluster's FLOP/s, and whether memory leaves room for any plan), then for
each planner its wall time, the batch time of its plan or its failure message, the ratio
to the bound and to the best planner of the instance, the devices and stages it used.
The profiles come from :mod:`models.shapes` (mixed precision); the objective is ``time``,
the schedule GPipe unless ``--schedule`` says otherwise.

Each planner runs in a child process of its own with a search budget of ``--seconds``
(``Budget.seconds``; no evaluation limit); a planner that has not answered after
``2 x seconds + 30`` s is interrupted (then killed) and recorded as ``timeout``. A planner's refusal
(``PipeplanError``: no plan fits, a state space over its cap) is recorded as ``failed`` with
its first line; any other exception as ``error``.

    .venv/bin/python -m bench.scale --quick        # two instances, 20 s budgets
    .venv/bin/python -m bench.scale                # every model x cluster, 60 s budgets
    .venv/bin/python -m bench.scale --ppo          # ppo too (RLlib on a local Ray; 300 s)

Writes ``bench/results/scale/<UTC date-time>.json`` (``--quick``: under ``scale_quick/``;
:mod:`bench.record`; ``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import common
from bench.common import OUT_HELP, fmt
from bench.record import ROOT, BenchRun, display, load_average
from pipeplan.agents.problem import Budget, Objective, Problem
from pipeplan.agents.registry import make_planner
from pipeplan.core.bounds import lower_bound
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.models import shapes
from pipeplan.service.tasks.progress import QUIET

Doc = dict[str, Any]
CLUSTERS_DIR = ROOT / "examples" / "clusters" / "scale"
PLANNERS = ("greedy", "dp", "pipedream_dp", "genetic", "tapp")
PPO_SECONDS = 300.0
"""ppo's search budget: the issue's target is within 10% of the best in 5 minutes."""
STOP_GRACE_S = 60.0
"""How long a stopped planner's child may take to shut down what it started."""
BATCH = {"gpt-13b": 512, "gpt-30b": 512, "gpt-70b": 512, "vit-h14": 1024, "resnet152": 2048}
"""Global batch per model: 512 sequences of 2,048 tokens (a million tokens) for the GPTs."""


@dataclass(frozen=True)
class Setup:
    """What one run sweeps."""

    instances: tuple[tuple[str, str], ...]  # (generated model, cluster preset)
    seconds: float  # each planner's search budget


QUICK = Setup(instances=(("gpt-13b", "dc-64"), ("gpt-13b", "dc-328")), seconds=20.0)
FULL = Setup(
    instances=tuple((m, c) for m in shapes.MODELS for c in ("dc-64", "dc-328", "dc-1024")),
    seconds=60.0,
)


def cluster(name: str) -> ClusterSpec:
    return ClusterSpec.load(CLUSTERS_DIR / f"{name}.yaml")


def limit_s(seconds: float) -> float:
    """How long a planner with a budget of ``seconds`` may run before it is stopped."""
    return 2 * seconds + 30


def _plan_in_child(conn: Connection, name: str, problem: Problem) -> None:
    """Run one planner and send back what the bench records of it (the child's side)."""
    try:
        planner = make_planner(name)
        if planner.needs_ray:
            # torch and Ray come with it: imported in the child that needs them, so the
            # parent forks its children without either loaded
            from pipeplan.service.tasks.live import ray_for_search

            with ray_for_search(None, QUIET):
                r = planner.plan(problem)
        else:
            r = planner.plan(problem)
        devices = [d for s in r.plan.stages for d in s.devices]
        types = Counter(problem.cluster.device(d).type for d in devices)
        doc: Doc = {
            "status": "ok",
            "batch_time_s": r.estimate.batch_time_s,
            "fits": r.estimate.fits,
            "devices": len(devices),
            "device_types": dict(sorted(types.items())),
            "stages": len(r.plan.stages),
            "evaluations": r.evaluations,
            "search_s": r.wall_time_s,
        }
        if "searched" in r.options:  # a planner that narrowed its space says to which
            doc["searched"] = r.options["searched"]
    except PipeplanError as e:
        doc = {"status": "failed", "error": _first_line(e)}
    except Exception as e:  # a planner's bug: recorded, and the sweep goes on
        doc = {"status": "error", "error": f"{type(e).__name__}: {_first_line(e)}"}
    conn.send(doc)
    conn.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:400] if text else type(e).__name__


def run_planner(name: str, problem: Problem, seconds: float) -> Doc:
    """One planner on ``problem`` in a forked child, stopped after :func:`limit_s`."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_plan_in_child, args=(child, name, problem), daemon=True)
    start = time.perf_counter()
    proc.start()
    child.close()
    limit = limit_s(seconds)
    doc: Doc
    if parent.poll(limit):
        try:
            doc = parent.recv()
        except EOFError:
            doc = {"status": "error", "error": "the planner's process ended without an answer"}
    else:
        doc = {"status": "timeout", "error": f"no answer within {limit:g} s (stopped)"}
        stop(proc)
    proc.join()
    parent.close()
    return {**doc, "wall_s": time.perf_counter() - start, "budget_s": seconds}


def stop(proc: BaseProcess) -> None:
    """Stop a planner's child: an interrupt first, so that what it started (ppo's local Ray)
    is shut down on the way out, then a kill after :data:`STOP_GRACE_S`."""
    if proc.pid is None:
        return
    os.kill(proc.pid, signal.SIGINT)
    proc.join(STOP_GRACE_S)
    if proc.is_alive():
        proc.kill()


def instance(
    model: str, cluster_name: str, planners: dict[str, float], schedule: Schedule, console: Console
) -> Doc:
    """Every planner on a generated model x a scale preset (:func:`measure`)."""
    profile = shapes.generate(model)
    doc = measure(profile, cluster(cluster_name), BATCH[model], planners, schedule, console)
    return {"model": model, "cluster": cluster_name,
            "parameters": shapes.parameters(shapes.shape_of(model)), **doc}  # fmt: skip


def measure(
    profile: ModelProfile,
    spec: ClusterSpec,
    batch: int,
    planners: dict[str, float],
    schedule: Schedule,
    console: Console,
) -> Doc:
    """Every planner (name -> search seconds) on one problem, with the bound and the ratios:
    to the bound, and to the best batch time of a fitting plan among the planners."""
    bound = lower_bound(profile, spec, batch, schedule)
    runs: dict[str, Doc] = {}
    for name, seconds in planners.items():
        budget = Budget(evaluations=None, seconds=seconds)
        problem = Problem(profile, spec, Objective.TIME, batch, schedule, budget=budget)
        r = runs[name] = run_planner(name, problem, seconds)
        note = f" ({r['error'][:100]})" if "error" in r else ""
        console.print(
            f"{profile.name} on {spec.name}: {name} {r['status']} in {r['wall_s']:.1f} s{note}"
        )
    answered = [r["batch_time_s"] for r in runs.values() if r["status"] == "ok" and r["fits"]]
    best = min(answered) if answered else None
    for r in runs.values():
        if r["status"] == "ok":
            r["ratio_to_bound"] = bound.ratio(r["batch_time_s"])
            r["ratio_to_best"] = r["batch_time_s"] / best if best else None
    return {
        "batch": batch,
        "schedule": schedule.value,
        "layers": len(profile),
        "devices": len(spec.device_ids),
        "bound": bound.to_dict(),
        "best_batch_time_s": best,
        "best_ratio_to_bound": bound.ratio(best) if best else None,
        "planners": runs,
    }


def table(rows: list[Doc]) -> Table:
    cols = ("model", "cluster", "bound s", "planner", "status", "wall s", "batch s", "x bound",
            "x best", "devices", "stages", "note")  # fmt: skip
    t = common.table("scale: planners against the lower bound", cols,
                     ("model", "cluster", "planner", "status", "note"))  # fmt: skip
    for row in rows:
        for name, d in row["planners"].items():
            t.add_row(
                row["model"], row["cluster"], fmt(row["bound"]["lower_bound_s"], ".3f"), name,
                d["status"], f"{d['wall_s']:.1f}", fmt(d.get("batch_time_s"), ".3f"),
                fmt(d.get("ratio_to_bound"), ".2f"), fmt(d.get("ratio_to_best"), ".3f"),
                str(d.get("devices", "-")), str(d.get("stages", "-")), d.get("error", "")[:60],
            )  # fmt: skip
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two instances, 20 s budgets")
    ap.add_argument("--seconds", type=float, default=None, help="each planner's search budget")
    ap.add_argument("--ppo", action="store_true", help=f"ppo too ({PPO_SECONDS:.0f} s budget)")
    ap.add_argument("--schedule", type=Schedule, default=Schedule.GPIPE, choices=list(Schedule))
    ap.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    args = ap.parse_args()
    setup = QUICK if args.quick else FULL
    seconds = setup.seconds if args.seconds is None else args.seconds
    if not seconds > 0:
        ap.error(f"--seconds: must be > 0, got {seconds!r}")
    bench = BenchRun("scale_quick" if args.quick else "scale")
    planners = dict.fromkeys(PLANNERS, seconds) | ({"ppo": PPO_SECONDS} if args.ppo else {})
    console = Console(width=180)
    start = time.perf_counter()
    rows = [instance(m, c, planners, args.schedule, console) for m, c in setup.instances]
    console.print(table(rows))
    doc = {
        "quick": args.quick,
        "search_seconds": seconds,
        "planners": list(planners),
        "precision": shapes.Precision.MIXED.value,
        "wall_s": time.perf_counter() - start,
        "instances": rows,
    }
    out = bench.write(doc, out=args.out, indent=1)
    console.print(f"wrote {display(out)} in {doc['wall_s']:.0f} s (load average {load_average()})")


if __name__ == "__main__":
    main()
