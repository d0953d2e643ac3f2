"""Users: the ``tokens`` table and :class:`TokenStore`, which reads its rows as the API
shows them (:class:`~service.api.tokens.Token`, ``valid`` as of the read). A token has a
name, a role and an optional expiry; only the SHA-256 of its secret is stored, so the
secret is shown once, when it is made. Revoking keeps the row (who made which job stays
readable) and stamps ``revoked_at``; a revoked or expired token authenticates no more.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import Column, DateTime, MetaData, Row, String, Table, Text, insert, select, update

from pipeplan.service.api.store.calibrations import CalibrationStore
from pipeplan.service.api.store.database import now, utc
from pipeplan.service.api.tokens import Role, Token


class TokenNotFound(LookupError):
    def __init__(self, token_id: str) -> None:
        super().__init__(f"token {token_id!r}: no such token")
        self.token_id = token_id


def new_token_id() -> str:
    return f"tk-{secrets.token_hex(6)}"


def token_table(metadata: MetaData, prefix: str) -> Table:
    return Table(
        f"{prefix}tokens",
        metadata,
        Column("id", String(32), primary_key=True),
        Column("name", Text, nullable=False),
        Column("role", String(16), nullable=False),
        Column("secret_hash", String(64), unique=True, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("expires_at", DateTime(timezone=True)),
        Column("revoked_at", DateTime(timezone=True)),
        Column("created_by", String(32)),
    )


class TokenStore(CalibrationStore):
    """The tokens in the database at ``url`` (table ``{prefix}tokens``), beside the
    calibration tables of :class:`CalibrationStore`."""

    def __init__(self, url: str, prefix: str = "") -> None:
        super().__init__(url, prefix)
        self.tokens = token_table(self.metadata, prefix)

    def _token(self, row: Row[Any]) -> Token:
        m = row._mapping
        expires, revoked = utc(m["expires_at"]), utc(m["revoked_at"])
        return Token(
            id=m["id"],
            name=m["name"],
            role=Role(m["role"]),
            created_at=utc(m["created_at"]) or now(),
            expires_at=expires,
            revoked_at=revoked,
            created_by=m["created_by"],
            valid=revoked is None and (expires is None or now() < expires),
        )

    def create_token(
        self,
        name: str,
        role: Role,
        secret_hash: str,
        expires_at: datetime | None = None,
        created_by: str | None = None,
    ) -> Token:
        """A new token whose secret hashes to ``secret_hash``."""
        token_id = new_token_id()
        with self.engine.begin() as conn:
            conn.execute(
                insert(self.tokens).values(
                    id=token_id,
                    name=name,
                    role=role.value,
                    secret_hash=secret_hash,
                    created_at=now(),
                    expires_at=expires_at,
                    created_by=created_by,
                )
            )
        return self.get_token(token_id)

    def get_token(self, token_id: str) -> Token:
        with self.engine.connect() as conn:
            row = conn.execute(select(self.tokens).where(self.tokens.c.id == token_id)).first()
        if row is None:
            raise TokenNotFound(token_id)
        return self._token(row)

    def token_by_hash(self, secret_hash: str) -> Token | None:
        """The token whose secret hashes to ``secret_hash`` (valid or not), else None."""
        query = select(self.tokens).where(self.tokens.c.secret_hash == secret_hash)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else self._token(row)

    def list_tokens(self) -> list[Token]:
        """Every token, revoked and expired ones too, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(self.tokens).order_by(self.tokens.c.created_at)).all()
        return [self._token(r) for r in rows]

    def revoke_token(self, token_id: str) -> Token:
        """Stamp ``revoked_at`` (once: revoking again keeps the first time)."""
        with self.engine.begin() as conn:
            conn.execute(
                update(self.tokens)
                .where(self.tokens.c.id == token_id, self.tokens.c.revoked_at.is_(None))
                .values(revoked_at=now())
            )
        return self.get_token(token_id)
