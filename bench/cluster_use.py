"""Searches on the cluster they run on: PPO's sampling with 0, 1 and 2 env runners, and
measured evaluations one plan at a time against several at once, on ``local-hetero``.

One :class:`~executor.local_cluster.LocalCluster` of ``local-hetero`` (three Ray nodes, one
logical CPU each, emulated devices) serves both parts.

- **PPO**: the ``ppo`` planner's algorithm for AlexNet (64x64 input, batch 64) is built with
  0, 1 and 2 env runners; after one warm-up iteration, ``--iterations`` training iterations
  of ``--train-batch`` env steps are timed. Samples per second = env steps sampled / wall
  time of those iterations (sampling and the learner's update: what a search waits for).
- **Measured evaluations**: a population of plans of ``digits_cnn`` (batch 32) on
  local-hetero's four devices, each run ``1 + 2`` steps by a fresh
  :class:`~executor.measured_reward.MeasuredReward`, once with ``concurrent=False`` and once
  with ``concurrent=True`` (pairwise-disjoint sets run at once). Evaluations per hour =
  plans / wall time (actor start-up included). The table also gives each mode's mean
  measured batch time over the cost model's (analytic profile: only the two modes' ratio
  matters) and, for several at once, the mean of each plan's batch time over its batch
  time alone: on one machine the devices share its cores, so plans run at once measure
  slower than alone (the reason ``concurrent`` defaults to off on an emulated spec).

    .venv/bin/python -m bench.cluster_use            # ~4 min on 2 cores, more when busy
Writes ``bench/results/cluster_use/<UTC date-time>.json`` (:mod:`bench.record`; ``--out``
to change).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.common import OUT_HELP, table
from bench.record import BenchRun, display
from pipeplan.agents import Problem, make_planner
from pipeplan.agents.rllib_ppo import PPOPlanner
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measured_reward import MeasuredReward, disjoint_groups
from pipeplan.executor.model import ModelSource
from pipeplan.service.tasks.common import zoo_profile
from pipeplan.service.tasks.progress import QUIET

ROOT = Path(__file__).resolve().parents[1]
SPEC = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
RUNNERS = (0, 1, 2)
MEASURED_BATCH = 32


def ppo_rate(problem: Problem, runners: int, train_batch: int, iterations: int) -> dict[str, Any]:
    """Env steps per second of PPO's training iterations with ``runners`` env runners."""
    planner = make_planner("ppo", num_env_runners=runners, train_batch=train_batch)
    assert isinstance(planner, PPOPlanner)
    t0 = time.perf_counter()
    algo = planner._build(problem, None, runners)
    build_s = time.perf_counter() - t0
    try:
        algo.train()  # warm-up: the first iteration compiles and fills caches
        steps, t0 = 0, time.perf_counter()
        for _ in range(iterations):
            sampled = float(algo.train()["env_runners"]["num_env_steps_sampled"])
            if not math.isfinite(sampled):  # a runner was lost (e.g. killed for memory)
                raise RuntimeError(f"PPO with {runners} env runners: an iteration sampled nothing")
            steps += int(sampled)
        seconds = time.perf_counter() - t0
    finally:
        algo.stop()
    print(f"ppo, {runners} env runners: {steps} steps in {seconds:.1f} s", flush=True)
    return {
        "env_runners": runners,
        "build_s": build_s,
        "iterations": iterations,
        "env_steps": steps,
        "seconds": seconds,
        "samples_per_s": steps / seconds,
    }


def population() -> list[Plan]:
    """Plans of digits_cnn (8 layers) on local-hetero's devices: one- and two-stage, some
    sharing a device with the one before (so not every plan can run at once)."""
    b, fast, mid, slow0, slow1 = MEASURED_BATCH, "n0/fast:0", "n1/mid:0", "n2/slow:0", "n2/slow:1"
    one = [Plan(b, (Stage((0, 8), (d,), 8),)) for d in (fast, mid, slow0, slow1)]
    two = [
        Plan(b, (Stage((0, 5), (fast,), 8), Stage((5, 8), (mid,), 8))),
        Plan(b, (Stage((0, 4), (slow0,), 8), Stage((4, 8), (slow1,), 8))),
        Plan(b, (Stage((0, 3), (mid,), 16), Stage((3, 8), (fast,), 16))),
        Plan(b, (Stage((0, 6), (slow1,), 16), Stage((6, 8), (slow0,), 16))),
    ]
    return [*one, *two]


def measured_rate(problem: Problem, plans: list[Plan], concurrent: bool) -> dict[str, Any]:
    """Evaluations per hour of a fresh MeasuredReward over ``plans``, and how the measured
    batch times compare with the cost model's."""
    source = ModelSource("digits_cnn", 8)
    with MeasuredReward(source, SPEC, repeats=2, warmup=1, concurrent=concurrent) as reward:
        t0 = time.perf_counter()
        outcomes = reward.run(plans, problem)
        seconds = time.perf_counter() - t0
    ran = [o for o in outcomes if o.measurement is not None]
    print(f"measured, concurrent={concurrent}: {len(plans)} plans in {seconds:.1f} s", flush=True)
    ratios = [
        o.measurement.batch_time_s / simulate(o.plan, problem.profile, SPEC).batch_time_s
        for o in ran
        if o.measurement is not None
    ]
    return {
        "concurrent": concurrent,
        "plans": len(plans),
        "ran": len(ran),
        "errors": sorted({o.error for o in outcomes if o.error}),
        "sets": len(disjoint_groups([frozenset(p.devices) for p in plans]))
        if concurrent
        else len(plans),
        "pipelines_started": reward.pipelines_started,
        "seconds": seconds,
        "evaluations_per_hour": len(plans) / seconds * 3600,
        "batch_times_s": [o.measurement.batch_time_s for o in ran if o.measurement],
        "mean_measured_over_predicted": statistics.fmean(ratios) if ratios else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3, help="timed PPO iterations per row")
    ap.add_argument("--train-batch", type=int, default=500, help="env steps per iteration")
    ap.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    a = ap.parse_args()
    bench = BenchRun("cluster_use")
    t_start = time.perf_counter()
    ppo_problem = Problem(zoo_profile("alexnet", 64, QUIET), SPEC, global_batch=64, seed=0)
    digits = Problem(zoo_profile("digits_cnn", 8, QUIET), SPEC, global_batch=MEASURED_BATCH)
    with LocalCluster(SPEC, object_store_mb=300) as cluster:
        ppo_rows = [ppo_rate(ppo_problem, r, a.train_batch, a.iterations) for r in RUNNERS]
        plans = population()
        measured_rows = [measured_rate(digits, plans, c) for c in (False, True)]
        alone, together = (r["batch_times_s"] for r in measured_rows)
        if len(alone) == len(together) == len(plans):  # every plan ran both ways
            slower = [t / a for a, t in zip(alone, together, strict=True)]
            measured_rows[1]["batch_time_over_alone"] = slower
            measured_rows[1]["mean_batch_time_over_alone"] = statistics.fmean(slower)
        startup_s = cluster.startup_s

    console = Console(width=120)
    t = table(
        f"PPO on {SPEC.name} (AlexNet 64x64, batch 64), {a.train_batch} steps/iter",
        ("env runners", "build s", "env steps", "seconds", "samples/s"),
    )
    for r in ppo_rows:
        t.add_row(
            str(r["env_runners"]), f"{r['build_s']:.1f}", str(r["env_steps"]),
            f"{r['seconds']:.1f}", f"{r['samples_per_s']:.0f}",
        )  # fmt: skip
    console.print(t)
    cols = ("mode", "plans", "sets", "pipelines", "seconds", "evals/hour", "meas/pred", "vs alone")
    m = table(f"Measured evaluations on {SPEC.name} (digits_cnn, batch 32, 1 + 2 steps)", cols)
    for r in measured_rows:
        ratio = r["mean_measured_over_predicted"]
        vs_alone = r.get("mean_batch_time_over_alone")
        m.add_row(
            "several at once" if r["concurrent"] else "one at a time", str(r["plans"]),
            str(r["sets"]), str(r["pipelines_started"]), f"{r['seconds']:.1f}",
            f"{r['evaluations_per_hour']:.0f}", "-" if ratio is None else f"{ratio:.2f}",
            "-" if vs_alone is None else f"{vs_alone:.2f}",
        )  # fmt: skip
    console.print(m)
    doc = {
        "cluster": SPEC.name,
        "cluster_startup_s": startup_s,
        "total_s": time.perf_counter() - t_start,
        "ppo": ppo_rows,
        "measured": measured_rows,
    }
    print(f"wrote {display(bench.write(doc, out=a.out, indent=1))}")


if __name__ == "__main__":
    main()
