"""The service's settings, from one place: ``PIPEPLAN_*`` environment variables, overridden
by ``pipeplan serve``'s flags (``Settings(**flags)``).

:func:`get_settings` is cached; tests build their own :class:`Settings` and hand them to
:func:`~service.api.app.create_app`. The API token is resolved as API.md says
(:func:`resolve_token`), and :func:`check_bind` refuses a non-loopback host without an
explicit token.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 2**20
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


class SettingsError(ValueError):
    """Settings the service refuses to start with; the message names the setting."""


class Settings(BaseSettings):
    """What ``pipeplan serve`` runs with (every field: ``PIPEPLAN_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="PIPEPLAN_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8321, ge=0, le=65535)
    db: str | None = None
    """SQLAlchemy URL; ``None``: SQLite under ``$XDG_DATA_HOME/pipeplan/pipeplan.db``."""
    ray_address: str | None = None
    """A Ray cluster's dashboard (Jobs API) address to join; ``None``: the embedded one."""
    cluster: str = "local-hetero"
    """The embedded cluster: a preset name or a cluster file."""
    api_token: SecretStr | None = None
    api_token_file: Path | None = None
    server_url: str | None = None
    """The URL jobs reach the service at; ``None``: ``http://HOST:PORT`` (loopback for a
    wildcard host)."""
    max_body_bytes: int = Field(default=32 * MiB, ge=1)
    reconcile_every_s: float = Field(default=5.0, ge=0)
    """How often unfinished jobs are reconciled with the backend while the service runs
    (0: only at start)."""
    log_tail_chars: int = Field(default=2000, ge=0)
    """How much of a failed job's log its error keeps (reconcile)."""
    sse_poll_s: float = Field(default=0.5, gt=0)
    """How often a live event stream looks for new events."""
    pool_size: int | None = Field(default=None, ge=0, le=64)
    """Workers of the planner pool: long-lived Ray actors that run the jobs needing no
    device (cost-model plans and comparisons, profiles without ``measure``) without a Ray
    Job's start-up, at most this many at once (0: no pool; every job is a Ray Job; ``None``:
    the cluster's CPUs minus one, at least one and at most 64)."""
    pool_address: str | None = None
    """The Ray cluster's GCS address (``host:port``) the pool's workers start on; ``None``:
    the embedded cluster's. Joining a cluster by ``ray_address`` without it, the service
    runs without a pool."""
    ray_namespace: str = Field(default="pipeplan", min_length=1, max_length=64)
    """The Ray namespace of the service's own actors (the planner pool's workers)."""
    allow_code: bool = False
    """Whether a job may name code to import (``model``, ``example``: ``package.module:attr``).
    Off, such a job is refused (422); on, the code is imported inside the job's Ray Job,
    never in the API process. Turn it on only where every API user may run code there."""
    jobs_dir: Path | None = None
    """Where each job's folder is (``JOBS_DIR/JOB_ID``: a train job's checkpoints when its
    request names no ``checkpoint_dir``); ``None``: ``$XDG_DATA_HOME/pipeplan/jobs``. The
    job's Ray Job writes there, so on a cluster of several machines it is a shared path."""
    queue_every_s: float = Field(default=1.0, ge=0)
    """How often the queue starts the held jobs whose turn it is and fails those past their
    deadline (:mod:`service.api.queue`; 0: only when a job is submitted, and at start)."""
    max_open_jobs_per_token: int = Field(default=200, ge=0)
    """How many jobs one token may have queued or running at once; one more is refused
    with 429 (0: no limit). The bootstrap token counts too."""

    @property
    def database_url(self) -> str:
        if self.db:
            return self.db
        return f"sqlite:///{data_dir() / 'pipeplan.db'}"

    @property
    def jobs_root(self) -> Path:
        """The folder of every job's folder (``jobs_dir``, else under the data folder)."""
        return self.jobs_dir if self.jobs_dir is not None else data_dir() / "jobs"

    @property
    def public_url(self) -> str:
        if self.server_url:
            return self.server_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def explicit_token(self) -> bool:
        """Whether the token was given (variable or file), not generated."""
        return self.api_token is not None or self.api_token_file is not None


@lru_cache
def get_settings() -> Settings:
    """The settings of this process (cached; ``get_settings.cache_clear()`` re-reads)."""
    return Settings()


def _xdg(variable: str, default: str) -> Path:
    value = os.environ.get(variable)
    return Path(value) if value else Path.home() / default


def data_dir() -> Path:
    """``$XDG_DATA_HOME/pipeplan`` (``~/.local/share/pipeplan``)."""
    return _xdg("XDG_DATA_HOME", ".local/share") / "pipeplan"


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/pipeplan`` (``~/.config/pipeplan``)."""
    return _xdg("XDG_CONFIG_HOME", ".config") / "pipeplan"


@dataclass(frozen=True)
class ApiToken:
    """The API token and where it came from (``path``: the file it was read from or
    generated into; ``None``: the environment variable)."""

    value: str
    path: Path | None = None
    generated: bool = False


def _read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise SettingsError(f"api_token_file: cannot read {str(path)!r}: {e.strerror}") from None
    if not token:
        raise SettingsError(f"api_token_file: {str(path)!r} is empty")
    return token


def _generated_token(path: Path) -> ApiToken:
    """The token in ``path``, generated there once (mode 0600) when the file is missing."""
    if path.exists():
        return ApiToken(_read_token_file(path), path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process generated it first
        return ApiToken(_read_token_file(path), path)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return ApiToken(token, path, generated=True)


def resolve_token(settings: Settings) -> ApiToken:
    """``PIPEPLAN_API_TOKEN``, else ``PIPEPLAN_API_TOKEN_FILE``, else a token generated
    once into ``$XDG_CONFIG_HOME/pipeplan/api_token`` (mode 0600)."""
    if settings.api_token is not None:
        token = settings.api_token.get_secret_value().strip()
        if not token:
            raise SettingsError("api_token: empty")
        return ApiToken(token)
    if settings.api_token_file is not None:
        return ApiToken(_read_token_file(settings.api_token_file), settings.api_token_file)
    return _generated_token(config_dir() / "api_token")


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    """Refuse to bind a non-loopback host without an explicit token (API.md, "Start")."""
    if not is_loopback(settings.host) and not settings.explicit_token:
        raise SettingsError(
            f"host: {settings.host!r} is not a loopback address; binding it needs an explicit "
            "token (PIPEPLAN_API_TOKEN or PIPEPLAN_API_TOKEN_FILE)"
        )
