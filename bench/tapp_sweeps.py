"""TAPP's two sweeps (Mao et al. 2021): batch size and computing power, on the local EMULATED
cluster (``local-pipeline`` by default), planned against BSP and Pipe-Torch.

- **Batch size**: the global batch over ``--batches`` (16 to 128) on the cluster as it is.
- **Computing power**: the global batch ``--power-batch`` on the cluster with its fastest
  type slowed (its flops times each of ``--powers``: 1, 0.75, 0.5). Slowing a type must not
  speed the others up: the emulated slowdown is relative to the fastest type
  (``headroom x fastest flops / flops``), so the headroom is raised by the same factor when
  the fastest type gets slower (:func:`slowed`); every other type keeps its slowdown.

Three ways to train at every point (as in :mod:`bench.tapp_table`): ``Planned`` (the better
of ``dp`` and ``brute`` up to three stages where its space is small enough, by the cost
model), ``BSP`` (one stage replicated
on every device) and ``Pipe-Torch`` (equal layer counts over every device), each with the
microbatch the cost model likes best.

The profile is timed once per model in this process, as a stage worker times it (one torch
thread, CPU time, layers calibrated to the whole model, the training loss with the last
layer, at a quarter of ``--power-batch`` and all of it; :func:`models.profiler.profile_model`),
and each point's timings are derived from it by the point's slowdowns
(:func:`executor.emulation.emulated_timings`). The batch sweep's larger batches extrapolate
that linear fit (fixed + per sample). **Predicted** for every model and point;
**measured** (``--measure MODEL``: warm-up + ``--train-steps`` steps of each plan on one
local cluster, digits data) for that model at the points of ``--measure-points``.

    .venv/bin/python -m bench.tapp_sweeps                      # predicted, 3 models (~2 min)
    .venv/bin/python -m bench.tapp_sweeps --measure alexnet    # + measured AlexNet points

Writes ``bench/results/tapp_sweeps/<UTC date-time>.json`` (:mod:`bench.record`) and beside
it one PNG per sweep (``<UTC date-time>_batch.png``, ``<UTC date-time>_power.png``):
throughput against the swept value, lines predicted, markers measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from rich.console import Console

from bench.common import OUT_HELP, ms, table
from bench.fidelity import describe
from bench.record import BenchRun, display
from bench.tapp_table import CLUSTER, MODELS, OPTIMIZER, pipe_torch
from pipeplan.agents import Budget, Objective, Problem, make_planner
from pipeplan.agents.baselines.every_device import bsp_all
from pipeplan.agents.problem import ProblemError
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.emulation import EMULATED_NOTE, emulated_timings, slowdown
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measure import Measurement
from pipeplan.executor.measured_profile import call_sizes
from pipeplan.executor.model import timing_loss
from pipeplan.executor.pipeline import RunConfig, run
from pipeplan.models.profiler import profile_model

METHODS = ("Planned", "BSP", "Pipe-Torch")
BASE_TYPE = "cpu"
"""The profile's timings on this machine's core, before any emulated slowdown."""
STORE_MB = 1000


def slowed(spec: ClusterSpec, device_type: str, factor: float) -> ClusterSpec:
    """``spec`` with ``device_type``'s flops times ``factor`` and the emulation headroom
    raised so that every other type keeps its emulated slowdown (the slowdown is relative to
    the fastest type's flops, which may be the slowed one)."""
    if not 0 < factor <= 1:
        raise SystemExit(f"--powers: each factor must be in (0, 1], got {factor}")
    doc = spec.to_dict()
    doc["device_types"][device_type]["flops"] *= factor
    new_fastest = max(t["flops"] for t in doc["device_types"].values())
    headroom = spec.emulation_headroom * spec.fastest_flops() / new_fastest
    doc["emulation"] = {**(doc.get("emulation") or {}), "headroom": headroom}
    doc["name"] = f"{spec.name}, {device_type} x{factor:g}"
    return ClusterSpec.from_dict(doc)


def base_profile(key: str, batch: int, repeats: int) -> ModelProfile:
    """The model's layers timed here in CPU time under :data:`BASE_TYPE` (module docstring)."""
    source = MODELS[key].source
    model, example = source.build()
    return profile_model(
        model,
        example,
        source.name,
        BASE_TYPE,
        call_sizes(batch),
        repeats=repeats,
        clock="cpu",
        calibrate=True,
        loss=timing_loss,
    )


def plans_at(profile: ModelProfile, spec: ClusterSpec, batch: int, seed: int) -> dict[str, Plan]:
    """Each method's plan for one point (module docstring); ``brute`` is left out where its
    space passes its budget (Inception-V3's 313 layers)."""
    problem = Problem(
        profile, spec, Objective.TIME, batch, seed=seed,
        budget=Budget(evaluations=2_000_000, seconds=60.0),
    )  # fmt: skip
    planned = [make_planner("dp").plan(problem)]
    with contextlib.suppress(ProblemError):
        planned.append(make_planner("brute", max_stages=3).plan(problem))
    return {
        "Planned": min(planned, key=lambda r: r.estimate.batch_time_s).plan,
        "BSP": bsp_all(problem),
        "Pipe-Torch": pipe_torch(profile, spec, batch),
    }


def point(
    sweep: str, x: float, spec: ClusterSpec, batch: int, base: ModelProfile, seed: int
) -> dict[str, Any]:
    """One point of a sweep, predicted: each method's plan and batch time."""
    profile = emulated_timings(base, spec, BASE_TYPE)
    plans = plans_at(profile, spec, batch, seed)
    rows = {}
    for method, plan in plans.items():
        est = simulate(plan, profile, spec)
        rows[method] = {
            "plan": plan.to_dict(),
            "describe": describe(plan),
            "stages": len(plan.stages),
            "predicted_s": est.batch_time_s,
            "predicted_throughput": batch / est.batch_time_s,
            "measured_s": None,
            "measured_std_s": None,
            "measured_throughput": None,
            "error": "",
        }
    return {"sweep": sweep, "x": x, "batch": batch, "cluster": spec.to_dict(), "rows": rows}


def measure_point(
    doc: dict[str, Any],
    key: str,
    steps: int,
    seed: int,
    done: dict[str, Measurement],
    console: Any,
) -> None:
    """Run each method's plan of a point on the live cluster; fills the measured fields. A
    plan already run on the same emulated cluster (``done``, by plan and cluster; the power
    sweep's factor 1 is a point of the batch sweep) is not run again."""
    spec = ClusterSpec.from_dict(doc["cluster"])
    config = RunConfig(
        steps=steps, warmup=1, optimizer=OPTIMIZER, data="digits", seed=seed, timeout_s=600
    )
    emulated = json.dumps({t: slowdown(spec, t) for t in sorted(spec.device_types)})
    for method, r in doc["rows"].items():
        plan = Plan.from_dict(r["plan"])
        same = json.dumps(r["plan"], sort_keys=True) + emulated
        t0 = time.perf_counter()
        try:
            m = done[same] if same in done else run(plan, MODELS[key].source, spec, config)
        except Exception as e:  # a failed plan is a point with its error
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            console.print(f"  {method}: ERROR {r['error']}")
            continue
        done[same] = m
        r["measured_s"], r["measured_std_s"] = m.batch_time_s, m.batch_time_std_s
        r["measured_throughput"] = doc["batch"] / m.batch_time_s
        console.print(
            f"  {doc['sweep']} {doc['x']:g} {method:<10} {r['describe']:<70} "
            f"{m.batch_time_s * 1e3:.0f} ms (predicted {r['predicted_s'] * 1e3:.0f}; "
            f"{time.perf_counter() - t0:.0f} s)"
        )


def print_sweep(docs: dict[str, list[dict[str, Any]]], sweep: str, label: str, c: Any) -> None:
    t = table(
        f"TAPP sweep: {label} (batch time ms, predicted / measured; EMULATED)",
        ("model", label, *METHODS, "Planned vs BSP", "Planned stages"),
        left=("model",),
    )
    for model, points in docs.items():
        for p in (p for p in points if p["sweep"] == sweep):
            r = p["rows"]
            cells = [f"{ms(r[m]['predicted_s'])} / {ms(r[m]['measured_s'])}" for m in METHODS]
            pb, pp = r["BSP"], r["Planned"]
            pred = pb["predicted_s"] / pp["predicted_s"]
            meas = (
                f"{pb['measured_s'] / pp['measured_s']:.2f}x"
                if pb["measured_s"] and pp["measured_s"]
                else "-"
            )
            t.add_row(model, f"{p['x']:g}", *cells, f"{pred:.2f}x / {meas}", str(pp["stages"]))
        t.add_section()
    c.print(t)


def plot_sweep(docs: dict[str, list[dict[str, Any]]], sweep: str, label: str, path: Path) -> None:
    """Throughput against the swept value, one panel per model: lines predicted, markers
    measured."""
    fig = Figure(figsize=(4.2 * len(docs), 3.6))
    for i, (model, points) in enumerate(docs.items()):
        ax = fig.add_subplot(1, len(docs), i + 1)
        pts = [p for p in points if p["sweep"] == sweep]
        xs = [p["x"] for p in pts]
        for j, m in enumerate(METHODS):
            color = f"C{j}"
            ax.plot(xs, [p["rows"][m]["predicted_throughput"] for p in pts], "-", color=color,
                    label=f"{m} (predicted)")  # fmt: skip
            meas = [(p["x"], p["rows"][m]["measured_throughput"]) for p in pts]
            meas = [(x, y) for x, y in meas if y is not None]
            if meas:
                ax.plot(*zip(*meas, strict=True), "o", color=color, label=f"{m} (measured)")
        ax.set_title(model, fontsize=9)
        ax.set_xlabel(label)
        ax.set_ylabel("samples/s (EMULATED)")
        if sweep == "batch":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--cluster", default=str(CLUSTER))
    ap.add_argument("--batches", default="16,32,64,128", help="the batch sweep's global batches")
    ap.add_argument("--powers", default="1,0.75,0.5", help="the fastest type's flops factors")
    ap.add_argument("--power-batch", type=int, default=32, help="the power sweep's batch")
    ap.add_argument("--repeats", type=int, default=3, help="profiler repeats per layer")
    ap.add_argument("--measure", default="", help="a model to measure (default: none)")
    ap.add_argument(
        "--measure-points",
        default="all",
        help="'all' or sweep:x pairs to measure, e.g. batch:32,batch:64,power:0.5",
    )
    ap.add_argument("--train-steps", type=int, default=3, help="measured steps per plan")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help=OUT_HELP)
    a = ap.parse_args()
    bench = BenchRun("tapp_sweeps")
    models = a.models.split(",")
    unknown = [m for m in [*models, *([a.measure] if a.measure else [])] if m not in MODELS]
    if unknown:
        ap.error(f"--models/--measure: unknown {unknown} (known: {', '.join(MODELS)})")
    if a.measure and a.measure not in models:
        ap.error(f"--measure: {a.measure!r} is not among --models")
    batches = [int(b) for b in a.batches.split(",")]
    powers = [float(p) for p in a.powers.split(",")]
    spec = ClusterSpec.load(a.cluster)
    fastest = max(spec.counts_by_type(), key=lambda t: spec.device_types[t].flops)
    torch.set_num_threads(1)  # as a stage worker times its layers
    console = Console(width=170)
    console.print(f"[bold]{EMULATED_NOTE}[/bold]")
    t0 = time.perf_counter()
    docs: dict[str, list[dict[str, Any]]] = {}
    for key in models:
        t1 = time.perf_counter()
        base = base_profile(key, a.power_batch, a.repeats)
        label = MODELS[key].label
        console.print(f"{label}: profile timed in {time.perf_counter() - t1:.0f} s")
        pts = [point("batch", b, spec, b, base, a.seed) for b in batches]
        pts += [
            point("power", f, slowed(spec, fastest, f), a.power_batch, base, a.seed) for f in powers
        ]
        docs[label] = pts
    predicted_s = time.perf_counter() - t0
    measured_points: list[str] = []
    if a.measure:
        wanted = None if a.measure_points == "all" else set(a.measure_points.split(","))
        label = MODELS[a.measure].label
        with LocalCluster(spec, object_store_mb=STORE_MB) as cluster:
            console.print(f"cluster {spec.name} up in {cluster.startup_s:.1f} s")
            done: dict[str, Measurement] = {}
            for p in docs[label]:
                name = f"{p['sweep']}:{p['x']:g}"
                if wanted is None or name in wanted:
                    measure_point(p, a.measure, a.train_steps, a.seed, done, console)
                    measured_points.append(name)
    for sweep, what in (("batch", "global batch"), ("power", f"{fastest} flops x")):
        print_sweep(docs, sweep, what, console)
    out = Path(a.out) if a.out else bench.path()
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for sweep, what in (("batch", "global batch"), ("power", f"{fastest} flops x")):
        pngs[sweep] = out.with_name(f"{out.stem}_{sweep}.png")
        plot_sweep(docs, sweep, what, pngs[sweep])
    wall = time.perf_counter() - t0
    doc = {
        "note": EMULATED_NOTE,
        "cluster": spec.to_dict(),
        "config": {
            "batches": batches,
            "powers": powers,
            "slowed_type": fastest,
            "power_batch": a.power_batch,
            "profile_batch_sizes": list(call_sizes(a.power_batch)),
            "profile_repeats": a.repeats,
            "planned": "best of dp and brute (max_stages=3, where its space fits its budget)",
            "measured_model": a.measure or None,
            "measured_points": measured_points,
            "train_steps": a.train_steps,
            "warmup": 1,
            "data": "digits",
        },
        "predicted_s": predicted_s,
        "wall_s": wall,
        "models": docs,
    }
    bench.write(doc, out=out, indent=1)
    wrote = ", ".join(display(p) for p in (out, pngs["batch"], pngs["power"]))
    console.print(f"wall {wall / 60:.1f} min; wrote {wrote}")


if __name__ == "__main__":
    main()
