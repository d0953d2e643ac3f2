"""Running plans for real: ``pipeplan run``, ``pipeplan cluster up|down|status``, and the
measured halves of ``profile --measure`` and ``plan --planner tapp --reward measured``.

Where a command runs: by default it starts a :class:`~executor.cluster.LocalCluster` for the
spec given with ``--cluster`` and stops it when done (~15 s to start on this machine);
``--address HOST:PORT`` joins a running Ray cluster instead, and ``--address auto`` the one
``pipeplan cluster up`` started (its state lives in ``$XDG_CACHE_HOME/pipeplan/cluster``,
``~/.cache/pipeplan/cluster`` by default, with the spec it was started from). On a joined
cluster ``--cluster`` still names the spec the plan was made for (its device types' flops set
the emulated slowdowns); without it the spec saved by ``cluster up`` is used, else the live
cluster as :func:`~executor.cluster.discover` sees it (nothing emulated).

``run`` builds the model named by ``--model`` (a zoo name), or by the ``name`` and input size
of ``--profile`` (so a profile of a zoo model at its default options), trains ``--warmup`` +
``--steps`` batches and prints the measurement beside the cost model's prediction, with
``error = (predicted - measured) / measured``. The prediction uses ``--profile``, or else a
profile measured on the cluster first (:func:`executor.profiling.measure_profile`).

This module imports :mod:`service.cli`, Ray and torch only inside functions, so the CLI
starts fast; :func:`register` adds the commands to the CLI's app.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from core.cluster import ClusterSpec
from core.plan import Plan
from core.profile import ModelProfile

if TYPE_CHECKING:
    from agents.problem import PlanResult, Problem
    from agents.tapp.trainer import TAPPConfig
    from core.costmodel import Estimate
    from executor.measure import Measurement
    from executor.model import ModelSource
    from executor.reward import MeasuredReward

SPEC_FILE = "spec.json"  # next to executor.persistent's state file: the spec `up` started

# Defaults of `plan --planner tapp --reward measured`: every evaluation is a real run
# (seconds each, more when the stages change and new actors start), so a small search.
MEASURED_ITERATIONS = 3
MEASURED_BATCH_SIZE = 4
MEASURED_BUDGET = 16
MEASURED_SECONDS = 900.0


class DataKind(StrEnum):
    synthetic = "synthetic"
    digits = "digits"


AddressOpt = Annotated[
    str | None,
    typer.Option(
        "--address",
        help="run on a running Ray cluster: HOST:PORT, or 'auto' for the one `pipeplan "
        "cluster up` started (default: start a local cluster for --cluster, stop it after)",
    ),
]


def register(app: typer.Typer) -> None:
    """Add ``run``, ``demo`` and the ``cluster`` group to the CLI."""
    from service.cli import clean_errors
    from service.demo import demo_command

    app.command("run")(clean_errors(run_command))
    app.command("demo")(clean_errors(demo_command))
    group = typer.Typer(
        help="A local Ray cluster that outlives one command (ray status and the dashboard "
        "show it).",
        no_args_is_help=True,
    )
    group.command("up")(clean_errors(cluster_up))
    group.command("down")(clean_errors(cluster_down))
    group.command("status")(clean_errors(cluster_status))
    app.add_typer(group, name="cluster")


# --- where to run -------------------------------------------------------------------------------


def state_dir() -> Path:
    from executor.local.persistent_cluster import default_state_dir

    return default_state_dir()


def resolve_address(address: str) -> str:
    """``auto``: the address of the running ``pipeplan cluster up`` cluster."""
    from service.cli import CliError

    if address != "auto":
        return address
    from executor.errors import ExecutorError
    from executor.local.persistent_cluster import _alive, read_state

    try:
        state = read_state(state_dir())
    except ExecutorError:
        raise CliError(
            f"--address auto: no pipeplan cluster is running (none recorded in {state_dir()}); "
            "start one with `pipeplan cluster up --spec C`"
        ) from None
    if not _alive(state.processes):
        raise CliError(
            f"--address auto: the cluster recorded in {state_dir()} ({state.address}) is not "
            "running; `pipeplan cluster down` clears the record"
        )
    return state.address


def saved_spec() -> ClusterSpec | None:
    """The spec ``cluster up`` started, if it saved one."""
    path = state_dir() / SPEC_FILE
    return ClusterSpec.load(path) if path.exists() else None


def quiet_ray_logs() -> None:
    """Ray's start-up chatter (token auth on, address file overwritten) is not for users."""
    import logging

    for name in ("ray", "ray._private", "ray.cluster_utils"):
        logging.getLogger(name).setLevel(logging.ERROR)


RUN_OBJECT_STORE_MB = 1024
"""Object store per Ray node of the clusters ``run``, ``profile --measure``, ``plan --reward
measured`` and ``demo`` start: activations and the replicas' all-reduce chunks pass through
it (AlexNet's gradients alone are 230 MB), and a store that spills to disk makes the spilling
dominate the measured batch time. Shared memory is only taken as it is used."""


@contextmanager
def live_cluster(spec: ClusterSpec | None, address: str | None) -> Iterator[ClusterSpec]:
    """A connected Ray cluster for the ``with`` body: a new :class:`LocalCluster` for
    ``spec`` (stopped afterwards), or the cluster at ``address`` (disconnected afterwards).
    Yields the spec to run plans for (module docstring)."""
    import ray

    from executor.live_cluster import discover
    from executor.local_cluster import LocalCluster
    from executor.runtime import connect, ensure_token_auth
    from service.cli import CliError, err

    quiet_ray_logs()
    if address is None:
        if spec is None:
            raise CliError("--cluster: required unless --address joins a running cluster")
        cluster = LocalCluster(spec, object_store_mb=RUN_OBJECT_STORE_MB)
        with err.status(f"starting local cluster {spec.name!r} ({len(spec.nodes)} Ray nodes)"):
            cluster.start()
        err.print(
            f"local cluster {spec.name!r} up in {cluster.startup_s:.0f} s "
            f"({', '.join(cluster.node_names)})",
            markup=False,
            highlight=False,
        )
        try:
            yield spec
        finally:
            cluster.stop()
        return
    target = resolve_address(address)
    reference = spec if spec is not None else (saved_spec() if address == "auto" else None)
    # connect() sets RAY_AUTH_MODE after Ray was imported, too late for Ray to use it;
    # turn token auth on the way LocalCluster does (the token is ~/.ray/auth_token).
    ensure_token_auth()
    connect(target)
    try:
        if spec is not None:
            yield spec
        else:
            yield discover(reference, name=reference.name if reference else "discovered")
    finally:
        ray.shutdown()


# --- the model ----------------------------------------------------------------------------------


def model_source(
    model: str | None, input_size: int | None, profile: ModelProfile | None, seed: int = 0
) -> ModelSource:
    """What the executor builds: ``--model`` (a zoo name), or the zoo model a profile names
    (its name, and its input's last dimension as the input size)."""
    from executor.model import ModelSource
    from models import zoo
    from service.cli import CliError

    if (model is None) == (profile is None):
        raise CliError("give exactly one of --model NAME or --profile FILE")
    if model is not None:
        if model not in zoo.MODELS:
            raise CliError(f"--model: unknown {model!r} (one of {', '.join(zoo.MODELS)})")
        return ModelSource(model, input_size, seed=seed)
    assert profile is not None
    if input_size is not None:
        raise CliError("--input-size: only applies with --model (a profile has its own)")
    if profile.name not in zoo.MODELS:
        raise CliError(
            f"--profile: its model {profile.name!r} is not a zoo model the executor can build "
            f"(one of {', '.join(zoo.MODELS)}); use --model NAME"
        )
    size = profile.input_shape[-1] if profile.input_shape else None
    return ModelSource(profile.name, size, seed=seed)


def plan_types(plan: Plan) -> list[str]:
    """The device types a plan uses, sorted."""
    from core.cluster import parse_device_id

    return sorted({parse_device_id(d)[1] for d in plan.devices})


def measure_on_cluster(
    source: ModelSource,
    spec: ClusterSpec,
    device_types: list[str] | None = None,
    global_batch: int | None = None,
) -> ModelProfile:
    """The model's profile timed on the connected cluster (:func:`measure_profile`), with
    timings for ``device_types`` (default: every type of ``spec``); at the batch sizes plans
    of ``global_batch`` run (:func:`executor.profiling.call_sizes`) when it is given, else at
    :func:`measure_profile`'s defaults."""
    from executor.measured_profile import call_sizes, measure_profile
    from service.cli import err

    types = device_types or sorted(spec.counts_by_type())
    emulated = spec.emulated_slower or any(
        spec.device_types[t].flops != spec.fastest_flops() for t in types
    )
    t0 = time.perf_counter()
    with err.status(f"measuring the profile of {source.name} on the cluster"):
        if global_batch is None:
            prof = measure_profile(source, spec, device_types=types)
        else:
            sizes = call_sizes(global_batch)
            prof = measure_profile(source, spec, device_types=types, batch_sizes=sizes)
    err.print(
        f"measured the profile of {source.name} on the cluster in "
        f"{time.perf_counter() - t0:.0f} s (timings for {', '.join(types)}"
        + (", EMULATED: scaled by each type's slowdown)" if emulated else ")"),
        markup=False,
        highlight=False,
    )
    return prof


def measured_profile(
    model: str, input_size: int | None, cluster: str | None, address: str | None
) -> ModelProfile:
    """``pipeplan profile MODEL --cluster C --measure``: a cluster for C, then measure."""
    from service.cli import load_cluster

    source = model_source(model, input_size, None)
    spec = load_cluster(cluster) if cluster else None
    with live_cluster(spec, address) as live:
        return measure_on_cluster(source, live)


# --- run ----------------------------------------------------------------------------------------


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured`` (nan when nothing was measured)."""
    return (predicted - measured) / measured if measured else math.nan


@dataclass(frozen=True)
class Comparison:
    """A measured run beside the cost model's prediction for the same plan."""

    model: str
    cluster: str
    profile_from: str
    estimate: Estimate
    measurement: Measurement

    @property
    def error(self) -> float:
        return relative_error(self.estimate.batch_time_s, self.measurement.batch_time_s)

    def to_dict(self) -> dict[str, Any]:
        est, m = self.estimate, self.measurement
        return {
            "model": self.model,
            "cluster": self.cluster,
            "profile": self.profile_from,
            "emulated": m.emulated,
            "plan": m.plan.to_dict(),
            "predicted": est.to_dict(),
            "measured": m.to_dict(),
            "error": {
                "definition": "(predicted - measured) / measured; comm_fraction: difference",
                "batch_time": self.error,
                "throughput": relative_error(est.throughput, m.throughput),
                "comm_fraction": est.comm_fraction - m.comm_fraction,
                "stages": [
                    {
                        "compute": relative_error(p.compute_s, q.compute_s),
                        "transfer": relative_error(p.transfer_s, q.transfer_s),
                    }
                    for p, q in zip(est.stages, m.stages, strict=True)
                ],
            },
        }


def comparison_table(c: Comparison) -> Table:
    est, m = c.estimate, c.measurement
    title = f"{c.model} on {c.cluster}: measured vs cost model ({c.profile_from})"
    if m.emulated:
        title += " [EMULATED]"
    table = Table(title=title, title_justify="left")
    for col in ("quantity", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "quantity" else "right")

    def ms(label: str, p: float, q: float, spread: str = "") -> None:
        table.add_row(label, f"{p * 1e3:.2f}", f"{q * 1e3:.2f}{spread}", pct(p, q))

    ms("batch time ms", est.batch_time_s, m.batch_time_s, f" ± {m.batch_time_std_s * 1e3:.2f}")
    table.add_row(
        "throughput samples/s",
        f"{est.throughput:,.1f}",
        f"{m.throughput:,.1f}",
        pct(est.throughput, m.throughput),
    )
    table.add_row(
        "comm fraction",
        f"{est.comm_fraction:.2f}",
        f"{m.comm_fraction:.2f}",
        f"{est.comm_fraction - m.comm_fraction:+.2f}",
    )
    for p, q in zip(est.stages, m.stages, strict=True):
        where = f"stage {p.index} [{p.layers[0]}, {p.layers[1]}) {', '.join(p.devices)}"
        ms(f"{where}: compute ms", p.compute_s, q.compute_s)
        ms(f"{where}: transfer ms", p.transfer_s, q.transfer_s)
    return table


def pct(predicted: float, measured: float) -> str:
    e = relative_error(predicted, measured)
    return "-" if not math.isfinite(e) else f"{e:+.1%}"


def run_command(
    plan: Annotated[Path, typer.Option("--plan", help="plan.json to run")],
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            help="cluster.yaml or a preset name: the cluster to start, or the spec of the "
            "--address cluster",
        ),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="zoo model name")] = None,
    input_size: Annotated[
        int | None, typer.Option(help="input height/width (or tokens) for --model")
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(
            "--profile",
            help="profile.json of a zoo model (its name and input size pick the model); "
            "default: measure one on the cluster first",
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="measured training steps")] = 5,
    warmup: Annotated[int, typer.Option(help="steps run first and not timed")] = 1,
    data: Annotated[
        DataKind, typer.Option(help="synthetic tensors, or scikit-learn's digits (images)")
    ] = DataKind.synthetic,
    seed: Annotated[int, typer.Option(help="seed of the weights and the data")] = 0,
    timeout: Annotated[float, typer.Option(help="longest wait for one step, seconds")] = 300.0,
    address: AddressOpt = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="print prediction, measurement and error as JSON")
    ] = False,
) -> None:
    """Run a plan for real on Ray actors; print the measurement beside the cost model's."""
    import json

    from core.costmodel import simulate
    from executor.live_cluster import live_nodes
    from executor.pinning import check_feasible
    from executor.pipeline import RunConfig
    from executor.pipeline import run as run_plan
    from service.cli import err, load_cluster, out

    the_plan = Plan.load(plan)
    prof = ModelProfile.load(profile) if profile is not None else None
    source = model_source(model, input_size, prof, seed)
    config = RunConfig(
        steps=steps, warmup=warmup, data=data.value, seed=seed, timeout_s=timeout
    )  # checks steps/warmup/timeout before anything starts
    spec = load_cluster(cluster) if cluster else None
    if spec is not None or prof is not None:  # refuse a plan that cannot be, before Ray
        the_plan.validate(prof, spec)
    with live_cluster(spec, address) as live:
        the_plan.validate(None, live)
        check_feasible(the_plan, live_nodes())  # the executor's check, before any actor
        if prof is None:
            prof = measure_on_cluster(source, live, plan_types(the_plan), the_plan.global_batch)
            profile_from = "profile measured on the cluster"
        else:
            profile_from = f"profile {profile}"
        the_plan.validate(prof, live)
        estimate = simulate(the_plan, prof, live)
        with err.status(f"running the plan: {warmup} warm-up + {steps} steps"):
            measurement = run_plan(the_plan, source, live, config)
    result = Comparison(source.name, live.name, profile_from, estimate, measurement)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    if measurement.emulated:
        from executor.measure import EMULATED_NOTE

        typer.echo(EMULATED_NOTE)
    out().print(comparison_table(result))
    typer.echo(
        f"error           {result.error:+.1%} in batch time ((predicted - measured) / measured)"
    )
    typer.echo(
        f"training        loss {measurement.losses[0]:.4f} -> {measurement.losses[-1]:.4f}, "
        f"accuracy {measurement.accuracies[-1]:.3f} ({data.value} data, "
        f"{measurement.steps} steps after {measurement.warmup} warm-up)"
    )


# --- cluster up / down / status -----------------------------------------------------------------


def cluster_up(
    spec: Annotated[str, typer.Option("--spec", help="cluster.yaml or a preset name")],
    object_store_mb: Annotated[int, typer.Option(help="object store per node, MB")] = 500,
) -> None:
    """Start a local Ray cluster for a spec that stays up until `pipeplan cluster down`."""
    from executor.local.persistent_cluster import start_persistent
    from service.cli import err, load_cluster

    the_spec = load_cluster(spec)
    quiet_ray_logs()
    with err.status(f"starting {the_spec.name!r}: {len(the_spec.nodes)} Ray nodes"):
        state = start_persistent(the_spec, state_dir(), object_store_mb=object_store_mb)
    the_spec.save(state_dir() / SPEC_FILE)
    emulated = len({t.flops for t in the_spec.device_types.values()}) > 1
    lines = [
        f"cluster {the_spec.name!r} is up: {len(state.nodes)} Ray nodes "
        f"({', '.join(state.nodes)}), devices advertised as device:TYPE resources",
        f"address     {state.address}",
        f"dashboard   {state.dashboard_url}",
        f"ray status  RAY_AUTH_MODE=token ray status --address {state.address}",
        "use it      pipeplan run --address auto ...   (or --address " + state.address + ")",
        "stop it     pipeplan cluster down",
    ]
    if emulated:
        lines.append("note        device speeds are EMULATED: every device is this machine's CPU")
    typer.echo("\n".join(lines))


def cluster_down() -> None:
    """Stop the cluster `pipeplan cluster up` started (only its processes)."""
    from executor.errors import ExecutorError
    from executor.local.persistent_cluster import read_state, stop_persistent

    try:
        state = read_state(state_dir())
    except ExecutorError:
        typer.echo(f"no pipeplan cluster is running (none recorded in {state_dir()})")
        return
    stopped = stop_persistent(state_dir())
    (state_dir() / SPEC_FILE).unlink(missing_ok=True)
    typer.echo(f"stopped cluster {state.name!r} at {state.address} ({stopped} processes ended)")


def cluster_status() -> None:
    """Show the cluster `pipeplan cluster up` started (ray status); exit 1 when none runs."""
    from executor.errors import ExecutorError
    from executor.local.persistent_cluster import _alive, ray_status, read_state

    try:
        state = read_state(state_dir())
    except ExecutorError:
        typer.echo(
            f"no pipeplan cluster is running (none recorded in {state_dir()}); start one "
            "with `pipeplan cluster up --spec C`"
        )
        raise typer.Exit(1) from None
    if not _alive(state.processes):
        typer.echo(
            f"the cluster {state.name!r} recorded in {state_dir()} ({state.address}) is not "
            "running; `pipeplan cluster down` clears the record"
        )
        raise typer.Exit(1)
    typer.echo(
        f"cluster {state.name!r} at {state.address}, dashboard {state.dashboard_url}, "
        f"nodes {', '.join(state.nodes)}"
    )
    typer.echo(ray_status(state.address).rstrip())


# --- TAPP with a measured reward ----------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredSearch:
    """A search whose values are measured runs: the result and the book of every run."""

    result: PlanResult
    reward: MeasuredReward


def measured_problem(problem: Problem, budget: int | None, seconds: float | None) -> Problem:
    """The problem with the measured reward's budget defaults (module constants)."""
    from agents.problem import Budget

    limits = Budget(
        evaluations=MEASURED_BUDGET if budget is None else budget,
        seconds=MEASURED_SECONDS if seconds is None else seconds,
    )
    return dataclasses.replace(problem, budget=limits)


def plan_tapp_measured(
    problem: Problem,
    source: ModelSource,
    options: dict[str, Any],
    *,
    repeats: int,
    warmup: int,
    address: str | None,
) -> MeasuredSearch:
    """TAPP trained on measured batch times: every plan it samples runs on the cluster
    (one cluster and, where stages repeat, the same actors, for the whole search)."""
    from agents.registry import make_planner
    from executor.reward import MeasuredReward
    from service.cli import CliError

    options = {"iterations": MEASURED_ITERATIONS, "batch_size": MEASURED_BATCH_SIZE, **options}
    if options.get("workers", 0) > 1:
        raise CliError("--workers: not with --reward measured (plans run one at a time)")
    config: TAPPConfig = make_planner("tapp", **options).config
    with (
        live_cluster(problem.cluster, address) as live,
        MeasuredReward(
            source,
            live,
            repeats=repeats,
            warmup=warmup,
            profile=problem.profile,
            score=lambda plan, t: _score(problem, plan, t),
        ) as reward,
    ):
        result = _train_measured(problem, config, reward)
    return MeasuredSearch(result, reward)


def _score(problem: Problem, plan: Plan, batch_time: float) -> float:
    """The problem's objective value of a plan from its measured batch time."""
    import numpy as np

    price = sum(problem.cluster.device_types[problem.cluster.device(d).type].price_per_hour
                for d in plan.devices)  # fmt: skip
    return float(problem.score(np.array([batch_time]), np.array([True]), np.array([price]))[0])


def _train_measured(problem: Problem, config: TAPPConfig, reward: MeasuredReward) -> PlanResult:
    """TAPP's REINFORCE loop (:func:`agents.tapp.trainer.train`) on ``reward``, booked in a
    :class:`~agents.search.Search` (evaluations, budget, history) as the planner does."""
    import numpy as np

    from agents.problem import HistoryPoint, InfeasibleError, PlanResult
    from agents.search import Search
    from agents.tapp.trainer import Task, new_policy, problem_context, train
    from core.costmodel import simulate
    from service.plan_cmd import progress_bar

    options = dataclasses.asdict(config)
    search = Search(problem, "tapp", options)
    ctx = problem_context(problem, config)
    with progress_bar("tapp (measured)", problem) as update:

        class Booked:
            def evaluate(self, plans: Sequence[Plan]) -> np.ndarray:
                values = reward.evaluate(plans)
                search.count(len(plans))
                best = float(min(values.min(initial=math.inf), search.best_value))
                search.best_value = best
                search.history.append(HistoryPoint(search.evaluations, search.elapsed, best))
                update(search.evaluations, best)
                return values

        task = Task(ctx, Booked())
        train(
            new_policy(config, problem.seed),
            [task],
            config,
            seed=problem.seed,
            should_stop=search.exhausted,
            remaining=lambda: search.remaining_evaluations,
        )
    if task.best_plan is None:
        reasons = sorted({o.error for o in reward.outcomes.values() if o.error})
        raise InfeasibleError(
            f"tapp (measured) on {problem.profile.name!r}: none of the {len(reward.outcomes)} "
            f"plans evaluated ran" + (f" ({'; '.join(reasons[:3])})" if reasons else "")
        )
    return PlanResult(
        plan=task.best_plan,
        estimate=simulate(task.best_plan, problem.profile, problem.cluster),
        value=task.best_value,
        history=tuple(search.history),
        evaluations=search.evaluations,
        wall_time_s=search.elapsed,
        planner="tapp",
        options={**options, "reward": "measured"},
    )


def measured_doc(found: MeasuredSearch) -> dict[str, Any]:
    """Every run of a measured search, for ``--json``."""
    reward = found.reward
    best = reward.measurement(found.result.plan)
    return {
        "best": None if best is None else best.to_dict(),
        "runs": reward.runs,
        "pipelines_started": reward.pipelines_started,
        "evaluated": [
            {
                "plan": o.plan.to_dict(),
                "value": o.value if math.isfinite(o.value) else None,
                "batch_time_s": None if o.measurement is None else o.measurement.batch_time_s,
                "emulated": None if o.measurement is None else o.measurement.emulated,
                "error": o.error or None,
                "seconds": o.seconds,
            }
            for o in reward.outcomes.values()
        ],
    }


def measured_lines(found: MeasuredSearch) -> list[str]:
    """What the measured search ran, for people."""
    reward, best = found.reward, found.result.plan
    m = reward.measurement(best)
    failed = [o for o in reward.outcomes.values() if o.error]
    lines = []
    if m is not None:
        flag = " EMULATED" if m.emulated else ""
        lines.append(
            f"measured        {m.batch_time_s * 1e3:.3f} ms/batch (mean of {m.steps} runs, "
            f"std {m.batch_time_std_s * 1e3:.2f}){flag}; cost model "
            f"{found.result.estimate.batch_time_s * 1e3:.3f} ms "
            f"({pct(found.result.estimate.batch_time_s, m.batch_time_s)})"
        )
    lines.append(
        f"runs            {reward.runs} plans run on the cluster, {len(failed)} refused or "
        f"failed, {reward.pipelines_started} sets of stage actors started"
    )
    return lines
