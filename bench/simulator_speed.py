"""Evaluations per second: vectorised ``batch_eval`` against a Python loop over ``simulate``.

A synthetic 50-layer chain with skips, S=4 stages, M=8 equal microbatches (GPipe and 1F1B)
plus unequal microbatches (GPipe and 1F1B) and remainders (per-stage sizes that do not
divide the batch), a population of 10,000 random plans on the cloud-mix style cluster
below. ``batch_eval`` is timed two ways in the same run: vectorised over the plans and, per
stage, over the microbatches (TiDGAP's two levels, the default), and walking the microbatch
indices one at a time (``over_microbatches=False``, the evaluator before issue #16). Each
time is the best of ``REPEATS``. Prints a table and writes
``bench/results/simulator_speed/<UTC date-time>.json`` (:mod:`bench.record`).

    .venv/bin/python -m bench.simulator_speed
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from rich.console import Console

from bench.common import table
from bench.record import BenchRun, display
from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import LayerProfile, ModelProfile

LAYERS, STAGES, BATCH, MICRO = 50, 4, 64, 8
POPULATION, LOOP_SAMPLE, REPEATS = 10_000, 300, 7


def synthetic_profile(rng: np.random.Generator) -> ModelProfile:
    layers = []
    for i in range(LAYERS):
        succ = (i + 1,) if i < LAYERS - 1 else ()
        if i % 5 == 0 and i + 3 < LAYERS:
            succ = (*succ, i + 3)  # a residual skip
        layers.append(
            LayerProfile(
                f"l{i}",
                "conv",
                int(rng.integers(0, 5_000_000)),
                float(rng.uniform(1e7, 1e9)),
                int(rng.integers(10_000, 1_000_000)),
                succ,
            )
        )
    return ModelProfile("synthetic50", (3, 32, 32), tuple(layers))


def cluster() -> ClusterSpec:
    types = {
        "cpu": DeviceType("cpu", 1e12, 64, 100, 0.4),
        "t4": DeviceType("t4", 8.1e12, 16, 320, 0.53),
        "v100": DeviceType("v100", 1.57e13, 16, 900, 3.06),
    }
    nodes = (Node("n0", {"v100": 2}), Node("n1", {"t4": 2, "cpu": 1}), Node("n2", {"t4": 2}))
    return ClusterSpec("bench", types, nodes)


def random_population(
    rng: np.random.Generator, n_dev: int, equal: bool, sizes: tuple[int, ...] = (4, 8, 16)
) -> PlanBatch:
    cuts = np.sort(
        np.stack(
            [rng.choice(np.arange(1, LAYERS), STAGES - 1, replace=False) for _ in range(POPULATION)]
        ),
        axis=1,
    )
    bounds = np.concatenate(
        [np.zeros((POPULATION, 1), int), cuts, np.full((POPULATION, 1), LAYERS)], axis=1
    )
    perm = np.argsort(rng.random((POPULATION, n_dev)), axis=1)
    devices = np.full((POPULATION, STAGES, 2), -1)
    devices[:, :, 0] = perm[:, :STAGES]
    two = rng.random(POPULATION) < 0.5  # half the plans replicate stage 0 on a fifth device
    devices[two, 0, 1] = perm[two, STAGES]
    if equal:
        mb = np.full((POPULATION, STAGES), BATCH // MICRO)
    else:
        mb = rng.choice(list(sizes), size=(POPULATION, STAGES))
    return PlanBatch(bounds, mb, devices)


def best_time(run: Callable[[], object]) -> float:
    """The best of :data:`REPEATS` timings (this machine is shared: the best is the least
    disturbed)."""
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(
    evs: tuple[BatchEvaluator, BatchEvaluator],
    pop: PlanBatch,
    schedule: Schedule,
    c: ClusterSpec,
    prof: ModelProfile,
) -> dict[str, float]:
    two, one = evs
    res = two.evaluate(pop, BATCH, schedule)  # warm-up (and the answer checked below)
    walked = one.evaluate(pop, BATCH, schedule)
    vec_s = best_time(lambda: two.evaluate(pop, BATCH, schedule))
    walk_s = best_time(lambda: one.evaluate(pop, BATCH, schedule))
    plans = [pop.plan(i, c, BATCH, schedule) for i in range(LOOP_SAMPLE)]
    t0 = time.perf_counter()
    loop = [simulate(p, prof, c).batch_time_s for p in plans]
    loop_s = time.perf_counter() - t0
    err = float(np.max(np.abs(res.batch_time_s[:LOOP_SAMPLE] - loop) / np.array(loop)))
    err_walk = float(np.max(np.abs(res.batch_time_s - walked.batch_time_s) / walked.batch_time_s))
    vec_rate, walk_rate, loop_rate = POPULATION / vec_s, POPULATION / walk_s, LOOP_SAMPLE / loop_s
    return {
        "vectorised_plans_per_s": vec_rate,
        "per_microbatch_plans_per_s": walk_rate,
        "loop_plans_per_s": loop_rate,
        "speedup": vec_rate / loop_rate,
        "max_rel_diff": max(err, err_walk),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help
    bench = BenchRun("simulator_speed")
    rng = np.random.default_rng(0)
    prof, c = synthetic_profile(rng), cluster()
    evs = (BatchEvaluator(prof, c), BatchEvaluator(prof, c, over_microbatches=False))
    rows = {}
    for label, schedule, equal, sizes in [
        ("gpipe, M=8", Schedule.GPIPE, True, ()),
        ("1f1b, M=8", Schedule.ONE_F_ONE_B, True, ()),
        ("gpipe, unequal b in {4,8,16}", Schedule.GPIPE, False, (4, 8, 16)),
        ("1f1b, unequal b in {4,8,16}", Schedule.ONE_F_ONE_B, False, (4, 8, 16)),
        ("gpipe, remainders b in {5,7,9,12}", Schedule.GPIPE, False, (5, 7, 9, 12)),
    ]:
        pop = random_population(rng, len(c.device_ids), equal, sizes)
        rows[label] = measure(evs, pop, schedule, c, prof)
    columns = ("case", "batch_eval plans/s", "per-microbatch walk plans/s", "loop plans/s",
               "speed-up", "max rel diff")  # fmt: skip
    t = table(
        f"batch_eval vs simulate loop — {LAYERS} layers, S={STAGES}, B={BATCH}, "
        f"population {POPULATION:,} (loop timed on {LOOP_SAMPLE}; best of {REPEATS})",
        columns,
        left=("case",),
    )
    for label, r in rows.items():
        t.add_row(
            label,
            f"{r['vectorised_plans_per_s']:,.0f}",
            f"{r['per_microbatch_plans_per_s']:,.0f}",
            f"{r['loop_plans_per_s']:,.0f}",
            f"{r['speedup']:.0f}x",
            f"{r['max_rel_diff']:.1e}",
        )
    Console().print(t)
    out = {
        "layers": LAYERS,
        "stages": STAGES,
        "global_batch": BATCH,
        "microbatches": MICRO,
        "population": POPULATION,
        "loop_sample": LOOP_SAMPLE,
        "repeats": REPEATS,
        "targets": {"plans_per_s": 1_000_000, "speedup": 50},
        "cases": rows,
    }
    print(f"wrote {display(bench.write(out))}")


if __name__ == "__main__":
    main()
