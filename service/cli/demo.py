"""``pipeplan demo`` (what ``make demo`` runs): the whole main job on one emulated cluster
(:mod:`service.tasks.demo`), its table, and its files under ``--out``: ``demo.json``, the
measured profile, every plan under ``plans/`` and the Gantt chart of the best planned plan,
``best.gantt.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.executor.emulation import EMULATED_NOTE
from pipeplan.service.cli.console import ConsoleReporter, clean_errors, cluster_ref, out, say
from pipeplan.service.gantt import draw_gantt
from pipeplan.service.render_runs import demo_table
from pipeplan.service.tasks.demo import REFERENCE, SINGLE, Demo, DemoRequest, demo

OutOpt = Annotated[Path, typer.Option("--out", help="where to write the results")]


def write_files(done: Demo, out_dir: Path) -> Path | None:
    """The demo's files (module docstring); the Gantt chart's path, if there is a best plan."""
    (out_dir / "plans").mkdir(parents=True, exist_ok=True)
    profile = done.problem.profile
    profile.save(out_dir / f"{profile.name}.profile.json")
    for r in done.rows:
        if r.result is not None:
            r.result.plan.save(out_dir / "plans" / f"{r.planner}.plan.json")
    (out_dir / "demo.json").write_text(json.dumps(done.to_dict(), indent=2))
    best = done.best
    if best is None or best.result is None:
        return None
    gantt = out_dir / "best.gantt.png"
    est = best.result.estimate
    draw_gantt(
        est,
        gantt,
        title=f"{profile.name} on {done.problem.cluster.name}, best plan ({best.planner}): "
        f"{est.batch_time_s * 1e3:.1f} ms per batch (cost model)",
    )
    return gantt


def speedup_line(done: Demo) -> str:
    """The best planned plan's measured speed-ups over the best single device and BSP."""
    best = done.best
    if best is None or best.result is None:
        return "no planned plan"
    parts = []
    for label in (SINGLE, REFERENCE):
        x = done.speedup(label)
        parts.append(f"{'-' if x is None else format(x, '.2f')}x faster than {label}")
    stages = len(best.result.plan.stages)
    return (
        f"best planned plan ({best.planner}, {stages} stage{'s' if stages > 1 else ''}), "
        f"measured: {', '.join(parts)}" + (" (EMULATED)" if done.emulated else "")
    )


def fidelity_line(done: Demo) -> str:
    """How well the cost model predicted this run, and whether it was calibrated."""
    f = done.fidelity()
    if f["median_abs_error"] is None:
        return "cost model: nothing measured"
    fit = f["calibration_fit"] or {}
    probes = f["calibrated_by_demo_probes"]
    if probes:
        how = f"calibrated to this demo's {probes} probe runs"
    elif f["calibrated"]:
        how = f"calibrated ({fit.get('runs', '?')} runs, {fit.get('date', 'undated')})"
    else:
        how = "uncalibrated (`pipeplan calibrate --cluster ...` or `--calibrate` fits one)"
    best = f["best_error"]
    return (
        f"cost model {how}: median |error| {f['median_abs_error']:.1%} over {f['plans']} "
        f"measured plans"
        + (" (those not among the probes)" if probes else "")
        + ("" if best is None else f", best plan {best:+.1%}")
    )


@clean_errors
def demo_command(
    model: Annotated[str, typer.Option(help="zoo model to profile, plan and run")] = "alexnet",
    input_size: Annotated[int | None, typer.Option(help="input height/width")] = 224,
    cluster: Annotated[str, typer.Option(help="cluster.yaml or a preset name")] = "local-pipeline",
    batch: Annotated[int, typer.Option(help="global batch")] = 32,
    microbatches: Annotated[
        int | None, typer.Option(help="fix the number of microbatches (default: planners choose)")
    ] = None,
    steps: Annotated[int, typer.Option(help="measured steps per plan")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed steps per plan")] = 1,
    tapp_iterations: Annotated[int, typer.Option(help="TAPP's training iterations")] = 15,
    seed: Annotated[int, typer.Option(help="planner, weights and data seed")] = 0,
    calibrate: Annotated[
        bool,
        typer.Option(
            "--calibrate",
            help="run pipeplan calibrate's probe plans first and plan on the calibrated cluster",
        ),
    ] = False,
    out_dir: OutOpt = Path("build/demo"),
) -> None:
    """The main job: local cluster, measured profile, planners, real runs, table, Gantt."""
    request = DemoRequest(
        model=model, input_size=input_size, cluster=cluster_ref(cluster), batch=batch,
        microbatches=microbatches, steps=steps, warmup=warmup, tapp_iterations=tapp_iterations,
        seed=seed, calibrate=calibrate,
    )  # fmt: skip
    done = demo(request, ConsoleReporter())
    gantt = write_files(done, out_dir)
    if done.emulated:
        typer.echo(EMULATED_NOTE)
    out().print(demo_table(done))
    typer.echo(
        "error = (predicted - measured) / measured; speed-up = measured batch time of "
        f"{REFERENCE} / this plan's; comm = transfer / (transfer + compute), measured"
    )
    for r in done.rows:
        if r.error:
            typer.echo(f"{r.planner}: {r.error}")
    typer.echo(speedup_line(done))
    typer.echo(fidelity_line(done))
    if gantt is not None:
        typer.echo(
            f"Gantt chart of the best plan ({done.best.planner if done.best else '-'}): {gantt}"
        )
    typer.echo(f"results: {out_dir / 'demo.json'}, plans: {out_dir / 'plans'}")
    say(f"demo took {done.seconds:.0f} s")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
