"""What every command shares: the consoles, one-line errors, a :class:`Reporter` that draws
on stderr, and reading the files a request is built from.

Every error is one line on stderr and exit code 2; no tracebacks (a failed stage's worker
traceback only with ``PIPEPLAN_DEBUG=1``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from pipeplan.agents.problem import Objective
from pipeplan.agents.search import Progress as SearchProgress
from pipeplan.core._io import read_document
from pipeplan.core.errors import PipeplanError
from pipeplan.executor.errors import ExecutorError
from pipeplan.service.render import format_value
from pipeplan.service.tasks.progress import Reporter
from pipeplan.service.tasks.requests import ClusterRef, Document

if TYPE_CHECKING:  # the executor imports torch, which a client command does without
    from pipeplan.executor.elastic import Replanned
    from pipeplan.executor.train import TrainStep

err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def out() -> Console:
    """stdout; a wide page when piped, so tables are not squeezed to 80 columns."""
    return Console(width=None if sys.stdout.isatty() else 160)


def debug() -> bool:
    """Whether the user asked for whole tracebacks (``PIPEPLAN_DEBUG=1``)."""
    return bool(os.environ.get("PIPEPLAN_DEBUG"))


class CliError(Exception):
    """A command line that cannot be run as given (flags that go together)."""


def say(text: str) -> None:
    """One line on stderr, as it is (no markup)."""
    err.print(text, markup=False, highlight=False, soft_wrap=True)


def echo_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2))


def validation_message(e: ValidationError) -> str:
    """A request's first invalid field, its value and why, on one line."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "request"
    return f"{where}: {first['msg']}, got {first.get('input')!r}"


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    if len(lines) <= 1:
        return text.strip()
    return f"{lines[0]} (set PIPEPLAN_DEBUG=1 for the rest)"


def clean_errors(fn: F) -> F:
    """Turn domain, request, I/O and cluster errors into one line and exit code 2."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (PipeplanError, CliError, OSError) as e:
            say(f"error: {e}")
        except ValidationError as e:
            say(f"error: {validation_message(e)}")
        except ExecutorError as e:
            say(f"error: {str(e) if debug() else _first_line(str(e))}")
        raise typer.Exit(2)

    return wrapper  # type: ignore[return-value]


def cluster_ref(text: str) -> ClusterRef:
    """``--cluster``: a file's document, or a preset's name (no such file, no suffix)."""
    p = Path(text)
    if not p.exists() and p.suffix == "":
        return text
    doc: Document = read_document(p)
    return doc


def document(path: Path | None) -> Document | None:
    """A profile or plan file's document (None: no file given)."""
    return None if path is None else read_document(path)


class ConsoleReporter(Reporter):
    """Spinners, notes and transient progress bars on stderr (bars only on a terminal:
    in a pipe or a log they would leave blank lines). In a pipe or a log a long step is one
    line as it starts, where a terminal gets a spinner: a spinner draws nothing there, and a
    log of a several-minute step would otherwise say nothing until it ends."""

    def __init__(self, objective: Objective = Objective.TIME) -> None:
        self.objective = objective

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        if not err.is_terminal:
            say(f"{text} ...")
            yield
            return
        with err.status(text):
            yield

    def note(self, text: str) -> None:
        say(text)

    def trained(self, step: TrainStep) -> None:
        say(
            f"step {step.step + 1}: loss {step.loss:.4f}, {step.samples_per_s:.1f} samples/s "
            f"({step.batch_time_s:.2f} s)"
        )

    def checkpointed(self, step: int, path: Path) -> None:
        say(f"checkpoint after step {step}: {path}")

    def replanned(self, event: Replanned) -> None:
        say(event.text())

    @contextmanager
    def search(self, label: str, total: int | None) -> Iterator[SearchProgress]:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed} evaluations"),
            TextColumn("best {task.fields[best]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task(label, total=total, best="-")

            def update(evaluations: int, best: float) -> None:
                bar.update(task, completed=evaluations, best=format_value(best, self.objective))

            yield update
