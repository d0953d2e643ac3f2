"""PPO (RLlib, the ``ppo`` planner) against the exact optimum on the plan-quality instances.

For each instance: ``brute`` gives the exact optimum over contiguous partitions x device
assignments (replicas allowed) x equal microbatch counts; then ``ppo`` runs with its
defaults (the env chooses the microbatch count and may replicate stages) for ``--seeds``
seeds. The table shows per instance and seed: the exact value; the best plan PPO's episodes
found ("ppo alone", the planner with ``polish_evaluations=0``) and the planner's answer
after a local search from that plan ("ppo + polish", what ``ppo`` returns with
``polish_evaluations=N``),
each with its gap; the evaluations (episodes costed by the env, plus the plans the planner
costs itself) and the wall seconds (including Ray's start-up, ~10 s here, and the
algorithm's build, ~20 s), and the evaluations at which PPO's best first came within 5% and
1% of exact, beside TAPP's on the same instance and seed (``--tapp-evaluations``, 0: none).
Target (issues 4 and 16): PPO alone (no polish, the default ``--polish 0``) within 3% of
exact; "met" judges PPO alone.

The instances and the cost objective's throughput target (half the fastest plan's, the
fastest found by ``dp``) are those of ``bench.rl_quality``, whose helpers this reuses.

    .venv/bin/python -m bench.ppo_quality                   # four instances, 7-35 min here
    .venv/bin/python -m bench.ppo_quality --instances pipedream-alexnet@random1/time
Writes ``bench/results/ppo_quality/<UTC date-time>.json`` (:mod:`bench.record`; ``--out`` to
change).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.common import OUT_HELP, table
from bench.record import BenchRun, display
from bench.rl_quality import (
    BRUTE_MAX_SPACE,
    DEFAULT_PPO,
    THRESHOLDS,
    Case,
    gap_of,
    parse_case,
    reach,
)
from pipeplan.agents import InfeasibleError, Objective, ProblemError, make_planner
from pipeplan.agents.local_search import polish as polish_plan
from pipeplan.agents.search import Search
from pipeplan.executor import runtime

TARGET = 0.03


def case_of(spec: str, batch: int) -> Case:
    """``MODEL@CLUSTER[/OBJECTIVE]``; ``cost`` gets half the fastest plan's throughput."""
    name, _, objective = spec.partition("/")
    case = parse_case(name, Objective(objective or "time"), batch)
    if case.objective is not Objective.COST:
        return case
    timed = Case(case.inst, Objective.TIME, batch)
    fastest = make_planner("dp").plan(timed.problem(0, None, 600.0)).value
    return Case(case.inst, Objective.COST, batch, 0.5 * batch / fastest)


def exact(case: Case) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = make_planner("brute", max_space=BRUTE_MAX_SPACE).plan(case.problem(0, None, 600.0))
    return {
        "value": r.value,
        "plan": r.plan.to_dict(),
        "evaluations": r.evaluations,
        "seconds": time.perf_counter() - t0,
    }


def run_ppo(case: Case, seed: int, options: dict[str, Any], polish: int) -> dict[str, Any]:
    """PPO's own best plan (``polish_evaluations=0``), then the planner's local search from
    it, as the planner runs it by default (the same deterministic steps, timed apart)."""
    t0 = time.perf_counter()
    problem = case.problem(seed, None, None)
    runtime.start_local()  # a fresh local Ray per run, timed with it
    try:
        r = make_planner("ppo", **options, polish_evaluations=0).plan(problem)
    except (InfeasibleError, ProblemError) as e:
        return {"seed": seed, "value": math.inf, "ppo_value": math.inf, "error": str(e)[:200]}
    finally:
        runtime.shutdown()
    ppo_seconds = time.perf_counter() - t0
    search = Search(problem, "ppo", {"polish_evaluations": polish})
    search.evaluate_plans([r.plan])
    polish_plan(search, polish)
    return {
        "seed": seed,
        "ppo_value": r.value,
        "ppo_plan": r.plan.to_dict(),
        "ppo_evaluations": r.evaluations,
        "ppo_seconds": ppo_seconds,
        "value": search.best_value,
        "plan": search.best_plan.to_dict() if search.best_plan else None,
        "evaluations": r.evaluations + search.evaluations,
        "seconds": time.perf_counter() - t0,
        "curve": [[h.evaluations, round(h.seconds, 3), h.best] for h in r.history],
        "error": "",
    }


def run_tapp(case: Case, seed: int, evaluations: int) -> dict[str, Any]:
    """TAPP (REINFORCE) on the same instance and seed under an evaluation budget, for the
    evaluations-to-5%/1% columns beside PPO's."""
    t0 = time.perf_counter()
    try:
        r = make_planner("tapp").plan(case.problem(seed, evaluations, None))
    except (InfeasibleError, ProblemError) as e:
        return {"seed": seed, "value": math.inf, "error": str(e)[:200], "curve": []}
    return {
        "seed": seed,
        "value": r.value,
        "evaluations": r.evaluations,
        "seconds": time.perf_counter() - t0,
        "curve": [[h.evaluations, round(h.seconds, 3), h.best] for h in r.history],
        "error": "",
    }


def reached(curve: list[list[float]], exact: float) -> dict[str, int | None]:
    """Evaluations at which the best first came within 5% and 1% of exact (None: never)."""
    out: dict[str, int | None] = {}
    for gap in THRESHOLDS:
        evals, _ = reach([(int(e), s, b) for e, s, b in curve], exact, gap)
        out[f"{gap:.0%}"] = evals if evals >= 0 else None
    return out


def fmt(value: float, objective: Objective) -> str:
    if not math.isfinite(value):
        return "inf"
    return f"${value * 1e6:.3f}/Msample" if objective is Objective.COST else f"{value:.5g} s"


def pct(gap: float) -> str:
    return f"{gap:+.2%}" if math.isfinite(gap) else "inf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ",".join(f"{s}" if "/" in s else f"{s}/time" for s in DEFAULT_PPO)
    ap.add_argument("--instances", default=default, help="MODEL@CLUSTER/OBJECTIVE, ...")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=None, help="default: the planner's")
    ap.add_argument("--train-batch", type=int, default=None)
    ap.add_argument("--minibatch", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--entropy", type=float, default=None)
    ap.add_argument("--lambda", dest="lambda_", type=float, default=None)
    ap.add_argument("--actions", default=None, help="the env's action space: stages | layers")
    ap.add_argument("--envs-per-runner", type=int, default=None)
    ap.add_argument("--exploring-starts", type=float, default=None)
    ap.add_argument("--polish", type=int, default=0, help="local-search evaluations after PPO")
    ap.add_argument(
        "--tapp-evaluations", type=int, default=2000, help="TAPP's budget (0: no TAPP runs)"
    )
    ap.add_argument("--out", default=None, help=OUT_HELP)
    a = ap.parse_args()
    bench = BenchRun("ppo_quality")
    given = {
        "iterations": a.iterations,
        "train_batch": a.train_batch,
        "minibatch": a.minibatch,
        "epochs": a.epochs,
        "lr": a.lr,
        "entropy_coeff": a.entropy,
        "lambda_": a.lambda_,
        "actions": a.actions,
        "envs_per_runner": a.envs_per_runner,
        "exploring_starts": a.exploring_starts,
    }
    options = {k: v for k, v in given.items() if v is not None}
    console = Console(width=160)
    t_start = time.perf_counter()
    docs: list[dict[str, Any]] = []
    for spec in a.instances.split(","):
        case = case_of(spec, a.batch)
        ref = exact(case)
        console.print(f"{case.key}: exact {fmt(ref['value'], case.objective)} by brute")
        runs: list[dict[str, Any]] = []
        for seed in range(a.seeds):
            r = run_ppo(case, seed, options, a.polish)
            r["gap"] = gap_of(r["value"], ref["value"])
            r["ppo_gap"] = gap_of(r["ppo_value"], ref["value"])
            r["reached"] = reached(r.get("curve", []), ref["value"])
            if a.tapp_evaluations:
                t = run_tapp(case, seed, a.tapp_evaluations)
                t["gap"] = gap_of(t["value"], ref["value"])
                t["reached"] = reached(t["curve"], ref["value"])
                r["tapp"] = t
            console.print(
                f"  ppo seed {seed}: alone gap {r['ppo_gap']:+.2%} (reached {r['reached']}), "
                f"polished gap {r['gap']:+.2%}, evals {r.get('evaluations', 0)} in "
                f"{r.get('seconds', 0.0):.0f}s {r['error']}"
                + (
                    f"; tapp gap {r['tapp']['gap']:+.2%} ({r['tapp']['reached']})"
                    if "tapp" in r
                    else ""
                )
            )
            runs.append(r)
        docs.append(
            {
                "instance": case.key,
                "objective": case.objective.value,
                "min_throughput": case.target,
                "exact": ref,
                "runs": runs,
            }
        )
    columns: tuple[str, ...] = (
        "instance", "seed", "exact", "ppo", "gap", "to 5%", "to 1%", "evaluations",
        "seconds", "met", "tapp gap", "tapp to 5%", "tapp to 1%",
    )  # fmt: skip
    if a.polish:
        columns += ("ppo + polish", "gap")
    results = table(
        f"PPO alone against exact (brute), batch {a.batch}, target <= {TARGET:.0%}; "
        "evaluations to reach 5% / 1% beside TAPP's",
        columns,
        left=("instance",),
    )
    for d in docs:
        obj = Objective(d["objective"])
        for r in d["runs"]:
            t = r.get("tapp", {})
            row = [
                d["instance"],
                str(r["seed"]),
                fmt(d["exact"]["value"], obj),
                fmt(r["ppo_value"], obj),
                pct(r["ppo_gap"]),
                str(r["reached"]["5%"] or "-"),
                str(r["reached"]["1%"] or "-"),
                str(r.get("ppo_evaluations", 0)),
                f"{r.get('ppo_seconds', 0.0):.0f}",
                "yes" if r["ppo_gap"] <= TARGET + 1e-12 else "NO",
                pct(t["gap"]) if t else "-",
                str(t["reached"]["5%"] or "-") if t else "-",
                str(t["reached"]["1%"] or "-") if t else "-",
            ]
            if a.polish:
                row += [fmt(r["value"], obj), pct(r["gap"])]
            results.add_row(*row)
    console.print(results)
    out = {
        "batch": a.batch,
        "seeds": a.seeds,
        "options": options,
        "target": TARGET,
        "instances": docs,
        "met": all(r["ppo_gap"] <= TARGET + 1e-12 for d in docs for r in d["runs"]),
        "total_seconds": time.perf_counter() - t_start,
    }
    path = bench.write(out, out=Path(a.out) if a.out else None, indent=1)
    console.print(f"wrote {display(path)}")


if __name__ == "__main__":
    main()
