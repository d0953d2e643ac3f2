"""``pipeplan export``: a plan as files that train it without pipeplan's runtime.

``--format torchrun`` (:func:`executor.export.export_torchrun`): ``train_pipeline.py``, one
rank per stage under ``torchrun`` with torch.distributed.pipelining, and a README snippet.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from pipeplan.core.plan import Plan
from pipeplan.executor.export import export_torchrun, torchrun_command
from pipeplan.executor.model import OptimizerConfig
from pipeplan.service.cli.console import clean_errors, say
from pipeplan.service.cli.options import NO_MODEL_FLAGS, ModelFlags, model_flag_options
from pipeplan.service.tasks.live import model_source


class ExportFormat(StrEnum):
    """What ``pipeplan export`` writes."""

    TORCHRUN = "torchrun"
    """A torch.distributed.pipelining script for ``torchrun``."""


WRITERS = {ExportFormat.TORCHRUN: export_torchrun}
"""The exporter of each format."""


class OptimizerKind(StrEnum):
    """The optimizer the exported script trains with."""

    SGD = "sgd"
    ADAM = "adam"


@clean_errors
@model_flag_options()
def export_command(
    plan: Annotated[Path, typer.Option("--plan", help="plan.json to export")],
    model: Annotated[
        str, typer.Option("--model", help="zoo model name, or package.module:factory")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="folder to write train_pipeline.py and README.md into")
    ],
    fmt: Annotated[
        ExportFormat, typer.Option("--format", help="what to write")
    ] = ExportFormat.TORCHRUN,
    input_size: Annotated[
        int | None, typer.Option(help="input height/width (or tokens) for a zoo --model")
    ] = None,
    steps: Annotated[int, typer.Option(help="the script's default --steps")] = 5,
    seed: Annotated[int, typer.Option(help="seed of the weights and the data")] = 0,
    lr: Annotated[float, typer.Option(help="learning rate")] = 0.05,
    optimizer: Annotated[OptimizerKind, typer.Option(help="optimizer")] = OptimizerKind.SGD,
    model_flags: ModelFlags = NO_MODEL_FLAGS,
) -> None:
    """Write a plan as a torchrun script that trains it with torch.distributed.pipelining.

    The script cuts the model as pipeplan does, runs the plan's schedule and microbatches
    one rank per stage, and prints every step's loss; see the README it writes beside it.
    """
    the_plan = Plan.load(plan)
    source = model_source(model, input_size, None, seed, **model_flags.source_kwargs())
    config = OptimizerConfig(kind=optimizer.value, lr=lr)
    writer = WRITERS[fmt]
    written = writer(the_plan, source, out, optimizer=config, seed=seed, steps=steps)
    for path in written:
        typer.echo(str(path))
    say(f"run it: cd {out} && {torchrun_command(the_plan.num_stages, steps)}")


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
