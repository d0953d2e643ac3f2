"""``pipeplan`` command line: profile, simulate, validate (plan/compare: ``plan_cmd``;
run, cluster, demo: ``run_cmd``).

Every error is one line on stderr and a non-zero exit code; no tracebacks.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from enum import StrEnum
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from core._io import read_document
from core.cluster import ClusterSpec
from core.errors import FormatError, PipeplanError
from core.plan import Plan, Schedule, Stage, uniform_stages
from core.profile import LayerTiming, ModelProfile
from executor.errors import ExecutorError
from service.plan_cmd import register as _register_plan_commands
from service.run_cmd import register as _register_run_commands

app = typer.Typer(
    name="pipeplan",
    help="Plan and run pipeline-parallel DNN training on heterogeneous clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)


def out() -> Console:
    """stdout; a wide page when piped, so tables are not squeezed to 80 columns."""
    return Console(width=None if sys.stdout.isatty() else 160)


F = TypeVar("F", bound=Callable[..., Any])


class CliError(Exception):
    """An error to show as one line."""


def clean_errors(fn: F) -> F:
    """Turn domain, I/O and cluster errors into one line on stderr and exit code 2 (a
    failed stage's worker traceback only with ``PIPEPLAN_DEBUG=1``)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (PipeplanError, CliError, OSError) as e:
            err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except ExecutorError as e:
            text = str(e) if os.environ.get("PIPEPLAN_DEBUG") else _first_line(str(e))
            err.print(f"error: {text}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    if len(lines) <= 1:
        return text.strip()
    return f"{lines[0]} (set PIPEPLAN_DEBUG=1 for the rest)"


def load_cluster(path: Path | str) -> ClusterSpec:
    """A cluster file, or the name of a preset in examples/clusters."""
    p = Path(path)
    if not p.exists() and p.suffix == "":
        preset = Path(__file__).resolve().parents[1] / "examples" / "clusters" / f"{p}.yaml"
        if preset.exists():
            p = preset
    return ClusterSpec.load(p)


# --- profile ----------------------------------------------------------------------------------


@app.command()
@clean_errors
def profile(
    model: Annotated[str | None, typer.Argument(help="zoo model name (see --list)")] = None,
    input_size: Annotated[int | None, typer.Option(help="input height/width (or tokens)")] = None,
    device_type: Annotated[
        str | None,
        typer.Option(help="measure layer times on this machine under this device-type name"),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            help="measure here and derive timings for every device type of this EMULATED "
            "cluster by its slowdown (fastest flops / type flops)"
        ),
    ] = None,
    pipedream: Annotated[Path | None, typer.Option(help="import a PipeDream graph.txt")] = None,
    batch_size: Annotated[
        int | None, typer.Option(help="minibatch the PipeDream profile was taken at")
    ] = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="with --cluster: start that cluster and time every layer on each of its "
            "device types through actors pinned to them (emulated types include the slowdown)",
        ),
    ] = False,
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="with --measure: a running Ray cluster (HOST:PORT, or 'auto' for `pipeplan "
            "cluster up`'s) instead of starting one",
        ),
    ] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output")] = None,
    text: Annotated[bool, typer.Option("--text", help="print TAPP's text library")] = False,
    list_models: Annotated[bool, typer.Option("--list", help="list zoo models")] = False,
) -> None:
    """Profile a zoo model (or import a PipeDream profile) into profile.json."""
    from models import zoo

    if list_models:
        typer.echo("\n".join(zoo.MODELS))
        return
    if measure or address is not None:
        prof = _measure_zoo(model, input_size, device_type, cluster, pipedream, measure, address)
    elif pipedream is not None:
        prof = _import_pipedream(pipedream, batch_size, device_type, model)
    elif model is None:
        raise CliError(
            f"profile: give a MODEL name (one of {', '.join(zoo.MODELS)}) or --pipedream FILE"
        )
    else:
        prof = _profile_zoo(model, input_size, device_type, cluster)
    if output is not None:
        prof.save(output)
        err.print(
            f"wrote {output}: {len(prof)} layers, {prof.params_bytes / 1e6:.2f} MB "
            f"params, {prof.flops / 1e9:.3f} GFLOPs/sample, timings for "
            f"{', '.join(prof.device_types) or 'no device type (analytic)'}"
        )
    if text or output is None:
        typer.echo(prof.text_library())


def _measure_zoo(
    model: str | None,
    input_size: int | None,
    device_type: str | None,
    cluster: str | None,
    pipedream: Path | None,
    measure: bool,
    address: str | None,
) -> ModelProfile:
    from service.run_cmd import measured_profile

    if not measure:
        raise CliError("--address: only applies with --measure")
    if model is None or pipedream is not None:
        raise CliError("--measure: give a zoo MODEL name (not --pipedream)")
    if device_type is not None:
        raise CliError("--device-type: not with --measure (every type of --cluster is timed)")
    if cluster is None and address is None:
        raise CliError("--measure: needs --cluster C (the cluster to start and time on)")
    return measured_profile(model, input_size, cluster, address)


def _import_pipedream(
    path: Path, batch_size: int | None, device_type: str | None, name: str | None
) -> ModelProfile:
    from core.formats.pipedream import load_pipedream

    if batch_size is None:
        raise CliError("--batch-size: required with --pipedream (the minibatch it was taken at)")
    if not device_type:
        raise CliError("--device-type: required with --pipedream (the GPU it was taken on)")
    return load_pipedream(path, batch_size, device_type, name=name)


def _profile_zoo(
    model: str, input_size: int | None, device_type: str | None, cluster_path: str | None
) -> ModelProfile:
    from executor.model import timing_loss
    from models import profiler, zoo

    module, example = zoo.build(model, input_size)
    spec = load_cluster(cluster_path) if cluster_path else None
    measure_as = device_type
    if spec is not None and measure_as is None:
        fastest = max(spec.counts_by_type(), key=lambda t: spec.device_types[t].flops)
        measure_as = fastest
    # Emulated types last slowdown x the CPU time of each compute (executor.stage): time the
    # profile of an emulated cluster in CPU time too, calibrated to the whole model, as
    # executor.profiling.measure_profile does. The last layer carries the training loss.
    clock: profiler.Clock = "cpu" if spec is not None else "wall"
    with err.status(f"profiling {model}" + (f" (timing as {measure_as})" if measure_as else "")):
        prof = profiler.profile_model(
            module,
            example,
            name=model,
            device_type=measure_as,
            clock=clock,
            calibrate=spec is not None,
            loss=timing_loss,
        )
    if spec is not None and measure_as is not None:
        prof = emulated_timings(prof, spec, measure_as)
        err.print(
            f"note: timings for {', '.join(sorted(spec.counts_by_type()))} are EMULATED: "
            f"measured here as {measure_as} (CPU time) and scaled by each type's slowdown"
        )
    return prof


def emulated_timings(prof: ModelProfile, spec: ClusterSpec, measured: str) -> ModelProfile:
    """Derive timings for every device type of an emulated cluster from one measured type."""
    base = (
        spec.device_types[measured].flops if measured in spec.device_types else spec.fastest_flops()
    )
    for t in sorted(spec.counts_by_type()):
        k = spec.emulation_headroom * base / spec.device_types[t].flops
        timings = [_scaled(layer.timings[measured], k) for layer in prof.layers]
        prof = prof.with_timings(t, timings)
    return prof


def _scaled(t: LayerTiming, k: float) -> LayerTiming:
    return LayerTiming(t.fwd_s * k, t.bwd_s * k, t.fwd_fixed_s * k, t.bwd_fixed_s * k)


# --- simulate ---------------------------------------------------------------------------------


@app.command()
@clean_errors
def simulate(
    profile: Annotated[Path, typer.Option("--profile", help="profile.json")],
    cluster: Annotated[str, typer.Option("--cluster", help="cluster.yaml or a preset name")],
    plan: Annotated[Path | None, typer.Option("--plan", help="plan.json")] = None,
    uniform: Annotated[
        int | None,
        typer.Option(help="instead of --plan: equal layer counts over the first N devices"),
    ] = None,
    batch: Annotated[int, typer.Option(help="global batch for --uniform")] = 64,
    microbatches: Annotated[int, typer.Option(help="microbatches for --uniform")] = 8,
    schedule: Annotated[Schedule, typer.Option(help="schedule for --uniform")] = Schedule.GPIPE,
    as_json: Annotated[bool, typer.Option("--json", help="print the Estimate as JSON")] = False,
    gantt: Annotated[Path | None, typer.Option(help="draw the schedule to this PNG")] = None,
    save_plan: Annotated[Path | None, typer.Option(help="write the --uniform plan here")] = None,
) -> None:
    """Cost a plan with the cost model: per-stage table, totals, optional Gantt chart."""
    from core.costmodel import simulate as run_simulation

    prof, spec = ModelProfile.load(profile), load_cluster(cluster)
    if (plan is None) == (uniform is None):
        raise CliError("simulate: give exactly one of --plan FILE or --uniform N")
    the_plan = (
        Plan.load(plan)
        if plan is not None
        else uniform_plan(prof, spec, uniform or 0, batch, microbatches, schedule)
    )
    if save_plan is not None:
        the_plan.save(save_plan)
    est = run_simulation(the_plan, prof, spec)
    if gantt is not None:
        from service.gantt import draw_gantt

        draw_gantt(
            est,
            gantt,
            title=f"{prof.name} on {spec.name}: "
            f"{est.batch_time_s * 1e3:.2f} ms per batch (cost model)",
        )
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
        return
    from service.render import estimate_table, totals_lines

    out().print(estimate_table(est, f"{prof.name} on {spec.name} (cost model)"))
    for line in totals_lines(est):
        typer.echo(line)
    if gantt is not None:
        typer.echo(f"Gantt chart: {gantt}")


def uniform_plan(
    prof: ModelProfile, spec: ClusterSpec, n: int, batch: int, microbatches: int, schedule: Schedule
) -> Plan:
    """GPipe's default: equal layer counts on the first ``n`` devices, equal microbatches."""
    ids = spec.device_ids
    if not 1 <= n <= min(len(ids), len(prof)):
        raise CliError(
            f"--uniform: must be in [1, {min(len(ids), len(prof))}] for "
            f"{len(ids)} devices and {len(prof)} layers, got {n}"
        )
    if microbatches < 1 or batch % microbatches:
        raise CliError(f"--microbatches: {microbatches} does not divide --batch {batch}")
    mb = batch // microbatches
    stages = tuple(Stage(r, (ids[k],), mb) for k, r in enumerate(uniform_stages(len(prof), n)))
    return Plan(batch, stages, schedule)


# --- validate ---------------------------------------------------------------------------------


class Kind(StrEnum):
    auto = "auto"
    profile = "profile"
    cluster = "cluster"
    plan = "plan"


@app.command()
@clean_errors
def validate(
    file: Annotated[Path, typer.Argument(help="a profile, cluster or plan file")],
    kind: Annotated[Kind, typer.Option(help="what the file is")] = Kind.auto,
    profile: Annotated[Path | None, typer.Option(help="check a plan against this")] = None,
    cluster: Annotated[str | None, typer.Option(help="check a plan against this")] = None,
) -> None:
    """Check a profile, cluster or plan file; with --profile/--cluster, a plan against them."""
    doc = read_document(file)
    k = _detect(doc) if kind is Kind.auto else kind
    if k is Kind.profile:
        p = ModelProfile.from_dict(doc)
        summary = (
            f"profile {p.name!r}: {len(p)} layers, timings for "
            f"{', '.join(p.device_types) or 'none (analytic)'}"
        )
    elif k is Kind.cluster:
        c = ClusterSpec.from_dict(doc)
        summary = (
            f"cluster {c.name!r}: {len(c.nodes)} nodes, {len(c.device_ids)} devices "
            f"({', '.join(f'{n} {t}' for t, n in c.counts_by_type().items())})"
        )
    else:
        plan = Plan.from_dict(doc)
        plan.validate(
            ModelProfile.load(profile) if profile else None,
            load_cluster(cluster) if cluster else None,
        )
        summary = (
            f"plan: {plan.num_stages} stages, {len(plan.devices)} devices, batch "
            f"{plan.global_batch}, {plan.schedule.value}"
        )
    typer.echo(f"ok: {file}: {summary}")


def _detect(doc: Any) -> Kind:
    if isinstance(doc, dict):
        if "device_types" in doc or "nodes" in doc:
            return Kind.cluster
        if "stages" in doc or "global_batch" in doc:
            return Kind.plan
        if "layers" in doc:
            return Kind.profile
    raise FormatError(
        "cannot tell the kind of file: expected a profile (layers), a cluster "
        "(device_types, nodes) or a plan (global_batch, stages); use --kind"
    )


_register_plan_commands(app)
_register_run_commands(app)


def main() -> None:
    """Console entry point: usage errors are one line too."""
    try:  # typer >= 0.2x vendors click; older typer uses click itself
        from typer._click import exceptions as cx
    except ImportError:  # pragma: no cover
        from click import exceptions as cx  # type: ignore[no-redef]
    args = sys.argv[1:] or ["--help"]
    try:
        rv = app(args, standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except cx.ClickException as e:
        err.print(f"error: {e.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except Exception as e:  # a bug, not bad input: still one line unless asked for more
        if os.environ.get("PIPEPLAN_DEBUG"):
            raise
        err.print(
            f"internal error: {type(e).__name__}: {e} (set PIPEPLAN_DEBUG=1 for the traceback)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(3)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
