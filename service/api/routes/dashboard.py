"""The dashboard's pages (``GET /``, a job's page, the cluster page), their server-drawn
fragments, and the login that sets the cookie the pages and their scripts use.

Without a valid login the pages answer 401 with the login form and no data. ``POST
/login`` takes the API token from the form and sets it as an HttpOnly cookie (SameSite=
Strict, Path=/), which the JSON API accepts in place of the header
(:mod:`service.api.auth`); ``POST /logout`` clears it. The pages are left out of the
OpenAPI document: they are HTML for people, not part of the JSON contract.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from pipeplan.service.api.auth import COOKIE, CSRF_HEADER, Principal, identify
from pipeplan.service.api.backend import ClusterSource
from pipeplan.service.api.calibration import MIN_RUNS
from pipeplan.service.api.deps import AppContext, ContextDep
from pipeplan.service.api.routes.events import SEQ_MAX
from pipeplan.service.api.routes.jobs import JobId
from pipeplan.service.api.schemas import Event, EventType, JobKind, JobState
from pipeplan.service.api.store import JobNotFound
from pipeplan.service.web import TEMPLATES_DIR
from pipeplan.service.web.cluster_view import cluster_view
from pipeplan.service.web.format import FILTERS
from pipeplan.service.web.job_plan import plan_panel
from pipeplan.service.web.train_view import MAX_EVENTS, train_curve

MAX_LOGIN_BODY = 4096
"""A login form is one token and a path; a longer body is refused unread."""
PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"
    ),
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
}
"""Every page and fragment: not cached, only this origin's scripts, never in a frame."""

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
templates.env.filters.update(FILTERS)


def user_of(request: Request, context: AppContext) -> Principal | None:
    """The user whose valid token the request holds (the bearer header when sent, as the
    API reads it, else the login cookie), else None. Reads the store."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    header = value.strip() if scheme.lower() == "bearer" else ""
    token = header or request.cookies.get(COOKIE, "")
    if not token:
        return None
    try:
        who = identify(token, context.token.value, context.store)
    except HTTPException:
        return None
    return who if who.is_api else None


def _page(
    request: Request,
    name: str,
    values: dict[str, Any],
    code: int = 200,
    who: Principal | None = None,
) -> Response:
    """A page of the signed-in user ``who`` (named in the header)."""
    context: AppContext = request.app.state.context
    backend = context.backend
    common = {
        "csrf_header": CSRF_HEADER,
        "ray_dashboard": backend.dashboard_url() if isinstance(backend, ClusterSource) else None,
        "signed_in": True,
    }
    return templates.TemplateResponse(
        request, name, common | {"user": who} | values, status_code=code, headers=PAGE_HEADERS
    )


def local_path(candidate: str | None) -> str:
    """``candidate`` when it is a path of this site (``/...``, not ``//host``), else ``/``:
    the login never redirects elsewhere."""
    if not candidate or not candidate.startswith("/") or candidate.startswith("//"):
        return "/"
    parts = urlsplit(candidate)
    if parts.scheme or parts.netloc or "\\" in candidate:
        return "/"
    return candidate


def login_page(
    request: Request, message: str | None = None, code: int = 401, target: str | None = None
) -> Response:
    """The login form (no data), posting to ``/login`` with the page to go to once logged
    in (``target``; default: the page asked for); a stale cookie is cleared."""
    if target is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    values = {"next": local_path(target), "message": message, "signed_in": False}
    response = templates.TemplateResponse(
        request, "login.html", values, status_code=code, headers=PAGE_HEADERS
    )
    if request.cookies.get(COOKIE):
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response


def _stale_cookie(request: Request) -> str | None:
    if request.cookies.get(COOKIE):
        return "The saved login is no longer valid (the token changed?): log in again."
    return None


def _denied_fragment() -> Response:
    return HTMLResponse(
        "<p class='note'>Not logged in: reload the page to log in.</p>",
        status.HTTP_401_UNAUTHORIZED,
        headers=PAGE_HEADERS,
    )


@router.get("/", response_class=HTMLResponse)
async def jobs_page(
    request: Request,
    context: ContextDep,
    state: JobState | None = None,
    kind: JobKind | None = None,
) -> Response:
    """The jobs table, filtered by ``state`` and ``kind`` (the script keeps it live; it
    reads the API, which lists a submitter's own jobs only)."""
    who = await run_in_threadpool(user_of, request, context)
    if who is None:
        return login_page(request, _stale_cookie(request))
    values = {
        "state": state.value if state else "",
        "kind": kind.value if kind else "",
        "states": [s.value for s in JobState],
        "kinds": [k.value for k in JobKind],
    }
    return _page(request, "jobs.html", values, who=who)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(request: Request, job_id: JobId, context: ContextDep) -> Response:
    """One job: its figures, the search chart (a train job's loss and samples/s curve, as
    it stands, in the page), the plan, the log tail (kept live). A submitter sees its own
    jobs only: another's is missing, as in the API."""
    who = await run_in_threadpool(user_of, request, context)
    if who is None:
        return login_page(request, _stale_cookie(request))
    try:
        job = await run_in_threadpool(context.store.get_job, job_id)
        if not who.may_see(job.created_by):
            raise JobNotFound(job_id)
    except JobNotFound as e:
        return _page(request, "missing.html", {"message": str(e)}, 404, who)
    curve = None
    if job.kind is JobKind.TRAIN:
        events = await run_in_threadpool(context.store.events_after, job_id, -1, MAX_EVENTS)
        curve = train_curve(events).to_json()
    return _page(request, "job.html", {"job": job, "train_curve": curve}, who=who)


def _event(context: AppContext, job_id: str, seq: int | None) -> Event | None:
    if seq is None:
        return None
    found = context.store.events_after(job_id, seq - 1, 1)
    if found and found[0].seq == seq and found[0].type is EventType.EVALUATION:
        return found[0]
    return None


@router.get("/jobs/{job_id}/plan", response_class=HTMLResponse)
def plan_fragment(
    request: Request,
    job_id: JobId,
    context: ContextDep,
    seq: Annotated[int | None, Query(ge=0, le=SEQ_MAX)] = None,
) -> Response:
    """The plan panel of the job page: the plan of evaluation ``seq`` (a search's best so
    far), else the job's own; its stages x devices, Gantt chart and measured stage times."""
    who = user_of(request, context)
    if who is None:
        return _denied_fragment()
    try:
        job = context.store.get_job(job_id)
        if not who.may_see(job.created_by):
            raise JobNotFound(job_id)
    except JobNotFound as e:
        return HTMLResponse(f"<p class='note'>{e}</p>", 404, headers=PAGE_HEADERS)
    panel = plan_panel(job, _event(context, job_id, seq), context.profiles)
    return templates.TemplateResponse(
        request, "plan_panel.html", {"panel": panel}, headers=PAGE_HEADERS
    )


@router.get("/cluster", response_class=HTMLResponse)
def cluster_page(request: Request, context: ContextDep) -> Response:
    """Device types, the nodes alive and what they use, links to Ray's dashboard, and the
    calibrations the service fitted from the runs its jobs measured."""
    who = user_of(request, context)
    if who is None:
        return login_page(request, _stale_cookie(request))
    view = cluster_view(context.settings, context.backend, context.store)
    return _page(request, "cluster.html", {"view": view, "min_runs": MIN_RUNS}, who=who)


@router.get("/cluster/nodes", response_class=HTMLResponse)
def cluster_nodes_fragment(request: Request, context: ContextDep) -> Response:
    """The cluster page's live part (its script reloads it)."""
    if user_of(request, context) is None:
        return _denied_fragment()
    view = cluster_view(context.settings, context.backend)
    return templates.TemplateResponse(
        request, "cluster_live.html", {"view": view}, headers=PAGE_HEADERS
    )


async def _form(request: Request) -> dict[str, str] | str:
    """The urlencoded form of ``request`` (first value of each field), or why not."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return f"content-type: expected a form (application/x-www-form-urlencoded), got {kind!r}"
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY:
            return f"body: over {MAX_LOGIN_BODY} bytes"
    fields = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def _login_refusal(token: str, context: AppContext) -> str | None:
    """Why ``token`` may not log in, else None."""
    if not token:
        return "Wrong token."
    try:
        who = identify(token, context.token.value, context.store)
    except HTTPException as e:
        detail = str(e.detail).removeprefix("Authorization: ")
        return "Wrong token." if detail == "unknown token" else f"That {detail}."
    return None if who.is_api else "That is a job's token, not a user's."


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, context: ContextDep) -> Response:
    """Check the form's ``token`` (any user's: the pages then show what its role may see);
    valid: set the cookie and go to ``next``; else the form again (403), saying why when
    the token is known (expired, revoked, a job's)."""
    form = await _form(request)
    if isinstance(form, str):
        return login_page(request, form, status.HTTP_400_BAD_REQUEST, "/")
    token = form.get("token", "").strip()
    target = local_path(form.get("next"))
    refusal = await run_in_threadpool(_login_refusal, token, context)
    if refusal is not None:
        return login_page(request, refusal, status.HTTP_403_FORBIDDEN, target)
    response = RedirectResponse(target, status.HTTP_303_SEE_OTHER, headers=PAGE_HEADERS)
    response.set_cookie(
        COOKIE,
        token,
        httponly=True,
        samesite="strict",
        path="/",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout() -> Response:
    """Clear the cookie; back to the login form."""
    response = RedirectResponse("/", status.HTTP_303_SEE_OTHER, headers=PAGE_HEADERS)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response
