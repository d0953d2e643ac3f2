"""Who may call what (API.md, "Auth" and "Users").

Every route but ``/healthz`` needs ``Authorization: Bearer <token>``. A token is one of:

- **the bootstrap token**, the service's own (:func:`settings.resolve_token`): an admin;
- **a user's token**, made with ``POST /v1/tokens`` (stored hashed, :mod:`.store.tokens`),
  with its role: a ``viewer`` reads; a ``submitter`` also submits jobs, and sees and
  cancels only its own (another's job is 404, as if it did not exist); an ``admin`` does
  everything, tokens included;
- **a job's token**, issued for one job when it is submitted (only its hash is stored): it
  may post that job's events and read that job, nothing else.

No token is 401; a token that is none of these, or expired, or revoked, is 401 too (who is
calling is unknown); a known token asking for what its role may not do is 403.

**The dashboard's cookie.** Logging in to the dashboard (``POST /login`` with any user's
token) sets the HttpOnly cookie :data:`COOKIE` (``SameSite=Strict``, ``Path=/``) holding the
token. A request without an ``Authorization`` header may present that cookie instead,
checked in the same way; the header, when sent, is the one that counts, so its rules stay as
they are. A request authenticated by the cookie that changes state (any method but GET,
HEAD and OPTIONS: cancelling a job) must also carry ``X-Pipeplan-CSRF: 1``: a page of
another site cannot set that header without the service's consent (CORS), so it cannot
make a logged-in browser act for it.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from pipeplan.service.api.deps import ContextDep, StoreDep
from pipeplan.service.api.schemas import JOB_ID_PATTERN
from pipeplan.service.api.store import JobNotFound, Store
from pipeplan.service.api.tokens import Role

bearer = HTTPBearer(auto_error=False, description="A user's token (or a job's own token)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
PathJobId = Annotated[str, Path(pattern=JOB_ID_PATTERN)]
"""The path's job id, as the routes declare it (the document states one pattern)."""

BOOTSTRAP = "bootstrap"
"""The id and name the service's own (bootstrap) token goes by."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: a user (``token_id``, ``name``, ``role``), or one job (``job_id``)."""

    job_id: str | None = None
    token_id: str | None = None
    name: str = ""
    role: Role | None = None

    @property
    def is_api(self) -> bool:
        """A user's token (the bootstrap token included), not a job's."""
        return self.job_id is None

    @property
    def sees_all(self) -> bool:
        """Whether it may read every job (an admin or a viewer), not only its own."""
        return self.role in (Role.ADMIN, Role.VIEWER)

    def may_see(self, created_by: str | None) -> bool:
        """Whether a job submitted by the token ``created_by`` is visible to it."""
        return self.sees_all or (self.role is Role.SUBMITTER and created_by == self.token_id)

    def owned(self) -> str | None:
        """The token whose jobs alone it sees (a submitter's own id), else None: all."""
        return None if self.sees_all else self.token_id


ADMIN = Principal(token_id=BOOTSTRAP, name=BOOTSTRAP, role=Role.ADMIN)


def new_job_token() -> str:
    return secrets.token_urlsafe(32)


new_user_token = new_job_token
"""A user's secret: as unguessable as a job's."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


COOKIE = "pipeplan_token"
"""The dashboard's login cookie: the user's token, HttpOnly, SameSite=Strict."""
CSRF_HEADER = "X-Pipeplan-CSRF"
"""What a cookie-authenticated request that changes state must send (value ``1``)."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def unauthorized(why: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        f"Authorization: {why}",
        headers={"WWW-Authenticate": "Bearer"},
    )


def forbidden(why: str) -> HTTPException:
    return HTTPException(status.HTTP_403_FORBIDDEN, f"Authorization: {why}")


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
    raise unauthorized("missing; send 'Authorization: Bearer <token>'")


def is_api_token(token: str, context: ContextDep) -> bool:
    """Whether ``token`` is the bootstrap token (constant time)."""
    return secrets.compare_digest(token.encode(), context.token.value.encode())


def identify(token: str, bootstrap: str, store: Store) -> Principal:
    """Who holds ``token``: the bootstrap token's admin, a user whose token is valid now, or
    a job; else 401 saying why (unknown, expired, revoked). Reads the store (call it off the
    event loop)."""
    if secrets.compare_digest(token.encode(), bootstrap.encode()):
        return ADMIN
    digest = hash_token(token)
    user = store.token_by_hash(digest)
    if user is not None:
        if user.revoked_at is not None:
            raise unauthorized(f"token {user.name!r} ({user.id}) was revoked")
        if not user.valid:
            raise unauthorized(f"token {user.name!r} ({user.id}) expired at {user.expires_at}")
        return Principal(token_id=user.id, name=user.name, role=user.role)
    job_id = store.job_of_token(digest)
    if job_id is not None:
        return Principal(job_id=job_id)
    raise unauthorized("unknown token")


async def caller(credentials: Credentials, request: Request, context: ContextDep) -> Principal:
    """Whoever the request's token names (:func:`identify`), or 401."""
    token = _token(credentials, request)
    if is_api_token(token, context):
        return ADMIN
    return await run_in_threadpool(identify, token, context.token.value, context.store)


def _user(who: Principal, request: Request) -> Principal:
    """``who`` if it is a user that may make this request's method, else 403."""
    if not who.is_api:
        raise forbidden(f"a job's token may not {request.method} {request.url.path}")
    if who.role is Role.VIEWER and request.method not in SAFE_METHODS:
        raise forbidden(
            f"role 'viewer' may only read; {request.method} {request.url.path} needs "
            "'submitter' or 'admin'"
        )
    return who


async def require_api(credentials: Credentials, request: Request, context: ContextDep) -> Principal:
    """A user's token whose role may make the request (a viewer only reads), or 401/403."""
    return _user(await caller(credentials, request, context), request)


async def require_admin(
    credentials: Credentials, request: Request, context: ContextDep
) -> Principal:
    """An admin's token, or 401/403."""
    who = _user(await caller(credentials, request, context), request)
    if who.role is not Role.ADMIN:
        raise forbidden(f"role {who.role}: {request.url.path} needs 'admin'")
    return who


async def require_submitter(
    credentials: Credentials, request: Request, context: ContextDep, store: StoreDep
) -> Principal:
    """A submitter's or admin's token under its limit of open jobs (429 over it), or
    401/403."""
    who = await require_api(credentials, request, context)
    limit = context.settings.max_open_jobs_per_token
    if limit and who.token_id is not None:
        held = await run_in_threadpool(store.open_jobs_of, who.token_id)
        if held >= limit:
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                f"max_open_jobs_per_token: token {who.name!r} has {held} jobs queued or "
                f"running, the limit is {limit}; wait for one to end",
            )
    return who


def _visible(who: Principal, job_id: str, store: Store) -> None:
    """404 (as for a job that does not exist) when ``who`` may not see job ``job_id``."""
    if who.sees_all:
        return
    try:
        created_by = store.get_job(job_id).created_by
    except JobNotFound:
        return  # the route answers 404 itself
    if not who.may_see(created_by):
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(JobNotFound(job_id)))


async def require_job_user(
    job_id: PathJobId,
    credentials: Credentials,
    request: Request,
    context: ContextDep,
    store: StoreDep,
) -> Principal:
    """A user's token that may see job ``job_id`` (a submitter: its own; else 404), or
    401/403."""
    who = await require_api(credentials, request, context)
    await run_in_threadpool(_visible, who, job_id, store)
    return who


async def require_job_access(
    job_id: PathJobId,
    credentials: Credentials,
    request: Request,
    context: ContextDep,
    store: StoreDep,
) -> Principal:
    """The token of job ``job_id`` (the path's job), or a user's that may see it, or
    401/403/404. A job's token hash never changes, so it is read from the store once per
    process (:attr:`~service.api.deps.AppContext.token_hashes`): the control endpoint takes
    every event of a running job through here."""
    token = _token(credentials, request)
    if is_api_token(token, context):
        return ADMIN
    digest = hash_token(token)
    stored = context.token_hashes.get(job_id)
    if stored is None:
        stored = await run_in_threadpool(store.token_hash, job_id)
        if stored is not None:
            context.remember_token_hash(job_id, stored)
    if stored is not None and secrets.compare_digest(digest, stored):
        return Principal(job_id)
    who = await run_in_threadpool(identify, token, context.token.value, store)
    if not who.is_api:
        raise forbidden(f"a job's token may not {request.method} {request.url.path}")
    await run_in_threadpool(_visible, _user(who, request), job_id, store)
    return who


ApiAuth = Annotated[Principal, Depends(require_api)]
"""Any user's token (a viewer's only for reading)."""
SubmitAuth = Annotated[Principal, Depends(require_submitter)]
"""A submitter's or admin's token under its limit of open jobs."""
AdminAuth = Annotated[Principal, Depends(require_admin)]
JobUserAuth = Annotated[Principal, Depends(require_job_user)]
"""A user's token that may see the path's job."""
JobAuth = Annotated[Principal, Depends(require_job_access)]
"""The path's job's own token, or a user's that may see the job."""
