"""Training throughput on a planned plan against the best single device and BSP.

On ``local-pipeline`` (one local Ray cluster for the whole run: three Ray nodes, six
EMULATED devices, fast:mid:slow = 4:3:2), for three models named by reference as a user
names them -- a zoo CNN (``alexnet`` at 64 x 64), a Hugging Face GPT-2 built from its config
(``hf:GPT2LMHeadModel``, 2 blocks of width 128) and a factory (``bench.models:small_resnet``)
-- each of three plans trains ``--warmup`` + ``--steps`` steps with
:func:`executor.train.train` (``pipeplan train``'s loop: the stages read the synthetic
stream themselves; plain SGD, dropout off), all at the model's global batch:

- ``planned``: the plan ``--planner`` (default ``dp``) finds with the cost model, objective
  time, on the profile measured on the cluster (as ``pipeplan demo`` plans;
  ``--profile analytic`` plans on FLOP counts instead);
- ``single device``: the whole model on the best single device by the cost model
  (:func:`service.tasks.demo.best_single_device`, the demo's row);
- ``BSP``: one stage replicated on every device (:func:`agents.baselines.every_device.bsp_all`,
  the demo's reference).

A plan that equals another is run once. Reported per plan: samples/s (the median over the
steps after the warm-up of global batch / step time as the driver saw it), the cost model's
prediction, the ratios to the single device and to BSP, and the loss at the last step. The
planned plan's loss curve is also checked against single-process training on the same
batches (:func:`executor.model.train_single_process` on
:func:`executor.data.synthetic_batches`): the largest ``|difference|`` over its steps is in
the table note and the JSON (``--check-steps``: how many of them; 0 skips the check).

    .venv/bin/python -m bench.train            # 3 models, 2 + 8 steps per plan
    .venv/bin/python -m bench.train --quick    # 3 models, 1 + 3 steps per plan

Writes ``bench/results/train/<UTC date-time>.json`` (``--quick``: ``bench/results/train_quick/``;
:mod:`bench.record`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import OUT_HELP, fmt, model_keys, table
from pipeplan.core.plan import Plan

if TYPE_CHECKING:
    from rich.table import Table

    from pipeplan.core.cluster import ClusterSpec
    from pipeplan.core.profile import ModelProfile
    from pipeplan.executor.model import ModelSource, OptimizerConfig

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "local-pipeline.yaml"
PLANNED, SINGLE, BSP = "planned", "single device", "BSP"
PLANS = (PLANNED, SINGLE, BSP)
"""The rows of each model, in the table's order."""
STORE_MB = 300
"""Object store per Ray node: the stages read their own data, only small answers pass it."""
LR = 0.05
PLANNER_OPTIONS: dict[str, dict[str, Any]] = {"brute": {"max_stages": 3}}
"""As the demo: ``brute`` on six devices up to three stages (about a second)."""

GPT2_OPTIONS = {
    "n_layer": 2,
    "n_embd": 128,
    "n_head": 4,
    "n_positions": 32,
    "vocab_size": 2048,
    "bos_token_id": 2047,  # GPT-2's default (50256) lies outside a small vocabulary
    "eos_token_id": 2047,
}


@dataclass(frozen=True)
class Case:
    """A model by reference, its input, and the global batch every plan of it trains."""

    label: str
    model: str
    batch: int
    input_size: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    input_shape: tuple[int, ...] | None = None

    def source(self, seed: int) -> ModelSource:
        """How the stages build it (torch is imported here, not with this module)."""
        from pipeplan.executor.model import ModelSource

        return ModelSource(
            self.model,
            self.input_size,
            seed=seed,
            options=dict(self.options),
            input_shape=self.input_shape,
        )


CASES: dict[str, Case] = {
    "alexnet": Case("alexnet@64", "alexnet", 32, input_size=64),
    "gpt2": Case("hf:GPT2LMHeadModel 2L-128@32", "hf:GPT2LMHeadModel", 16, 32, GPT2_OPTIONS),
    "resnet": Case(
        "bench.models:small_resnet@32", "bench.models:small_resnet", 32, input_shape=(3, 32, 32)
    ),
}


# --- the numbers (pure) -----------------------------------------------------------------------


def throughput(samples_per_s: Sequence[float], warmup: int) -> float:
    """The median samples/s of the steps after the first ``warmup`` (all of them when there
    are no more)."""
    if not samples_per_s:
        raise ValueError("throughput: no steps")
    kept = samples_per_s[warmup:] or samples_per_s
    return statistics.median(kept)


def max_abs_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest ``|a[i] - b[i]|`` of two curves of the same length."""
    if len(a) != len(b) or not a:
        raise ValueError(f"max_abs_difference: curves of {len(a)} and {len(b)} steps")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def with_ratios(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row (``model``, ``plan``, ``samples_per_s``) with ``vs_single`` and ``vs_bsp``:
    its samples/s over its model's :data:`SINGLE` and :data:`BSP` rows' (None where that row
    is missing or did not run)."""
    rows = list(rows)
    speed = {(r["model"], r["plan"]): r.get("samples_per_s") for r in rows}

    def ratio(r: dict[str, Any], base: str) -> float | None:
        x, y = r.get("samples_per_s"), speed.get((r["model"], base))
        return None if x is None or not y else x / y

    return [{**r, "vs_single": ratio(r, SINGLE), "vs_bsp": ratio(r, BSP)} for r in rows]


def describe(plan: Plan) -> str:
    """``[0,8)@fast b8 | [8,21)@mid+mid b4``: each stage's layers, device types, microbatch."""
    return " | ".join(
        f"[{s.start},{s.end})@{'+'.join(d.split('/')[1].split(':')[0] for d in s.devices)} "
        f"b{s.microbatch}"
        for s in plan.stages
    )


def cells(row: Mapping[str, Any]) -> list[str]:
    """One table row: model, plan, stages, samples/s, predicted, x single, x BSP, loss."""
    predicted = row.get("predicted_s")
    same = f" (= {row['same_as']})" if row.get("same_as") else ""
    return [
        row["model"],
        row["plan"] + same,
        row["stages"],
        fmt(row.get("samples_per_s"), ".1f"),
        fmt(row["batch"] / predicted if predicted else None, ".1f"),
        fmt(row.get("vs_single"), ".2f", "x"),
        fmt(row.get("vs_bsp"), ".2f", "x"),
        fmt(row.get("final_loss"), ".4f"),
    ]


COLUMNS = ("model", "plan", "stages", "samples/s", "predicted", "vs single", "vs BSP", "loss")


def render(rows: Sequence[Mapping[str, Any]], steps: int, note: str) -> Table:
    """The table of every row (with ratios, :func:`with_ratios`), ``note`` as its caption."""
    columns = [*COLUMNS[:-1], f"loss @{steps}"]
    t = table(
        "training throughput on local-pipeline: planned vs single device vs BSP",
        columns,
        left=("model", "plan", "stages"),
    )
    for row in rows:
        t.add_row(*cells(row))
    t.caption = note
    return t


def loss_checks(checks: Mapping[str, Mapping[str, Any]]) -> str:
    """The note's line on the loss checks: each model's max |difference|."""
    parts = [
        f"{m} {fmt(c.get('max_abs_difference'), '.1e')} over {c.get('steps', 0)} steps"
        for m, c in checks.items()
    ]
    return "planned vs single-process loss, max |difference|: " + ("; ".join(parts) or "-")


# --- the runs (Ray) ---------------------------------------------------------------------------


def profile_of(source: ModelSource, spec: ClusterSpec, batch: int, how: str) -> ModelProfile:
    """The profile planned on: measured on the connected cluster (as the demo's), or
    analytic."""
    from pipeplan.models import profiler
    from pipeplan.service.tasks.live import measure_on_cluster
    from pipeplan.service.tasks.progress import QUIET

    if how == "measured":
        return measure_on_cluster(source, spec, QUIET, global_batch=batch)
    module, example = source.build()
    return profiler.profile_model(module, example, name=source.name, device_type=None)


def plans_of(
    profile: ModelProfile, spec: ClusterSpec, batch: int, planner: str
) -> dict[str, tuple[Plan, float]]:
    """Each of :data:`PLANS` with its predicted step time (seconds)."""
    from pipeplan.agents import Objective, Problem, make_planner
    from pipeplan.agents.baselines.every_device import bsp_all
    from pipeplan.core.costmodel import simulate
    from pipeplan.service.tasks.demo import DEMO_BUDGET, best_single_device

    problem = Problem(profile, spec, Objective.TIME, global_batch=batch, budget=DEMO_BUDGET)
    found = make_planner(planner, **PLANNER_OPTIONS.get(planner, {})).plan(problem).plan
    plans = {PLANNED: found, SINGLE: best_single_device(problem), BSP: bsp_all(problem)}
    return {k: (p, simulate(p, profile, spec).batch_time_s) for k, p in plans.items()}


def train_on(
    plan: Plan, source: ModelSource, spec: ClusterSpec, steps: int, optimizer: OptimizerConfig
) -> list[Any]:
    """``steps`` deterministic steps of ``plan`` (emulated), each as the driver saw it."""
    from pipeplan.executor.train import TrainConfig, train

    config = TrainConfig(steps=steps, optimizer=optimizer, deterministic=True, emulate=True)
    return list(train(plan, source, spec, config).steps)


def reference_losses(source: ModelSource, batch: int, steps: int, optimizer: Any) -> list[float]:
    """Single-process training's losses on the synthetic stream's first ``steps`` batches
    (seed 0, as :class:`executor.train.TrainConfig`'s)."""
    import torch

    from pipeplan.executor.data import synthetic_batches
    from pipeplan.executor.model import train_single_process

    model, example = source.build()
    model.eval()
    with torch.no_grad():
        output_shape = tuple(model(example).shape)
    batches = synthetic_batches(example, output_shape, batch, steps, seed=0)
    return list(train_single_process(source, batches, optimizer, deterministic=True).losses)


def measure_case(
    key: str, spec: ClusterSpec, a: argparse.Namespace, say: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Plan ``key``'s model, train each distinct plan, check the planned plan's losses."""
    from pipeplan.executor.measured_reward import plan_key
    from pipeplan.executor.model import OptimizerConfig

    case = CASES[key]
    source = case.source(a.seed)
    optimizer = OptimizerConfig("sgd", lr=a.lr)
    t0 = time.perf_counter()
    profile = profile_of(source, spec, case.batch, a.profile)
    plans = plans_of(profile, spec, case.batch, a.planner)
    say(f"{case.label}: profiled and planned in {time.perf_counter() - t0:.0f} s")
    total = a.warmup + a.steps
    rows: list[dict[str, Any]] = []
    ran: dict[str, tuple[str, list[Any]]] = {}
    for label, (plan, predicted) in plans.items():
        same = ran.get(plan_key(plan))
        if same is None:
            t0 = time.perf_counter()
            steps = train_on(plan, source, spec, total, optimizer)
            ran[plan_key(plan)] = (label, steps)
            say(f"  {label}: {describe(plan)}, {total} steps in {time.perf_counter() - t0:.0f} s")
        else:
            steps = same[1]
        rows.append(
            {
                "model": case.label,
                "plan": label,
                "same_as": same[0] if same else None,
                "batch": case.batch,
                "stages": describe(plan),
                "plan_doc": plan.to_dict(),
                "predicted_s": predicted,
                "samples_per_s": throughput([s.samples_per_s for s in steps], a.warmup),
                "step_s": [s.batch_time_s for s in steps],
                "losses": [s.loss for s in steps],
                "final_loss": steps[-1].loss,
            }
        )
    check: dict[str, Any] = {"steps": min(a.check_steps, total)}
    if check["steps"]:
        planned = rows[0]["losses"][: check["steps"]]
        reference = reference_losses(source, case.batch, check["steps"], optimizer)
        check |= {
            "planned": planned,
            "single_process": reference,
            "max_abs_difference": max_abs_difference(planned, reference),
        }
    return rows, check


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 + 3 steps per plan")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 8; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out (default 2; quick 1)")
    ap.add_argument(
        "--check-steps",
        type=int,
        default=None,
        help="planned steps compared with single-process training (default: all; 0: none)",
    )
    ap.add_argument("--models", default=",".join(CASES))
    ap.add_argument("--planner", default="dp", help="the planner of the planned row")
    ap.add_argument("--profile", choices=("measured", "analytic"), default="measured")
    ap.add_argument("--lr", type=float, default=LR, help="SGD's learning rate")
    ap.add_argument("--seed", type=int, default=0, help="the models' weights")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    a = ap.parse_args(argv)
    keys = model_keys(ap, a.models, CASES)
    a.steps = a.steps if a.steps is not None else (3 if a.quick else 8)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    if a.steps < 1 or a.warmup < 0:
        ap.error(f"--steps: must be >= 1 and --warmup >= 0, got {a.steps} and {a.warmup}")
    a.check_steps = a.warmup + a.steps if a.check_steps is None else a.check_steps
    if a.check_steps < 0:
        ap.error(f"--check-steps: must be >= 0, got {a.check_steps}")
    drive(a, keys)


def drive(a: argparse.Namespace, keys: list[str]) -> None:
    from rich.console import Console

    from bench.record import BenchRun, display
    from pipeplan.core.cluster import ClusterSpec
    from pipeplan.executor.emulation import EMULATED_NOTE
    from pipeplan.executor.local_cluster import LocalCluster
    from pipeplan.service.tasks.live import quiet_ray_logs

    run = BenchRun("train_quick" if a.quick else "train")
    console = Console(width=160)
    spec = ClusterSpec.load(CLUSTER)
    quiet_ray_logs()
    rows: list[dict[str, Any]] = []
    checks: dict[str, dict[str, Any]] = {}
    with LocalCluster(spec, object_store_mb=STORE_MB):
        for key in keys:
            found, check = measure_case(key, spec, a, console.print)
            rows += found
            checks[found[0]["model"]] = check
    rows = with_ratios(rows)
    total = a.warmup + a.steps
    note = (
        f"samples/s: median of {a.steps} steps after {a.warmup} warm-up (predicted: the cost "
        f"model's); SGD lr {a.lr}, dropout off; planner {a.planner} on the {a.profile} profile."
        "\n"
        f"{loss_checks(checks)}\n{EMULATED_NOTE}"
    )
    console.print(render(rows, total, note))
    worst = max((c.get("max_abs_difference", 0.0) for c in checks.values()), default=0.0)
    payload = {
        "quick": a.quick,
        "cluster": spec.name,
        "emulated": True,
        "note": EMULATED_NOTE,
        "steps": a.steps,
        "warmup": a.warmup,
        "planner": a.planner,
        "profile": a.profile,
        "optimizer": {"kind": "sgd", "lr": a.lr},
        "deterministic": True,
        "rows": rows,
        "loss_check": checks,
        "summary": {
            "planned_vs_single": {r["model"]: r["vs_single"] for r in rows if r["plan"] == PLANNED},
            "planned_vs_bsp": {r["model"]: r["vs_bsp"] for r in rows if r["plan"] == PLANNED},
            "max_abs_loss_difference": worst if math.isfinite(worst) else None,
        },
    }
    path = run.write(payload, out=a.out)
    console.print(f"wrote {display(path)}")


if __name__ == "__main__":
    main()
