"""``pipeplan`` command line: one module per command group, each parsing its flags into a
request, calling one use-case (:mod:`service.tasks`) and rendering the result.

- :mod:`~service.cli.profile`: ``profile``;
- :mod:`~service.cli.simulate`: ``simulate``, ``validate``;
- :mod:`~service.cli.plan`: ``plan``, ``compare``;
- :mod:`~service.cli.run`: ``run``;
- :mod:`~service.cli.cluster`: ``cluster up|down|status``;
- :mod:`~service.cli.demo`: ``demo``;
- :mod:`~service.cli.serve`: ``serve`` (the service: REST API, jobs as Ray Jobs);
- :mod:`~service.cli.job`: ``job run`` (the entrypoint of a service job's Ray Job);
- :mod:`~service.cli.submit`: ``submit KIND`` (a job for the service);
- :mod:`~service.cli.jobs`: ``jobs ls|show|logs|cancel|events`` (the service's jobs);
- :mod:`~service.cli.tokens`: ``tokens create|ls|revoke`` (users' tokens, admin);
- :mod:`~service.cli.deploy`: ``deploy render`` (the cluster-dependent parts of deploy/);
- :mod:`~service.cli.provision`: ``provision``; :mod:`~service.cli.calibrate`: ``calibrate``.

The group is lazy (:class:`LazyGroup`): a command's module is imported only when that
command runs (or shows its own ``--help``), and ``pipeplan --help`` lists every command from
:data:`COMMANDS` without importing any. So ``--help``, ``validate``, ``simulate`` and the
client commands (``submit``, ``jobs``) start without torch or Ray, which only the modules of
the commands that use them import.

Every error is one line on stderr and a non-zero exit code; no tracebacks.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import typer
from typer._click import Context, HelpFormatter
from typer._click import exceptions as click_errors
from typer._click.core import Command
from typer.core import TyperCommand, TyperGroup
from typer.main import get_group

from pipeplan.service.cli.console import debug, say

COMMANDS: dict[str, tuple[str, str]] = {
    "profile": (
        "pipeplan.service.cli.profile:register",
        "Profile a zoo model (or import a PipeDream profile) into profile.json.",
    ),
    "simulate": (
        "pipeplan.service.cli.simulate:register",
        "Cost a plan with the cost model: per-stage table, totals, optional Gantt chart.",
    ),
    "validate": (
        "pipeplan.service.cli.simulate:register",
        "Check a profile, cluster or plan file; with --profile/--cluster, a plan against them.",
    ),
    "plan": (
        "pipeplan.service.cli.plan:register",
        "Search a plan with one planner; print its per-stage estimate.",
    ),
    "compare": (
        "pipeplan.service.cli.plan:register",
        "Run several planners on one problem; one table of their plans side by side.",
    ),
    "run": (
        "pipeplan.service.cli.run:register",
        "Run a plan for real on Ray actors; print the measurement beside the cost model's.",
    ),
    "train": (
        "pipeplan.service.cli.train:register",
        "Train a model on a plan (given, or planned first); checkpoints, resume.",
    ),
    "checkpoint": (
        "pipeplan.service.cli.train:register",
        "Training checkpoints.",
    ),
    "export": (
        "pipeplan.service.cli.export:register",
        "Write a plan as a torchrun script that trains it with torch.distributed.pipelining.",
    ),
    "demo": (
        "pipeplan.service.cli.demo:register",
        "The main job: local cluster, measured profile, planners, real runs, table, Gantt.",
    ),
    "serve": (
        "pipeplan.service.cli.serve:register",
        "Run the service: the REST API, jobs as Ray Jobs (see API.md).",
    ),
    "provision": (
        "pipeplan.service.cli.provision:register",
        "What to rent for a throughput or a budget, the price front; --apply deploys it.",
    ),
    "calibrate": (
        "pipeplan.service.cli.calibrate:register",
        "Fit link latency and bandwidth, per-type compute scale and call overheads and a "
        "per-step overhead from probe plans run for real; write the spec with the "
        "calibration the cost model then uses.",
    ),
    "cluster": (
        "pipeplan.service.cli.cluster:register",
        "A local Ray cluster that outlives one command (ray status and the dashboard show "
        "it); this machine joining a running cluster as one node of a spec.",
    ),
    "job": (
        "pipeplan.service.cli.job:register",
        "Service jobs (the entrypoint their Ray Jobs run).",
    ),
    "submit": (
        "pipeplan.service.cli.submit:register",
        "Submit a job to the pipeplan service (prints its id; --wait follows it).",
    ),
    "jobs": (
        "pipeplan.service.cli.jobs:register",
        "The service's jobs: list, show, logs, cancel, events.",
    ),
    "tokens": (
        "pipeplan.service.cli.tokens:register",
        "Users' tokens of the service (admin): create, ls, revoke.",
    ),
    "deploy": (
        "pipeplan.service.cli.deploy:register",
        "Deployments (deploy/): the parts that depend on the cluster spec.",
    ),
}
"""Each command: ``"module:register"`` (the function that adds the command, with its
module's others, to a Typer app) and the one-line help ``pipeplan --help`` lists for it
(a test checks it is the command's own)."""


def load_command(name: str) -> Command:
    """Command ``name`` as click runs it: its module imported, its ``register`` called on
    an app of its own."""
    target, _ = COMMANDS[name]
    module_name, _, attr = target.partition(":")
    register: Callable[[typer.Typer], None] = getattr(importlib.import_module(module_name), attr)
    app = typer.Typer()
    register(app)
    return get_group(app).commands[name]


class LazyGroup(TyperGroup):
    """The ``pipeplan`` group: its commands are :data:`COMMANDS`, each loaded on first use
    (:func:`load_command`); listing them (``pipeplan --help``) loads none."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._listing = False
        self._loaded: dict[str, Command] = {}
        for name, (_, short) in COMMANDS.items():  # names for "did you mean", in order
            self.commands.setdefault(name, TyperCommand(name=name, help=short))

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        if self._listing:
            return self.commands[cmd_name]
        if cmd_name not in self._loaded:
            self._loaded[cmd_name] = load_command(cmd_name)
        return self._loaded[cmd_name]

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="pipeplan",
    cls=LazyGroup,
    help="Plan and run pipeline-parallel DNN training on heterogeneous clusters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _group() -> None:
    """The commands are :data:`COMMANDS`, loaded by :class:`LazyGroup`."""


def main() -> None:
    """Console entry point: usage errors are one line too."""
    args = sys.argv[1:] or ["--help"]
    try:
        rv = app(args, standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        say("aborted")
        sys.exit(130)
    except click_errors.ClickException as e:
        say(f"error: {e.format_message()}")
        sys.exit(2)
    except Exception as e:  # a bug, not bad input: still one line unless asked for more
        if debug():
            raise
        say(f"internal error: {type(e).__name__}: {e} (set PIPEPLAN_DEBUG=1 for the traceback)")
        sys.exit(3)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
