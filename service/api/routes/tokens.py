"""``/v1/tokens``: users' tokens, made, listed and revoked by an admin (API.md, "Users").

A token's secret is answered once, when it is made; the store keeps only its hash.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status
from starlette.concurrency import run_in_threadpool

from pipeplan.service.api.auth import AdminAuth, hash_token, new_user_token
from pipeplan.service.api.deps import StoreDep
from pipeplan.service.api.routes.jobs import refuse_other_methods
from pipeplan.service.api.schemas import error_responses
from pipeplan.service.api.store.tokens import TokenNotFound
from pipeplan.service.api.tokens import Token, TokenCreate, TokenCreated

TOKEN_ID_PATTERN = r"^tk-[0-9a-f]{1,32}$"
TokenId = Annotated[str, Path(pattern=TOKEN_ID_PATTERN, description="The token's id")]

router = APIRouter(
    prefix="/v1/tokens", tags=["tokens"], responses=error_responses(400, 401, 403, 413, 422)
)


@router.post("", status_code=status.HTTP_201_CREATED)
def create_token(create: TokenCreate, who: AdminAuth, store: StoreDep) -> TokenCreated:
    """Make a token for ``name`` with ``role``; its secret is in this answer only."""
    secret = new_user_token()
    record = store.create_token(
        create.name, create.role, hash_token(secret), create.expires_at, who.token_id
    )
    return TokenCreated(**record.model_dump(), token=secret)


@router.get("")
def list_tokens(_: AdminAuth, store: StoreDep) -> list[Token]:
    """Every token made here, revoked and expired ones too, oldest first."""
    return store.list_tokens()


@router.delete("/{token_id}", responses=error_responses(404))
async def revoke_token(token_id: TokenId, _: AdminAuth, store: StoreDep) -> Token:
    """Revoke the token: from now on it authenticates no more (its jobs stay)."""
    try:
        record = await run_in_threadpool(store.revoke_token, token_id)
    except TokenNotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from None
    return record


refuse_other_methods(router, "", ("GET", "POST"))
