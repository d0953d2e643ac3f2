"""Elastic training after a lost node, against restarting by hand from the last checkpoint.

On ``local-pipeline`` (three Ray nodes, six EMULATED devices, fast:mid:slow = 4:3:2), a
4-block GPT (width 64, 16 tokens, dropout off) trains on ``dp``'s 1F1B plan for the whole
cluster (a checkpoint every ``--checkpoint-every`` steps, SGD), and node ``--kill`` is
killed once ``--kill-after`` steps are trained. Each run does it twice, each on a cluster
of its own:

- ``elastic``: :func:`executor.elastic.elastic_train` notices the loss, chooses between
  ``dp``'s plan on what is left and the original plan folded onto it (both predicted on the
  profile corrected by the stage times the run measured) and resumes the last checkpoint
  under the one predicted faster;
- ``by hand``: what a user does today. The run ends with the error; it is restarted from
  the last checkpoint with the original plan folded onto what is left
  (:func:`executor.elastic.fold_plan`: its cuts and microbatches kept, the lost devices
  dropped from their stages, and a stage that lost all of its devices merged into its
  neighbour). The person's own reaction time is not counted: the restart starts the moment
  the error arrives.

Reported per run and mode: seconds from the kill to the first step trained after it (the
restart included), steps lost (trained after the checkpoint resumed, trained again), and
samples/s before the loss and after it (medians, the first step of each segment left out);
over ``--runs`` runs, the median and the range. Elastic rows also record which candidate
won (``chosen``), both predictions and the speed factors behind them.

    .venv/bin/python -m bench.elastic            # 3 runs
    .venv/bin/python -m bench.elastic --runs 1   # one

Writes ``bench/results/elastic/<UTC date-time>.json`` (:mod:`bench.record`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import OUT_HELP, fmt, table
from pipeplan.core.plan import Plan, Schedule

if TYPE_CHECKING:
    from rich.table import Table

    from pipeplan.core.cluster import ClusterSpec
    from pipeplan.core.profile import ModelProfile
    from pipeplan.executor.train import TrainConfig, TrainStep

CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "local-pipeline.yaml"
GPT = {"n_layer": 4, "d_model": 64, "n_head": 4, "n_ctx": 16, "vocab_size": 256, "dropout": 0.0}
BATCH = 32
STORE_MB = 150
MODES = ("elastic", "by hand")


def folded(plan: Plan, lost: set[str]) -> Plan:
    """``plan`` on what is left after ``lost`` nodes went
    (:func:`executor.elastic.fold_plan`)."""
    from pipeplan.executor.elastic import fold_plan

    left = [d for d in plan.devices if d.split("/")[0] not in lost]
    if not left:
        raise ValueError(f"no device of the plan is left after losing {sorted(lost)}")
    return fold_plan(plan, left)


@dataclass
class Timeline:
    """Each trained step with when it ended, and when the node was killed."""

    steps: list[tuple[float, TrainStep]] = field(default_factory=list)
    killed_at: float | None = None

    def record(self, step: TrainStep) -> None:
        self.steps.append((time.perf_counter(), step))

    def summary(self) -> dict[str, Any]:
        """Time to resume, and samples/s before and after the loss."""
        assert self.killed_at is not None
        before = [s for t, s in self.steps if t <= self.killed_at]
        after = [(t, s) for t, s in self.steps if t > self.killed_at]
        resumed_s = after[0][0] - self.killed_at if after else None
        return {
            "resumed_s": resumed_s,
            "before_samples_per_s": _median([s.samples_per_s for s in before[1:]]),
            "after_samples_per_s": _median([s.samples_per_s for _, s in after[1:]]),
            "steps_after": len(after),
        }


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def profile_of() -> ModelProfile:
    from pipeplan.executor.model import ModelSource
    from pipeplan.models import profiler

    built, example = ModelSource("gpt", 16, seed=0, options=GPT).build()
    return profiler.profile_model(built, example, name="gpt", device_type=None)


def first_plan(prof: ModelProfile, spec: ClusterSpec) -> Plan:
    from pipeplan.agents.problem import Objective, Problem
    from pipeplan.agents.registry import make_planner

    problem = Problem(prof, spec, Objective.TIME, BATCH, Schedule.ONE_F_ONE_B)
    return make_planner("dp").plan(problem).plan


def train_config(a: argparse.Namespace, folder: Path, resume: Path | None = None) -> TrainConfig:
    from pipeplan.executor.config import OptimizerConfig, TrainConfig

    return TrainConfig(
        steps=a.steps,
        optimizer=OptimizerConfig("sgd", lr=0.05),
        seed=1,
        checkpoint_dir=folder,
        checkpoint_every=a.checkpoint_every,
        resume=resume,
        deterministic=True,
        timeout_s=60,
    )


def killer(cluster: Any, timeline: Timeline, node: str, after: int) -> Any:
    def on_step(step: TrainStep) -> None:
        timeline.record(step)
        if step.step == after - 1 and timeline.killed_at is None:
            timeline.killed_at = time.perf_counter()
            cluster.remove_node(node)

    return on_step


def run_elastic(
    a: argparse.Namespace, spec: ClusterSpec, prof: ModelProfile, plan: Plan, folder: Path
) -> dict[str, Any]:
    from pipeplan.core.objective import Objective
    from pipeplan.executor.elastic import PlannerReplanner, Replanned, elastic_train
    from pipeplan.executor.local_cluster import LocalCluster
    from pipeplan.executor.model import ModelSource

    timeline, events = Timeline(), list[Replanned]()
    model = ModelSource("gpt", 16, seed=0, options=GPT)
    replanner = PlannerReplanner(prof, Objective.TIME, BATCH, plan.schedule)
    with LocalCluster(spec, object_store_mb=STORE_MB) as cluster:
        elastic_train(
            plan,
            model,
            spec,
            train_config(a, folder),
            replanner,
            on_step=killer(cluster, timeline, a.kill, a.kill_after),
            on_replan=events.append,
        )
    (event,) = events
    return {
        **timeline.summary(),
        "steps_lost": event.steps_redone,
        "noticed_s": event.noticed_s,
        "replan_s": event.replan_s,
        "plan_after": event.plan.to_dict(),
        "predicted_after_s": event.predicted_step_s,
        "chosen": event.chosen,
        "dp_predicted_s": event.dp_predicted_step_s,
        "folded_predicted_s": event.folded_predicted_step_s,
        "speed_factors": dict(event.speed_factors),
    }


def run_by_hand(
    a: argparse.Namespace, spec: ClusterSpec, prof: ModelProfile, plan: Plan, folder: Path
) -> dict[str, Any]:
    from pipeplan.core.costmodel import simulate
    from pipeplan.executor import checkpoint
    from pipeplan.executor.errors import ExecutorError
    from pipeplan.executor.local_cluster import LocalCluster
    from pipeplan.executor.model import ModelSource
    from pipeplan.executor.train import train

    timeline = Timeline()
    model = ModelSource("gpt", 16, seed=0, options=GPT)
    left = dataclasses.replace(spec, nodes=tuple(n for n in spec.nodes if n.name != a.kill))
    after_loss = folded(plan, {a.kill})
    with LocalCluster(spec, object_store_mb=STORE_MB) as cluster:
        try:
            train(
                plan,
                model,
                spec,
                train_config(a, folder),
                on_step=killer(cluster, timeline, a.kill, a.kill_after),
            )
            raise RuntimeError("the run survived the loss of its node")
        except ExecutorError:
            failed_at = time.perf_counter()
        resumed = checkpoint.read_manifest(checkpoint.resolve(folder)).step
        train(after_loss, model, spec, train_config(a, folder, folder), on_step=timeline.record)
    assert timeline.killed_at is not None
    return {
        **timeline.summary(),
        "steps_lost": a.kill_after - resumed,
        "noticed_s": failed_at - timeline.killed_at,
        "plan_after": after_loss.to_dict(),
        "predicted_after_s": simulate(after_loss, prof, left).batch_time_s,
    }


def render(rows: list[dict[str, Any]], note: str) -> Table:
    t = table(
        "Elastic training after a lost node (EMULATED local-pipeline)",
        ["run", "mode", "loss -> resumed s", "steps lost", "before samples/s", "after samples/s",
         "after / before", "stages after", "chosen"],
        left=("mode",),
    )  # fmt: skip
    for r in rows:
        ratio = (
            r["after_samples_per_s"] / r["before_samples_per_s"]
            if r["after_samples_per_s"] and r["before_samples_per_s"]
            else None
        )
        t.add_row(
            str(r["run"]), r["mode"], fmt(r["resumed_s"], ".1f"), str(r["steps_lost"]),
            fmt(r["before_samples_per_s"], ".1f"), fmt(r["after_samples_per_s"], ".1f"),
            fmt(ratio, ".2f"), str(len(r["plan_after"]["stages"])), r.get("chosen") or "-",
        )  # fmt: skip
    t.caption = note
    return t


def spread(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, float | None]]:
    """Per mode: the median, the least and the most of ``key`` over the runs."""
    out: dict[str, dict[str, float | None]] = {}
    for mode in MODES:
        xs = [r[key] for r in rows if r["mode"] == mode and r[key] is not None]
        out[mode] = {
            "median": statistics.median(xs) if xs else None,
            "min": min(xs, default=None),
            "max": max(xs, default=None),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="steps in all")
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--kill-after", type=int, default=6, help="steps trained before the kill")
    ap.add_argument("--kill", default="n2", help="the node to kill (not the head, n0)")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error(f"--runs: must be >= 1, got {a.runs}")
    if not 0 < a.kill_after < a.steps:
        ap.error(f"--kill-after: must be in 1..{a.steps - 1}, got {a.kill_after}")
    drive(a)


def drive(a: argparse.Namespace) -> None:
    from rich.console import Console

    from bench.record import BenchRun, display
    from pipeplan.core.cluster import ClusterSpec
    from pipeplan.executor.emulation import EMULATED_NOTE
    from pipeplan.service.tasks.live import quiet_ray_logs

    run = BenchRun("elastic")
    console = Console(width=160)
    spec = ClusterSpec.load(CLUSTER)
    if a.kill not in {n.name for n in spec.nodes[1:]}:
        raise SystemExit(f"--kill: one of {[n.name for n in spec.nodes[1:]]}, got {a.kill!r}")
    quiet_ray_logs()
    prof = profile_of()
    plan = first_plan(prof, spec)
    rows: list[dict[str, Any]] = []
    for k in range(a.runs):
        for mode, fn in (("elastic", run_elastic), ("by hand", run_by_hand)):
            with tempfile.TemporaryDirectory() as tmp:
                row = {"run": k + 1, "mode": mode, **fn(a, spec, prof, plan, Path(tmp) / "ck")}
            rows.append(row)
            console.print(
                f"run {k + 1} {mode}: resumed after {fmt(row['resumed_s'], '.1f')} s, "
                f"{row['steps_lost']} steps lost"
            )
    note = (
        f"{a.steps} steps of a 4-block GPT (batch {BATCH}, 1F1B), a checkpoint every "
        f"{a.checkpoint_every}; node {a.kill} killed after step {a.kill_after}. loss -> "
        "resumed: from the kill to the first step trained after it (by hand: the restart "
        "starts when the error arrives). samples/s: medians, each segment's first step left "
        f"out.\n{EMULATED_NOTE}"
    )
    console.print(render(rows, note))
    payload = {
        "cluster": spec.name,
        "model": {"name": "gpt", "options": GPT, "global_batch": BATCH},
        "plan_before": plan.to_dict(),
        "settings": {
            "steps": a.steps,
            "checkpoint_every": a.checkpoint_every,
            "kill": a.kill,
            "kill_after": a.kill_after,
            "runs": a.runs,
        },
        "rows": rows,
        "summary": {
            key: spread(rows, key)
            for key in ("resumed_s", "before_samples_per_s", "after_samples_per_s")
        },
        "note": note,
    }
    path = run.write(payload, out=Path(a.out) if a.out else None)
    console.print(f"wrote {display(path)}")


if __name__ == "__main__":
    main()
