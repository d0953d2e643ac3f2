"""``pipeplan run``: a plan trained for real on Ray actors, beside the cost model.

By default it starts a local cluster for ``--cluster`` and stops it when done; ``--address
HOST:PORT`` joins a running Ray cluster instead, ``--address auto`` the one ``pipeplan
cluster up`` started (:mod:`service.tasks.live`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeplan.core._io import read_document
from pipeplan.executor.emulation import EMULATED_NOTE
from pipeplan.service.cli.console import (
    ConsoleReporter,
    clean_errors,
    cluster_ref,
    document,
    echo_json,
    out,
)
from pipeplan.service.cli.options import (
    NO_MODEL_FLAGS,
    DataOpt,
    ModelFlags,
    ModelRefOpt,
    RunProfileOpt,
    model_flag_options,
)
from pipeplan.service.render_runs import run_lines, run_table
from pipeplan.service.tasks.run import DataKind, EngineKind, RunRequest, run

ClusterOpt = Annotated[
    str | None,
    typer.Option(
        "--cluster",
        help="cluster.yaml or a preset name: the cluster to start, or the spec of the "
        "--address cluster",
    ),
]
AddressOpt = Annotated[
    str | None,
    typer.Option(
        "--address",
        help="run on a running Ray cluster: HOST:PORT, or 'auto' for the one `pipeplan "
        "cluster up` started (default: start a local cluster for --cluster, stop it after)",
    ),
]


@clean_errors
@model_flag_options()
def run_command(
    plan: Annotated[Path, typer.Option("--plan", help="plan.json to run")],
    cluster: ClusterOpt = None,
    model: ModelRefOpt = None,
    input_size: Annotated[
        int | None, typer.Option(help="input height/width (or tokens) for --model")
    ] = None,
    model_flags: ModelFlags = NO_MODEL_FLAGS,
    profile: RunProfileOpt = None,
    steps: Annotated[int, typer.Option(help="measured training steps")] = 5,
    warmup: Annotated[int, typer.Option(help="steps run first and not timed")] = 1,
    data: DataOpt = DataKind.SYNTHETIC,
    seed: Annotated[int, typer.Option(help="seed of the weights and the data")] = 0,
    timeout: Annotated[float, typer.Option(help="longest wait for one step, seconds")] = 300.0,
    address: AddressOpt = None,
    engine: Annotated[
        EngineKind,
        typer.Option(
            help="who runs each stage's operations: pipeplan's runner (every plan) or "
            "torch.distributed.pipelining (equal microbatches, one device per stage)"
        ),
    ] = EngineKind.PIPEPLAN,
    emulate: Annotated[
        bool,
        typer.Option(help="emulate slower device types on an emulated cluster (sleeps)"),
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="print prediction, measurement and error as JSON")
    ] = False,
) -> None:
    """Run a plan for real on Ray actors; print the measurement beside the cost model's."""
    request = RunRequest(
        plan=read_document(plan),
        cluster=cluster_ref(cluster) if cluster is not None else None,
        model=model,
        input_size=input_size,
        **model_flags.fields(),
        profile=document(profile),
        steps=steps,
        warmup=warmup,
        data=data,
        seed=seed,
        timeout_s=timeout,
        address=address,
        engine=engine,
        emulate=emulate,
    )
    result = run(request, ConsoleReporter())
    if as_json:
        echo_json(result.to_dict())
        return
    if result.measurement.emulated:
        typer.echo(EMULATED_NOTE)
    out().print(run_table(result))
    for line in run_lines(result, data.value):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("run")(run_command)
