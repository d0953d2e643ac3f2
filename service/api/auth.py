"""Who may call what (API.md, "Auth").

Every route but ``/healthz`` needs ``Authorization: Bearer <token>``: no header is 401, a
wrong token 403 (compared with :func:`secrets.compare_digest`). The API token may do
everything. A **job token** is issued for one job when it is submitted (only its hash is
stored): it may post that job's events and read that job, nothing else.

**The dashboard's cookie.** Logging in to the dashboard (``POST /login`` with the API
token) sets the HttpOnly cookie :data:`COOKIE` (``SameSite=Strict``, ``Path=/``) holding the
token. A request without an ``Authorization`` header may present that cookie instead,
compared in the same way (a wrong one is 403); the header, when sent, is the one that counts,
so its rules stay as they are. A request authenticated by the cookie that changes state
(any method but GET, HEAD and OPTIONS: cancelling a job) must also carry
``X-Pipeplan-CSRF: 1``: a page of another site cannot set that header without the service's
consent (CORS), so it cannot make a logged-in browser act for it.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from pipeplan.service.api.deps import ContextDep, StoreDep

bearer = HTTPBearer(auto_error=False, description="The API token (or a job's own token)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


@dataclass(frozen=True)
class Principal:
    """Who is calling: the API token's holder, or one job (``job_id``)."""

    job_id: str | None = None

    @property
    def is_api(self) -> bool:
        return self.job_id is None


def new_job_token() -> str:
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


COOKIE = "pipeplan_token"
"""The dashboard's login cookie: the API token, HttpOnly, SameSite=Strict."""
CSRF_HEADER = "X-Pipeplan-CSRF"
"""What a cookie-authenticated request that changes state must send (value ``1``)."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _token(credentials: HTTPAuthorizationCredentials | None, request: Request) -> str:
    """The bearer token of the header, else the dashboard's cookie, else 401."""
    if credentials is not None and credentials.credentials:
        return credentials.credentials
    cookie = request.cookies.get(COOKIE)
    if cookie:
        if request.method not in SAFE_METHODS and request.headers.get(CSRF_HEADER) != "1":
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"{CSRF_HEADER}: missing; a {request.method} authenticated by the dashboard's "
                f"cookie must send '{CSRF_HEADER}: 1'",
            )
        return cookie
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        "Authorization: missing; send 'Authorization: Bearer <token>'",
        headers={"WWW-Authenticate": "Bearer"},
    )


def is_api_token(token: str, context: ContextDep) -> bool:
    """Whether ``token`` is the API token (constant time)."""
    return secrets.compare_digest(token.encode(), context.token.value.encode())


async def require_api(credentials: Credentials, request: Request, context: ContextDep) -> Principal:
    """The API token, or 401/403 (``async``: no I/O, so no thread pool hop)."""
    if not is_api_token(_token(credentials, request), context):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "Authorization: wrong token")
    return Principal()


async def require_job_access(
    job_id: str, credentials: Credentials, request: Request, context: ContextDep, store: StoreDep
) -> Principal:
    """The API token, or the token of job ``job_id`` (the path's job), or 401/403. A job's
    token hash never changes, so it is read from the store once per process
    (:attr:`~service.api.deps.AppContext.token_hashes`): the control endpoint takes every
    event of a running job through here."""
    token = _token(credentials, request)
    if is_api_token(token, context):
        return Principal()
    stored = context.token_hashes.get(job_id)
    if stored is None:
        stored = await run_in_threadpool(store.token_hash, job_id)
        if stored is not None:
            context.remember_token_hash(job_id, stored)
    if stored is None or not secrets.compare_digest(hash_token(token), stored):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "Authorization: wrong token")
    return Principal(job_id)


ApiAuth = Annotated[Principal, Depends(require_api)]
JobAuth = Annotated[Principal, Depends(require_job_access)]
