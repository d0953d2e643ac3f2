"""Golden answers: what the cost model, the population evaluator, the MDP and the planners
answer on fixed problems, stored in ``tests/data/golden.json``.

The redesign (moving every concept to one home) must not change a single result; this
snapshot is how that is checked. Regenerate it only for a change that is *meant* to alter
results, and say so in the commit:

    .venv/bin/python -m tests.golden
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pipeplan.agents import Budget, Problem, make_planner
from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.envs.env import PlacementEnv

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "golden"
GOLDEN = ROOT / "tests" / "data" / "golden.json"
PRESETS = ROOT / "examples" / "clusters"

PROFILES = ("alexnet64", "gpt4", "pipedream-alexnet")
CLUSTERS = ("local-hetero", "cloud-mix", "tapp-paper")

# Planners whose answer is a function of the problem and the seed alone (evaluation
# budgets, no wall-clock budget), with options small enough for a unit test.
PLANNERS: dict[str, dict[str, Any]] = {
    "uniform": {},
    "balanced": {},
    "data_parallel": {},
    "greedy": {},
    "pipedream_dp": {},
    "dp": {},
    "genetic": {},
    "tapp": {"batch_size": 32},
}
EVALUATIONS = {"genetic": 1500, "tapp": 320}


def profile(name: str) -> ModelProfile:
    return ModelProfile.load(DATA / f"{name}.json")


def cluster(name: str) -> ClusterSpec:
    return ClusterSpec.load(PRESETS / f"{name}.yaml")


def _plans(prof: ModelProfile, spec: ClusterSpec) -> list[Plan]:
    """Hand-made plans that exercise replicas, skips, 1F1B and unequal microbatches."""
    n, ids = len(prof.layers), spec.device_ids
    a, b = n // 3, 2 * n // 3
    raw = [
        {"global_batch": 32, "stages": [{"layers": [0, n], "devices": [ids[0]], "microbatch": 8}]},
        {
            "global_batch": 32,
            "schedule": "1f1b",
            "stages": [
                {"layers": [0, a], "devices": [ids[0]], "microbatch": 4},
                {"layers": [a, b], "devices": [ids[1]], "microbatch": 4},
                {"layers": [b, n], "devices": [ids[-1]], "microbatch": 4},
            ],
        },
        {
            "global_batch": 64,
            "stages": [
                {"layers": [0, a], "devices": list(ids[: len(ids) - 1]), "microbatch": 16},
                {"layers": [a, n], "devices": [ids[-1]], "microbatch": 8},
            ],
        },
        {
            "global_batch": 48,
            "stages": [{"layers": [0, n], "devices": list(ids), "microbatch": 48}],
        },
    ]
    return [Plan.from_dict(r) for r in raw]


def _finite(x: Any) -> Any:
    """JSON without NaN/Infinity: non-finite floats become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def estimates() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in PROFILES:
        prof = profile(p)
        for c in CLUSTERS:
            spec = cluster(c)
            plans = _plans(prof, spec)
            rows = [simulate(plan, prof, spec).to_dict() for plan in plans]
            ev = BatchEvaluator(prof, spec)
            batch: dict[str, Any] = {}
            for k, plan in enumerate(plans):
                res = ev.evaluate(
                    PlanBatch.from_plans([plan], spec), plan.global_batch, plan.schedule
                )
                batch[str(k)] = {
                    "batch_time_s": float(res.batch_time_s[0]),
                    "fits": bool(res.fits[0]),
                    "cost_per_hour": float(res.cost_per_hour[0]),
                    "memory_ratio": float(res.memory_ratio[0]),
                }
            out[f"{p}@{c}"] = {"simulate": rows, "batch_eval": batch}
    return _finite(out)


def episodes() -> dict[str, Any]:
    """Seeded random legal episodes of the MDP: rewards and plans."""
    out: dict[str, Any] = {}
    for p in PROFILES:
        for c in CLUSTERS:
            for objective in ("time", "cost"):
                env = PlacementEnv(
                    {"profile": profile(p), "cluster": cluster(c), "objective": objective,
                     "global_batch": 32, "microbatches": [1, 4]}
                )  # fmt: skip
                rng = np.random.default_rng(7)
                rows = []
                for episode in range(6):
                    obs, _ = env.reset(seed=episode)
                    done, total, first_obs = False, 0.0, obs["observations"].tolist()
                    while not done:
                        legal = np.flatnonzero(obs["action_mask"])
                        obs, r, done, _, info = env.step(int(rng.choice(legal)))
                        total += r
                    rows.append(
                        {"reward": total, "plan": info["plan"].to_dict(), "first_obs": first_obs}
                    )
                out[f"{p}@{c}/{objective}"] = rows
    return _finite(out)


def planners() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in ("alexnet64", "gpt4"):
        for c in ("local-hetero", "cloud-mix"):
            for objective, floor in (
                ("time", None),
                ("cost", 2.0 if c == "local-hetero" else 50.0),
            ):
                for name, options in PLANNERS.items():
                    problem = Problem(
                        profile(p), cluster(c), objective=objective, global_batch=32,
                        min_throughput=floor, seed=3,
                        budget=Budget(evaluations=EVALUATIONS.get(name, 20_000), seconds=None),
                    )  # fmt: skip
                    key = f"{p}@{c}/{objective}/{name}"
                    try:
                        res = make_planner(name, **options).plan(problem)
                    except Exception as e:  # an infeasible answer is an answer too
                        out[key] = {"error": type(e).__name__}
                        continue
                    out[key] = {
                        "plan": res.plan.to_dict(),
                        "value": res.value,
                        "evaluations": res.evaluations,
                        "history": [h.best for h in res.history][-5:],
                    }
    return _finite(out)


def compute() -> dict[str, Any]:
    return {"estimates": estimates(), "episodes": episodes(), "planners": planners()}


def write_inputs() -> None:
    """The profiles the golden answers are computed on (the profiler's output, kept)."""
    from bench.instances import model_profile
    from pipeplan.models import profiler, zoo

    DATA.mkdir(parents=True, exist_ok=True)
    module, example = zoo.build("alexnet", 64)
    profiler.profile_model(module, example, name="alexnet64", device_type=None).save(
        DATA / "alexnet64.json"
    )
    module, example = zoo.build("gpt", 32, n_layer=4)
    profiler.profile_model(module, example, name="gpt4", device_type=None).save(DATA / "gpt4.json")
    model_profile("pipedream-alexnet").save(DATA / "pipedream-alexnet.json")


if __name__ == "__main__":
    if not (DATA / "alexnet64.json").exists():
        write_inputs()
    GOLDEN.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)}")
