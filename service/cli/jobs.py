"""``pipeplan jobs ls|show|logs|cancel|events``: the service's jobs from the command line
(:class:`service.client.Client`); what every service command shares (``--server``,
``--token``, one-line errors).

The server and token come from ``--server``/``--token`` or ``PIPEPLAN_SERVER``,
``PIPEPLAN_API_TOKEN`` and ``PIPEPLAN_API_TOKEN_FILE``. Exit codes: 2 for a request the
service refused (4xx) or a service that cannot be reached, 3 for a service error (5xx).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import wraps
from typing import Annotated, Any, TypeVar

import typer

from pipeplan.service.api.schemas import Event, JobKind, JobState
from pipeplan.service.cli.console import clean_errors, echo_json, out, say
from pipeplan.service.cli.job_view import event_line, job_lines, jobs_table, render_result
from pipeplan.service.client import (
    Client,
    ClientError,
    ServiceError,
    server_from_env,
    token_from_env,
)

F = TypeVar("F", bound=Callable[..., Any])

ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server", help="service URL (default: PIPEPLAN_SERVER, else http://127.0.0.1:8321)"
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="API token (default: PIPEPLAN_API_TOKEN, else the file PIPEPLAN_API_TOKEN_FILE "
        "names, else the one `pipeplan serve` generated)",
    ),
]
NameOpt = Annotated[str | None, typer.Option("--name", help="a name for the job")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON documents instead")]
JobIdArg = Annotated[str, typer.Argument(help="the job's id")]


def served(fn: F) -> F:
    """The service's refusals and an unreachable server as one line (exit 2; 3 for 5xx),
    on top of :func:`clean_errors`."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ServiceError as e:
            if e.status >= 500:
                say(f"error: the service failed ({e.status}): {e.detail}")
                raise typer.Exit(3) from None
            say(f"error: {e.detail}")
        except ClientError as e:
            say(f"error: {e}")
        raise typer.Exit(2)

    return clean_errors(wrapper)  # type: ignore[return-value]


def connect(server: str | None, token: str | None) -> Client:
    return Client(server or server_from_env(), token or token_from_env())


# --- jobs ---------------------------------------------------------------------------------------

jobs_app = typer.Typer(
    name="jobs", help="The service's jobs: list, show, logs, cancel, events.", no_args_is_help=True
)


@jobs_app.command("ls")
@served
def jobs_ls(
    state: Annotated[JobState | None, typer.Option(help="only jobs in this state")] = None,
    kind: Annotated[JobKind | None, typer.Option(help="only jobs of this kind")] = None,
    limit: Annotated[int | None, typer.Option(help="most jobs to list")] = None,
    cursor: Annotated[str | None, typer.Option(help="the page after this cursor")] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The jobs, newest first."""
    with connect(server, token) as client:
        page = client.list(state, kind, limit, cursor)
    if as_json:
        echo_json(page.model_dump(mode="json"))
        return
    out().print(jobs_table(page))
    if page.next is not None:
        say(f"more: pipeplan jobs ls --cursor {page.next}")


@jobs_app.command("show")
@served
def jobs_show(
    job_id: JobIdArg, server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False
) -> None:
    """A job: its state, and its result as the local command prints it."""
    with connect(server, token) as client:
        job = client.get(job_id)
    if as_json:
        echo_json(job.model_dump(mode="json"))
        return
    for line in job_lines(job):
        typer.echo(line)
    if job.state is JobState.SUCCEEDED:
        render_result(job)


@jobs_app.command("logs")
@served
def jobs_logs(job_id: JobIdArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """The log text of the job's Ray job."""
    with connect(server, token) as client:
        text = client.logs(job_id)
    typer.echo(text, nl=not text.endswith("\n"))


@jobs_app.command("cancel")
@served
def jobs_cancel(job_id: JobIdArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Stop a job (an error if it has ended already)."""
    with connect(server, token) as client:
        job = client.cancel(job_id)
    typer.echo(f"{job.id} {job.state.value}")


def stored_events(client: Client, job_id: str, after: int | None) -> Iterator[Event]:
    """Every stored event after ``after``, a page at a time (the service bounds a page)."""
    while page := client.events(job_id, after):
        yield from page
        after = page[-1].seq


@jobs_app.command("events")
@served
def jobs_events(
    job_id: JobIdArg,
    after: Annotated[int | None, typer.Option(help="only events after this seq")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="until the job ends")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON event per line")] = False,
) -> None:
    """A job's events, oldest first (``--follow``: as they come, until the job ends)."""
    with connect(server, token) as client:
        events = client.follow(job_id, after) if follow else stored_events(client, job_id, after)
        for event in events:
            typer.echo(event.model_dump_json() if as_json else event_line(event))


def register(app: typer.Typer) -> None:
    app.add_typer(jobs_app)
