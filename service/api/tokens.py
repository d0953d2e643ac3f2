"""The wire format of users' tokens (API.md, "Users"): the roles, ``POST /v1/tokens``'s
body and what the API shows of a token. Apart from the routes and the store, so the client
reads them without importing either."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_TOKEN_NAME = 64


class Role(StrEnum):
    """What a token may do: a ``viewer`` reads; a ``submitter`` also submits jobs and
    cancels its own, and sees only its own; an ``admin`` does everything, tokens included."""

    VIEWER = "viewer"
    SUBMITTER = "submitter"
    ADMIN = "admin"


class TokenCreate(BaseModel):
    """``POST /v1/tokens``: who the token is for, what it may do, until when."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_TOKEN_NAME, pattern=r"^[\w.@+-]+$")
    role: Role
    expires_at: datetime | None = None

    @field_validator("expires_at")
    @classmethod
    def _in_the_future(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        when = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        if when <= datetime.now(UTC):
            raise ValueError(f"must be in the future, got {value.isoformat()}")
        return when


class Token(BaseModel):
    """A token as the API shows it: never its secret."""

    id: str
    name: str
    role: Role
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    created_by: str | None = None
    valid: bool
    """Neither revoked nor expired when it was read."""


class TokenCreated(Token):
    """The new token, with its secret: shown this once."""

    token: str
