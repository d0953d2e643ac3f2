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

from pipeplan.core._io import read_document
from pipeplan.executor.checkpoint import export_state_dict
from pipeplan.service.cli.console import ConsoleReporter, clean_errors, echo_json, say
from pipeplan.service.cli.options import OptionOpt, ProblemFlags, parse_options, problem_options
from pipeplan.service.tasks.requests import EngineKind
from pipeplan.service.tasks.train import TrainRequest, train

PlanOpt = Annotated[Path | None, typer.Option("--plan", help="plan.json to train on")]
PlannerOpt = Annotated[
    str | None, typer.Option("--planner", help="plan first with this planner (cost model)")
]
StepsOpt = Annotated[
    int | None,
    typer.Option(help="steps to have trained in all, a resumed run's too (default 10)"),
]
EpochsOpt = Annotated[
    int | None, typer.Option(help="passes over --data instead of --steps (a sized source)")
]
DataOpt = Annotated[
    str,
    typer.Option(
        help="synthetic, digits, imagefolder:PATH, tokens:PATH (.npy or uint16 .bin) or "
        "package.module:callable (a Dataset, or an iterable of (inputs, targets) batches)"
    ),
]
LossOpt = Annotated[
    str, typer.Option(help="cross-entropy (next token for LMs) or package.module:callable")
]
OptimizerOpt = Annotated[str, typer.Option(help="sgd, adam or adamw")]
CheckpointDirOpt = Annotated[
    Path | None, typer.Option("--checkpoint-dir", help="where checkpoints go")
]


@clean_errors
@problem_options()
def train_command(
    problem: ProblemFlags,
    plan: PlanOpt = None,
    planner: PlannerOpt = None,
    option: OptionOpt = None,
    steps: StepsOpt = None,
    epochs: EpochsOpt = None,
    data: DataOpt = "synthetic",
    loss: LossOpt = "cross-entropy",
    optimizer: OptimizerOpt = "sgd",
    lr: Annotated[float, typer.Option(help="learning rate")] = 0.05,
    momentum: Annotated[float, typer.Option(help="SGD momentum")] = 0.0,
    weight_decay: Annotated[float, typer.Option(help="weight decay")] = 0.0,
    checkpoint_dir: CheckpointDirOpt = None,
    checkpoint_every: Annotated[
        int, typer.Option(help="a checkpoint every N steps (0: after the last step only)")
    ] = 0,
    resume: Annotated[
        bool, typer.Option("--resume", help="continue from --checkpoint-dir's latest")
    ] = False,
    resume_from: Annotated[
        Path | None, typer.Option("--resume-from", help="continue from this checkpoint")
    ] = None,
    timeout: Annotated[float, typer.Option(help="longest wait for one step, seconds")] = 300.0,
    address: Annotated[
        str | None, typer.Option(help="train on a running Ray cluster: HOST:PORT or 'auto'")
    ] = None,
    engine: Annotated[EngineKind, typer.Option(help="who runs the stages")] = EngineKind.PIPEPLAN,
    emulate: Annotated[bool, typer.Option(help="emulate slower device types (sleeps)")] = True,
    deterministic: Annotated[bool, typer.Option(help="disable dropout")] = False,
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
        plan=read_document(plan) if plan is not None else None,
        planner=planner,
        options=parse_options(planner, option or [], None, None) if planner else {},
        steps=steps,
        epochs=epochs,
        data=data,
        loss=loss,
        optimizer=optimizer,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir is not None else None,
        checkpoint_every=checkpoint_every,
        resume_from=str(resume_from) if resume_from is not None else None,
        timeout_s=timeout,
        address=address,
        engine=engine,
        emulate=emulate,
        deterministic=deterministic,
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
