"""``pipeplan tokens create|ls|revoke``: users' tokens of the service, managed by an admin
(:class:`service.client.Client`; the bootstrap token is an admin's).

A token is made for a name with a role (``viewer`` reads; ``submitter`` also submits and
cancels its own jobs; ``admin`` everything) and, optionally, an expiry; its secret is
printed once, when it is made.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from rich.table import Table

from pipeplan.service.api.tokens import Role, Token
from pipeplan.service.cli.console import echo_json, out, say
from pipeplan.service.cli.jobs import JsonOpt, ServerOpt, TokenOpt, connect, served

tokens_app = typer.Typer(
    name="tokens",
    help="Users' tokens of the service (admin): create, ls, revoke.",
    no_args_is_help=True,
)


def expiry(hours: float | None) -> datetime | None:
    """The time ``hours`` from now (None: never); a bad count is a one-line error."""
    if hours is None:
        return None
    if not 0 < hours <= 24 * 366 * 10:
        raise typer.BadParameter(
            f"must be in (0, 87840] hours, got {hours}", param_hint="--expires-in"
        )
    return datetime.now(UTC) + timedelta(hours=hours)


@tokens_app.command("create")
@served
def tokens_create(
    name: Annotated[str, typer.Argument(help="whom the token is for (letters, digits, ._@+-)")],
    role: Annotated[Role, typer.Option("--role", help="what the token may do")] = Role.SUBMITTER,
    expires_in: Annotated[
        float | None, typer.Option("--expires-in", help="hours until it expires (default: never)")
    ] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a token; its secret is printed this once (keep it: only its hash is stored)."""
    with connect(server, token) as client:
        made = client.create_token(name, role, expiry(expires_in))
    if as_json:
        echo_json(made.model_dump(mode="json"))
        return
    say(f"{made.id} {made.name} ({made.role.value}); its secret, shown once:")
    typer.echo(made.token)


def tokens_table(tokens: list[Token]) -> Table:
    table = Table("id", "name", "role", "created", "expires", "state", "by")
    for t in tokens:
        state = "revoked" if t.revoked_at else ("valid" if t.valid else "expired")
        table.add_row(
            t.id,
            t.name,
            t.role.value,
            f"{t.created_at:%Y-%m-%d %H:%M}",
            f"{t.expires_at:%Y-%m-%d %H:%M}" if t.expires_at else "never",
            state,
            t.created_by or "",
        )
    return table


@tokens_app.command("ls")
@served
def tokens_ls(server: ServerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Every token, revoked and expired ones too, oldest first."""
    with connect(server, token) as client:
        tokens = client.tokens()
    if as_json:
        echo_json([t.model_dump(mode="json") for t in tokens])
        return
    out().print(tokens_table(tokens))


@tokens_app.command("revoke")
@served
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="the token's id (tk-...)")],
    server: ServerOpt = None,
    token: TokenOpt = None,
) -> None:
    """Revoke a token: it authenticates no more (its jobs stay)."""
    with connect(server, token) as client:
        gone = client.revoke_token(token_id)
    typer.echo(f"{gone.id} {gone.name} revoked")


def register(app: typer.Typer) -> None:
    app.add_typer(tokens_app)
