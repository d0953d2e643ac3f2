"""Idle cores and emulation: CPU time of pipeline operations back to back, with pauses (as an
emulated device sleeps between them), and with pauses while
:class:`executor.local.keep_awake.KeepAwake` keeps the cores busy at idle priority.

One process, no Ray: the GPT of ``bench.fidelity`` as one stage (real
:class:`executor.stage.StageWorker` code, its operations called one by one so that a pause
can go between them), GPipe order, 4 microbatches of 4. Each row is the median CPU time of
every forward and backward over the profile's prediction for it: a
profile timed back to back, and one whose whole-model calls each start after the same pause
(``profile_model(pause_s=...)``, what :func:`executor.measured_profile.measure_profile` does
for an emulated cluster), both taken in the row's conditions (``KeepAwake`` or not).

    .venv/bin/python -m bench.idle_slowdown     # ~1 min
Writes ``bench/results/idle_slowdown/<UTC date-time>.json`` (:mod:`bench.record`; figures:
the README's Benchmarks). Noisy on a shared machine: each case profiles afresh.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import MODELS, table
from bench.record import BenchRun, display
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.local.keep_awake import KeepAwake
from pipeplan.executor.model import OptimizerConfig, timing_loss
from pipeplan.executor.partition import count_layers, partition
from pipeplan.executor.pipeline import RunConfig, make_batches
from pipeplan.executor.stage import Failure, StageWorker, WorkerSpec
from pipeplan.models.profiler import profile_model

MICRO, COUNT = 4, 4


def checked(record: Any) -> Any:
    """A stage operation's record; a failed operation (a :class:`executor.stage.Failure`)
    raises as the pipeline driver does, with its traceback."""
    if isinstance(record, Failure):
        raise record.error("idle_slowdown")
    return record


def run(pause_s: float, steps: int) -> dict[str, list[float]]:
    """CPU time over each profile's prediction (timed back to back, and with ``pause_s``
    before each whole-model call), per operation (steps after two warm-ups)."""
    case = MODELS["gpt"]
    model, example = case.source.build()
    torch.set_num_threads(1)
    profiles = {
        f"{pause:g} s": profile_model(
            model, example, "gpt", "cpu", (4, 32), 2, 5, "cpu", True, timing_loss, pause
        )
        for pause in dict.fromkeys((0.0, pause_s))
    }
    batch = MICRO * COUNT
    bounds = (0, count_layers(model))
    spec = WorkerSpec(
        0, 0, "n0/cpu:0", "n0", bounds, batch, case.source, OptimizerConfig(),
        microbatches=COUNT, shape=((MICRO, 1),),
    )  # fmt: skip
    worker = StageWorker(spec)
    name = partition(model, example, bounds).model_inputs[0]

    def predicted(prof: ModelProfile, kind: str) -> float:
        t = [prof.layers[i].timings["cpu"] for i in range(*bounds)]
        return sum(x.forward(MICRO) if kind == "F" else x.backward(MICRO) for x in t)

    ratios: dict[str, list[float]] = {k: [] for k in profiles}
    for step, (x, y) in enumerate(make_batches(case.source, batch, steps + 2, RunConfig())):
        worker.begin_step()
        losses: dict[str, Any] = {"loss_sum": 0.0, "predictions": 0, "correct": 0}
        forwards = []
        for j in range(COUNT):
            forwards.append(worker._forward(step, j, {name: x.numpy()}, y.numpy(), losses))
            time.sleep(pause_s)
        for j in range(COUNT):
            backward = worker._backward(step, j)
            time.sleep(pause_s)
            if step < 2:
                continue
            for key, prof in profiles.items():
                ratios[key] += [
                    forwards[j].cpu_s / predicted(prof, "F"),
                    backward.cpu_s / predicted(prof, "B"),
                ]
        worker._update(step)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pause-ms", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    bench = BenchRun("idle_slowdown")
    from rich.console import Console

    rows = []
    for label, pause, awake in (
        ("back to back", 0.0, False),
        (f"{a.pause_ms:.0f} ms pauses", a.pause_ms / 1e3, False),
        (f"{a.pause_ms:.0f} ms pauses, KeepAwake", a.pause_ms / 1e3, True),
    ):
        spinners = KeepAwake() if awake else None
        if spinners:
            spinners.start()
        try:
            ratios = run(pause, a.steps)
        finally:
            if spinners:
                spinners.stop()
        back, paused = ratios[f"{0.0:g} s"], ratios[f"{pause:g} s"]
        rows.append({"case": label, "median_cpu_over_profile": statistics.median(back),
                     "median_cpu_over_paused_profile": statistics.median(paused),
                     "ops": len(back)})  # fmt: skip
    columns = ("case", "over the back-to-back profile", "over the paused profile", "ops")
    t = table("GPT stage operations: CPU time / profiled CPU time", columns, left=columns)
    for r in rows:
        t.add_row(
            str(r["case"]),
            f"{r['median_cpu_over_profile']:.2f}x",
            f"{r['median_cpu_over_paused_profile']:.2f}x",
            str(r["ops"]),
        )
    Console().print(t)
    out = bench.write({"pause_ms": a.pause_ms, "rows": rows}, indent=1)
    print(f"wrote {display(out)}")


if __name__ == "__main__":
    main()
