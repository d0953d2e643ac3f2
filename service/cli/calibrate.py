"""``pipeplan calibrate``: fit the cluster's calibration from probe plans run on it, print
the errors before and after on the probes the fit did not see, write the calibrated spec."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pipeplan.core._io import read_document
from pipeplan.service.cli.console import (
    ConsoleReporter,
    clean_errors,
    cluster_ref,
    document,
    echo_json,
    out,
)
from pipeplan.service.render_runs import describe_plan
from pipeplan.service.tasks.calibrate import CalibrateRequest, CalibrationReport, calibrate


@clean_errors
def calibrate_command(
    cluster: Annotated[
        str,
        typer.Option(
            "--cluster",
            help="cluster.yaml or a preset name: the cluster to start (or the "
            "spec of the --address cluster) and to calibrate",
        ),
    ],
    out_path: Annotated[
        Path | None,
        typer.Option(
            "--out", help="where to write the calibrated spec (default: NAME.calibrated.yaml)"
        ),
    ] = None,
    model: Annotated[str, typer.Option(help="zoo model the probe plans train")] = "alexnet",
    input_size: Annotated[
        int | None, typer.Option(help="its input height/width (default: the zoo's)")
    ] = None,
    batch: Annotated[int, typer.Option(help="global batch of the probe plans")] = 32,
    steps: Annotated[int, typer.Option(help="measured steps per probe")] = 3,
    warmup: Annotated[int, typer.Option(help="steps run first and not timed")] = 1,
    seed: Annotated[int, typer.Option(help="seed of the weights and the data")] = 0,
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="calibrate a running Ray cluster: HOST:PORT, or 'auto' for the one "
            "`pipeplan cluster up` started",
        ),
    ] = None,
    runs: Annotated[
        list[Path] | None,
        typer.Option(
            "--runs",
            help="fit to runs already measured (`pipeplan run --json` outputs; repeat the "
            "flag) instead of running probes; needs --profile",
        ),
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option("--profile", help="with --runs: the profile.json they are predicted from"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Fit link latency and bandwidth, per-type compute scale and call overheads and a
    per-step overhead from probe plans run for real; write the spec with the calibration
    the cost model then uses."""
    request = CalibrateRequest(
        cluster=cluster_ref(cluster),
        runs=[read_document(p) for p in runs] if runs else None,
        profile=document(profile),
        model=model,
        input_size=input_size,
        batch=batch,
        steps=steps,
        warmup=warmup,
        seed=seed,
        address=address,
    )
    report = calibrate(request, ConsoleReporter())
    target = out_path or Path(f"{report.cluster.name}.calibrated.yaml")
    report.cluster.save(target)
    if as_json:
        echo_json(report.to_dict() | {"written": str(target)})
        return
    out().print(probe_table(report))
    for line in summary_lines(report):
        typer.echo(line)
    typer.echo(f"wrote {target}")


def probe_table(report: CalibrationReport) -> Table:
    """Each probe: measured, and the error before and after (held-out fit for held-out ones)."""
    table = Table(title=f"calibration probes ({report.model})")
    for column in ("plan", "set", "measured ms", "error before", "error after"):
        table.add_column(column, justify="left" if column in ("plan", "set") else "right")
    for p, before, after in zip(
        report.probes, report.before, report.after_held_out_fit, strict=True
    ):
        table.add_row(
            f"{p.plan.schedule.value} {describe_plan(p.plan)}",
            "held out" if p.held_out else "fit",
            f"{p.batch_time_s * 1e3:.1f}",
            f"{before:+.1%}",
            f"{after:+.1%}",
        )
    return table


def summary_lines(report: CalibrationReport) -> list[str]:
    s = report.summary()
    cal = report.cluster.calibration
    lines = [
        f"held-out plans ({s['held_out_plans']:.0f}): median |error| "
        f"{s['held_out_median_abs_error_before']:.1%} before, "
        f"{s['held_out_median_abs_error_after']:.1%} after; worst "
        f"{s['held_out_max_abs_error_before']:.1%} before, "
        f"{s['held_out_max_abs_error_after']:.1%} after",
    ]
    if cal is not None:
        for t in sorted(set(cal.compute_scale) | set(cal.call_overhead)):
            o = cal.overhead(t)
            lines.append(
                f"  {t}: compute x{cal.scale(t):.3f}, call overhead fwd "
                f"{o.fwd_s * 1e3:.2f} ms, bwd {o.bwd_s * 1e3:.2f} ms"
                + (
                    f", update {cal.memory_bandwidth_gbps[t]:.3g} GB/s "
                    f"(spec {report.cluster.device_types[t].memory_bandwidth_gbps:.3g})"
                    if t in cal.memory_bandwidth_gbps
                    else ""
                )
            )
        for what, links in (("sends", cal.network), ("all-reduce rounds", cal.all_reduce)):
            for name, (bw, lat) in sorted(links.items()):
                lines.append(f"  {name} {what}: {bw:.3g} Gbit/s, {lat / 1e3:.2f} ms")
        for key, factor in sorted(cal.model_scale.items()):
            lines.append(f"  model {key}: compute x{factor:.3f}")
        lines.append(f"  step overhead {cal.step_overhead_s * 1e3:.2f} ms")
    if report.emulated:
        lines.append("EMULATED: every device is this machine's CPU")
    return lines


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_command)
