"""``pipeplan cluster up|down|status``: a local Ray cluster that outlives one command (ray
status and the dashboard show it); ``pipeplan cluster join|leave``: this machine as one node
of a running cluster, over the network."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeplan.service.cli.console import ConsoleReporter, clean_errors, cluster_ref
from pipeplan.service.tasks.cluster import (
    ClusterJoinRequest,
    ClusterUpRequest,
    cluster_down,
    cluster_join,
    cluster_leave,
    cluster_status,
    cluster_up,
    join_dir,
)
from pipeplan.service.tasks.live import state_dir

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


@clean_errors
def join_command(
    address: Annotated[
        str, typer.Option("--address", help="the head's HOST:PORT (its GCS), loopback or not")
    ],
    node: Annotated[str, typer.Option("--node", help="which node of the spec this machine is")],
    spec: Annotated[str, typer.Option("--spec", help="cluster.yaml or a preset name")],
    node_ip: Annotated[
        str | None,
        typer.Option(
            help="this machine's address on the cluster's network [the one it "
            "routes to the head from]"
        ),
    ] = None,
    object_store_mb: Annotated[int, typer.Option(help="object store of the node, MB")] = 500,
    num_cpus: Annotated[
        int | None, typer.Option(help="CPUs Ray may schedule on the node [all of them]")
    ] = None,
) -> None:
    """Start a Ray node on this machine for one node of a spec and join a running cluster.

    The node advertises its devices as device:TYPE resources (and one GPU per CUDA device);
    token authentication stays on: the cluster's token must be in RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. Stop it with `pipeplan cluster leave`.
    """
    request = ClusterJoinRequest(
        address=address,
        node=node,
        spec=cluster_ref(spec),
        node_ip=node_ip,
        object_store_mb=object_store_mb,
        num_cpus=num_cpus,
    )
    joined = cluster_join(request, ConsoleReporter())
    devices = ", ".join(f"{k}={v:g}" for k, v in sorted(joined.resources.items()))
    lines = [
        f"node {joined.name!r} joined the cluster at {joined.address} from {joined.node_ip}",
        f"advertises  {devices}" + (f", GPU={joined.gpus}" if joined.gpus else ""),
        f"log         {joined.log}",
        f"leave       pipeplan cluster leave --node {joined.name}",
    ]
    typer.echo("\n".join(lines))


@clean_errors
def leave_command(
    node: Annotated[
        str | None, typer.Option("--node", help="the joined node to stop [every one]")
    ] = None,
) -> None:
    """Stop the Ray node(s) `pipeplan cluster join` started on this machine (only their
    processes)."""
    left = cluster_leave(node)
    if not left:
        typer.echo(f"no node has joined from this machine (none recorded in {join_dir()})")
        return
    for joined, stopped in left:
        typer.echo(
            f"node {joined.name!r} left the cluster at {joined.address} ({stopped} processes ended)"
        )


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="A local Ray cluster that outlives one command (ray status and the dashboard "
        "show it); this machine joining a running cluster as one node of a spec.",
        no_args_is_help=True,
    )
    group.command("up")(up_command)
    group.command("down")(down_command)
    group.command("status")(status_command)
    group.command("join")(join_command)
    group.command("leave")(leave_command)
    app.add_typer(group, name="cluster")
