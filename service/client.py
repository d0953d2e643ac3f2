"""A Python client of the pipeplan service (``../shared/API.md``), over httpx.

>>> client = Client("http://127.0.0.1:8321", token)            # doctest: +SKIP
>>> job = client.submit("plan", {"cluster": "local-hetero", "model": "alexnet",
...                              "planner": "dp"})              # doctest: +SKIP
>>> done = client.wait(job.id, on_event=print)                 # doctest: +SKIP
>>> done.result["estimate"]["batch_time_s"]                    # doctest: +SKIP

Every answer of the service outside 2xx raises :class:`ServiceError` with its status and the
service's one-line ``detail``; a server that cannot be reached raises
:class:`ServiceUnreachable` naming its URL. :func:`server_from_env` and :func:`token_from_env`
read ``PIPEPLAN_SERVER``, ``PIPEPLAN_API_TOKEN`` and ``PIPEPLAN_API_TOKEN_FILE`` (and then the
token file ``pipeplan serve`` generates for this user).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Generator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from pipeplan.service.api.schemas import ENDING_EVENTS, Event, Job, JobKind, JobPage, JobState
from pipeplan.service.api.settings import config_dir
from pipeplan.service.api.tokens import Role, Token, TokenCreate, TokenCreated

Tokens = list[Token]

DEFAULT_SERVER = "http://127.0.0.1:8321"
TIMEOUT_S = 30.0
"""Of one request (connect, read)."""
STREAM_READ_S = 120.0
"""Longest silence on a live event stream (the service sends a comment while it waits)."""
RECONNECT_S = 60.0
"""How long :meth:`Client.follow` waits for a service that went away (a restart)."""
END = "end"
"""The event that closes a live stream once its job has ended (no seq, not stored)."""
POLL_S = 0.5
"""Between two polls when the service does not stream events."""
WAIT_MARGIN_S = 10.0
"""A long poll's read timeout is its wait and this."""
ENDING_WAIT_S = 10.0
"""How long one read of a job whose ending event has arrived waits for its state to
follow (``GET /v1/jobs/{id}?wait=S``)."""

EventCallback = Callable[[Event], None]
Events = list[Event]
Streamed = tuple[Events, bool]
Step = tuple[bool, int | None, bool]
"""Whether the job has ended, the last seq seen, whether the service streams."""
"""A stream's events, and whether the service streams (else: poll)."""


class ClientError(Exception):
    """The service could not answer the request as asked."""


class ServiceError(ClientError):
    """The service answered with an error status (4xx: the request; 5xx: the service)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class ServiceUnreachable(ClientError):
    """No service answered at the server URL."""


class TokenError(ClientError):
    """No API token could be found, or its file could not be read."""


def default_token_file() -> Path:
    """Where ``pipeplan serve`` writes the token it generates (``$XDG_CONFIG_HOME``)."""
    return config_dir() / "api_token"


def server_from_env() -> str:
    """``PIPEPLAN_SERVER``, else the default ``http://127.0.0.1:8321``."""
    return os.environ.get("PIPEPLAN_SERVER") or DEFAULT_SERVER


def token_from_env() -> str:
    """``PIPEPLAN_API_TOKEN``, else the file ``PIPEPLAN_API_TOKEN_FILE`` names, else the
    token ``pipeplan serve`` generated for this user."""
    token = os.environ.get("PIPEPLAN_API_TOKEN")
    if token:
        return token.strip()
    named = os.environ.get("PIPEPLAN_API_TOKEN_FILE")
    path = Path(named) if named else default_token_file()
    try:
        token = path.read_text().strip()
    except OSError as e:
        how = "PIPEPLAN_API_TOKEN_FILE" if named else "no PIPEPLAN_API_TOKEN and the default"
        raise TokenError(f"token: cannot read {path} ({how}): {e.strerror or e}") from e
    if not token:
        raise TokenError(f"token: {path} is empty")
    return token


def error_detail(response: httpx.Response) -> str:
    """The service's one-line ``detail`` (FastAPI's shape), else the body's first line."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip().splitlines()
        return text[0] if text else response.reason_phrase or f"HTTP {response.status_code}"
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]  # a validation error the service left in FastAPI's list form
        where = ".".join(str(p) for p in first.get("loc", ())) or "request"
        return f"{where}: {first.get('msg')}, got {first.get('input')!r}"
    return detail if isinstance(detail, str) else json.dumps(detail)


def parse_sse(lines: Iterator[str]) -> Iterator[Event]:
    """Server-sent events into :class:`Event` s: each ``data:`` is a stored event's
    document, or its ``data`` alone with the seq in ``id:`` and the type in ``event:``;
    comments (``: waiting``) are skipped, and ``event: end`` (the job is over) ends them."""
    fields: dict[str, str] = {}
    data: list[str] = []
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            elif name in ("id", "event"):
                fields[name] = value
            continue
        if fields.get("event") == END:
            return
        if data:
            yield _sse_event(fields, "\n".join(data))
        fields, data = {}, []
    if data and fields.get("event") != END:
        yield _sse_event(fields, "\n".join(data))


def _sse_event(fields: dict[str, str], data: str) -> Event:
    doc = json.loads(data)
    if isinstance(doc, dict) and "seq" in doc and "type" in doc:
        return Event.model_validate(doc)
    return Event.model_validate(
        {
            "seq": int(fields["id"]),
            "type": fields["event"],
            "data": doc,
            "received_at": time.time(),
        }  # fmt: skip
    )


def _events_of(body: Any) -> Events:
    items = body.get("items", []) if isinstance(body, dict) else body
    return [Event.model_validate(e) for e in items]


class Client:
    """The service at ``server`` (``http://host:port``), as the holder of ``token``.

    ``http`` is the httpx client to send with (a FastAPI ``TestClient`` in tests); by default
    one of the client's own, closed by :meth:`close` (or a ``with`` block).
    """

    def __init__(self, server: str, token: str, http: httpx.Client | None = None) -> None:
        self.server = server.rstrip("/")
        self._auth = {"Authorization": f"Bearer {token}"}
        self._own = http is None
        self.http = http if http is not None else httpx.Client(timeout=TIMEOUT_S)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.http.close()

    # --- requests ---------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return f"{self.server}{path}"

    def _unreachable(self, e: httpx.TransportError) -> ServiceUnreachable:
        return ServiceUnreachable(
            f"server: no pipeplan service answers at {self.server} ({type(e).__name__}: {e}); "
            "start one with `pipeplan serve` or set --server / PIPEPLAN_SERVER"
        )

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self._auth, **kwargs.pop("headers", {})}
        try:
            response = self.http.request(method, self._url(path), headers=headers, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        if response.is_error:
            raise ServiceError(response.status_code, error_detail(response))
        return response

    # --- jobs -------------------------------------------------------------------------

    def submit(
        self, kind: JobKind | str, spec: dict[str, Any], name: str | None = None, **fields: Any
    ) -> Job:
        """Validate, store and start a job; the service answers 422 for a bad spec.
        ``fields``: the job's own fields beside its spec (``priority``, ``deadline_s``,
        ``retries``)."""
        body = {"kind": str(kind), "spec": spec, "name": name, **fields}
        return Job.model_validate(self._send("POST", "/v1/jobs", json=body).json())

    def get(self, job_id: str, wait: float | None = None) -> Job:
        """The job; with ``wait`` (seconds, at most ``MAX_WAIT_S``), the service answers as
        soon as the job has ended, or with the job as it is after ``wait`` seconds."""
        params: dict[str, str] = {}
        extra: dict[str, Any] = {}
        if wait is not None:
            params["wait"] = str(wait)
            if wait + WAIT_MARGIN_S > TIMEOUT_S:  # a read that outlasts the usual timeout
                extra["timeout"] = httpx.Timeout(wait + WAIT_MARGIN_S)
        response = self._send("GET", f"/v1/jobs/{job_id}", params=params, **extra)
        return Job.model_validate(response.json())

    def list(
        self,
        state: JobState | str | None = None,
        kind: JobKind | str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> JobPage:
        """One page of jobs, newest first; pass its ``next`` as ``cursor`` for the next."""
        query = {"state": state, "kind": kind, "limit": limit, "cursor": cursor}
        params = {k: str(v) for k, v in query.items() if v is not None}
        return JobPage.model_validate(self._send("GET", "/v1/jobs", params=params).json())

    def cancel(self, job_id: str) -> Job:
        """Stop the job; 409 (a :class:`ServiceError`) when it had ended already."""
        return Job.model_validate(self._send("POST", f"/v1/jobs/{job_id}/cancel").json())

    def logs(self, job_id: str) -> str:
        """The log text of the job's Ray job."""
        response = self._send("GET", f"/v1/jobs/{job_id}/logs")
        if "json" not in response.headers.get("content-type", ""):
            return response.text
        body = response.json()
        return body if isinstance(body, str) else str(body.get("logs", ""))

    def events(self, job_id: str, after: int | None = None) -> Events:
        """The job's stored events after seq ``after``, oldest first."""
        params = {} if after is None else {"after": str(after)}
        return _events_of(self._send("GET", f"/v1/jobs/{job_id}/events", params=params).json())

    # --- following a job ----------------------------------------------------------------

    def follow(
        self, job_id: str, after: int | None = None, reconnect_s: float = RECONNECT_S
    ) -> Iterator[Event]:
        """The job's events after ``after`` as they come, until the job has ended: a live
        stream (``text/event-stream``) while the service gives one, else polling. A service
        that goes away (a restart) is waited for up to ``reconnect_s`` seconds."""
        last, streaming, lost = after, True, None
        while True:
            try:
                ended, last, streaming = yield from self._step(job_id, last, streaming)
            except ServiceUnreachable:
                lost = lost if lost is not None else time.monotonic()
                if time.monotonic() - lost > reconnect_s:
                    raise
                time.sleep(POLL_S)
                continue
            lost = None
            if ended:
                return

    def _step(self, job_id: str, last: int | None, streaming: bool) -> Generator[Event, None, Step]:
        """The events one stream (or one poll) brings; returns whether the job has ended,
        the last seq seen, and whether to stream again."""
        if streaming:
            got, streaming = yield from self._stream(job_id, last)
        else:
            got = self.events(job_id, last)
            yield from got
        if got:
            return got[-1].type in ENDING_EVENTS, got[-1].seq, streaming
        if self.get(job_id).state.terminal:
            rest = self.events(job_id, last)  # any posted before the state changed
            yield from rest
            return True, rest[-1].seq if rest else last, streaming
        if not streaming:
            time.sleep(POLL_S)
        return False, last, streaming

    def _stream(self, job_id: str, after: int | None) -> Generator[Event, None, Streamed]:
        """One live stream's events (or the JSON answer of a service that does not
        stream); returns (the events, whether to stream again)."""
        params = {} if after is None else {"after": str(after)}
        headers = {**self._auth, "Accept": "text/event-stream"}
        url = self._url(f"/v1/jobs/{job_id}/events")
        timeout = httpx.Timeout(TIMEOUT_S, read=STREAM_READ_S)
        got: Events = []
        try:
            with self.http.stream(
                "GET", url, params=params, headers=headers, timeout=timeout
            ) as response:
                if response.is_error:
                    response.read()
                    raise ServiceError(response.status_code, error_detail(response))
                if "text/event-stream" not in response.headers.get("content-type", ""):
                    got = _events_of(json.loads(response.read()))
                    yield from got
                    return got, False
                for event in parse_sse(response.iter_lines()):
                    got.append(event)
                    yield event
        except httpx.TransportError as e:
            if not got:
                raise self._unreachable(e) from e
        return got, True

    def wait(self, job_id: str, on_event: EventCallback | None = None) -> Job:
        """Follow the job to its end, handing each event to ``on_event``; the ended job."""
        for event in self.follow(job_id):
            if on_event is not None:
                on_event(event)
        job = self.get(job_id)
        while not job.state.terminal:  # the ending event is stored before the state changes
            job = self.get(job_id, wait=ENDING_WAIT_S)
            if not job.state.terminal:
                time.sleep(POLL_S)  # a service without ``wait`` answers at once
        return job

    # --- users' tokens (admin) ------------------------------------------------------------

    def create_token(
        self, name: str, role: Role | str, expires_at: datetime | None = None
    ) -> TokenCreated:
        """A new token for ``name``; its secret is in this answer only."""
        body = TokenCreate(name=name, role=Role(role), expires_at=expires_at)
        doc = self._send("POST", "/v1/tokens", json=body.model_dump(mode="json"))
        return TokenCreated.model_validate(doc.json())

    def tokens(self) -> Tokens:
        """Every token, revoked and expired ones too, oldest first."""
        return [Token.model_validate(t) for t in self._send("GET", "/v1/tokens").json()]

    def revoke_token(self, token_id: str) -> Token:
        return Token.model_validate(self._send("DELETE", f"/v1/tokens/{token_id}").json())
