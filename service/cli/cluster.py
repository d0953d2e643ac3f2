"""``pipeplan cluster up|down|status``: a local Ray cluster that outlives one command (ray
status and the dashboard show it)."""

from __future__ import annotations

from typing import Annotated

import typer

from service.cli.console import ConsoleReporter, clean_errors, cluster_ref
from service.tasks.cluster import ClusterUpRequest, cluster_down, cluster_status, cluster_up
from service.tasks.live import state_dir

NOT_RUNNING = "no pipeplan cluster is running (none recorded in {where})"


@clean_errors
def up_command(
    spec: Annotated[str, typer.Option("--spec", help="cluster.yaml or a preset name")],
    object_store_mb: Annotated[int, typer.Option(help="object store per node, MB")] = 500,
) -> None:
    """Start a local Ray cluster for a spec that stays up until `pipeplan cluster down`."""
    request = ClusterUpRequest(spec=cluster_ref(spec), object_store_mb=object_store_mb)
    done = cluster_up(request, ConsoleReporter())
    state = done.state
    lines = [
        f"cluster {state.name!r} is up: {len(state.nodes)} Ray nodes "
        f"({', '.join(state.nodes)}), devices advertised as device:TYPE resources",
        f"address     {state.address}",
        f"dashboard   {state.dashboard_url}",
        f"ray status  RAY_AUTH_MODE=token ray status --address {state.address}",
        f"use it      pipeplan run --address auto ...   (or --address {state.address})",
        "stop it     pipeplan cluster down",
    ]
    if done.emulated:
        lines.append("note        device speeds are EMULATED: every device is this machine's CPU")
    typer.echo("\n".join(lines))


@clean_errors
def down_command() -> None:
    """Stop the cluster `pipeplan cluster up` started (only its processes)."""
    done = cluster_down()
    if done is None:
        typer.echo(NOT_RUNNING.format(where=state_dir()))
        return
    s = done.state
    typer.echo(f"stopped cluster {s.name!r} at {s.address} ({done.stopped} processes ended)")


@clean_errors
def status_command() -> None:
    """Show the cluster `pipeplan cluster up` started (ray status); exit 1 when none runs."""
    status = cluster_status()
    state = status.state
    if state is None:
        typer.echo(
            NOT_RUNNING.format(where=state_dir())
            + "; start one with `pipeplan cluster up --spec C`"
        )
        raise typer.Exit(1)
    if not status.running:
        typer.echo(
            f"the cluster {state.name!r} recorded in {state_dir()} ({state.address}) is not "
            "running; `pipeplan cluster down` clears the record"
        )
        raise typer.Exit(1)
    typer.echo(
        f"cluster {state.name!r} at {state.address}, dashboard {state.dashboard_url}, "
        f"nodes {', '.join(state.nodes)}"
    )
    typer.echo(status.ray_status)


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="A local Ray cluster that outlives one command (ray status and the dashboard "
        "show it).",
        no_args_is_help=True,
    )
    group.command("up")(up_command)
    group.command("down")(down_command)
    group.command("status")(status_command)
    app.add_typer(group, name="cluster")
