"""``pipeplan train``: train a model on a plan (given, or planned first), with checkpoints.

By default it starts a local cluster for ``--cluster`` and stops it when done; ``--address``
joins a running Ray cluster instead (:mod:`service.tasks.live`). ``--resume`` continues from
the latest checkpoint in ``--checkpoint-dir`` (``--resume-from`` names one), up to
``--steps`` steps in all. ``pipeplan checkpoint export`` writes a checkpoint's weights as the
plain model's ``state_dict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeplan.executor.checkpoint import export_state_dict
from pipeplan.service.cli.console import ConsoleReporter, clean_errors, echo_json, say
from pipeplan.service.cli.options import (
    NO_TRAIN_FLAGS,
    ProblemFlags,
    TrainFlags,
    problem_options,
    train_flag_options,
)
from pipeplan.service.tasks.train import TrainRequest, train

DataOpt = Annotated[
    str,
    typer.Option(
        help="synthetic, digits, imagefolder:PATH, tokens:PATH (.npy or uint16 .bin) or "
        "package.module:callable (a Dataset, or an iterable of (inputs, targets) batches)"
    ),
]
CheckpointDirOpt = Annotated[
    Path | None, typer.Option("--checkpoint-dir", help="where checkpoints go")
]


@clean_errors
@problem_options()
@train_flag_options()
def train_command(
    problem: ProblemFlags,
    training: TrainFlags = NO_TRAIN_FLAGS,
    data: DataOpt = "synthetic",
    checkpoint_dir: CheckpointDirOpt = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue from --checkpoint-dir's latest")
    ] = False,
    resume_from: Annotated[
        Path | None, typer.Option("--resume-from", help="continue from this checkpoint")
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="train on a running Ray cluster: HOST:PORT or 'auto'")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Train a model on a plan (given, or planned first); checkpoints, resume."""
    if resume and resume_from is None:
        if checkpoint_dir is None:
            raise typer.BadParameter("--resume needs --checkpoint-dir", param_hint="--resume")
        resume_from = checkpoint_dir
    fields: dict[str, Any] = problem.fields()
    request = TrainRequest(
        **fields,
        **training.fields(),
        data=data,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir is not None else None,
        resume_from=str(resume_from) if resume_from is not None else None,
        address=address,
    )
    done = train(request, ConsoleReporter(problem.objective))
    if as_json:
        echo_json(done.to_dict())
        return
    steps_done = done.result.steps
    if steps_done:
        first, last = steps_done[0], steps_done[-1]
        say(
            f"trained steps {first.step + 1}..{last.step + 1}: loss {first.loss:.4f} -> "
            f"{last.loss:.4f}; median step {done.measured_step_s:.3f} s"
            + (
                f" (cost model {done.predicted_step_s:.3f} s)"
                if done.predicted_step_s is not None
                else ""
            )
        )
    if done.result.checkpoint is not None:
        say(f"last checkpoint: {done.result.checkpoint}")


def export_command(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint directory or step folder")],
    out: Annotated[Path, typer.Option("--out", help="where to write the state_dict (.pt)")],
) -> None:
    """Write a checkpoint's weights as the plain model's state_dict (torch.save)."""
    state = clean_errors(export_state_dict)(checkpoint, out)
    say(f"wrote {out}: {len(state)} tensors")


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
    checkpoints = typer.Typer(help="Training checkpoints.", no_args_is_help=True)
    checkpoints.command("export")(export_command)
    app.add_typer(checkpoints, name="checkpoint")
