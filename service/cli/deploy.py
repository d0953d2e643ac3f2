"""``pipeplan deploy render``: the parts of a deployment that depend on the cluster spec
(:mod:`service.tasks.deploy`), written where ``deploy/k8s`` and ``deploy/compose`` read them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeplan.core._io import read_document
from pipeplan.service.cli.console import CliError, clean_errors, say
from pipeplan.service.tasks.common import ClusterRef, presets
from pipeplan.service.tasks.deploy import DeployRenderRequest, DeployTarget, render


def spec_ref(text: str) -> ClusterRef:
    """``--spec``: a cluster file's document, or a preset's name (no such file, no suffix)."""
    path = Path(text)
    if path.is_file():
        ref: ClusterRef = read_document(path)
        return ref
    if path.exists():
        raise CliError(f"--spec: {text!r} is a directory, not a cluster file")
    if path.suffix == "" and path.name == text:
        return text
    raise CliError(f"--spec: no such file {text!r} (nor a preset: {', '.join(presets())})")


@clean_errors
def render_command(
    spec: Annotated[str, typer.Option("--spec", help="cluster.yaml, or a preset's name")],
    out: Annotated[Path, typer.Option("--out", help="folder to write into (created)")],
    target: Annotated[
        DeployTarget,
        typer.Option(help="all: OUT/k8s and OUT/compose; k8s or compose: straight into OUT"),
    ] = DeployTarget.ALL,
    image_cpu: Annotated[str | None, typer.Option(help="image of the head and CPU workers")] = None,
    image_cuda: Annotated[str | None, typer.Option(help="image of the GPU workers")] = None,
    cpus_per_device: Annotated[int, typer.Option(help="CPU cores per device")] = 2,
    memory_gib_per_device: Annotated[int, typer.Option(help="pod memory per device, GiB")] = 8,
    object_store_mb: Annotated[int, typer.Option(help="object store per Compose node")] = 1024,
    node_selectors: Annotated[
        bool, typer.Option(help="pin groups to nodes labelled device.pipeplan.io/TYPE=true")
    ] = True,
) -> None:
    """Write the RayCluster and the Compose Ray nodes for a cluster spec."""
    images = {"image_cpu": image_cpu, "image_cuda": image_cuda}
    request = DeployRenderRequest(
        spec=spec_ref(spec),
        target=target,
        cpus_per_device=cpus_per_device,
        memory_gib_per_device=memory_gib_per_device,
        object_store_mb=object_store_mb,
        node_selectors=node_selectors,
        **{k: v for k, v in images.items() if v is not None},
    )
    done = render(request)
    written = done.write(out)
    say(f"cluster {done.spec_name!r}: wrote {len(written)} files under {out}")
    for path in written:
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Deployments (deploy/): the parts that depend on the cluster spec.",
        no_args_is_help=True,
    )
    group.command("render")(render_command)
    app.add_typer(group, name="deploy")
