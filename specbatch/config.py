"""Settings: the only module that reads the environment (SPECBATCH_* variables).

One pydantic-settings model: every field is ``SPECBATCH_<NAME>``; adding a setting is one typed
line with a default. A bad value is a ``SettingsError`` with one line per bad variable (its value
shown with any credentials masked), never a traceback.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from specbatch.device_names import DEVICE_HINT, DEVICE_NAME
from specbatch.errors import SettingsError
from specbatch.redact import mask

ENV_PREFIX = "SPECBATCH_"
Positive = Annotated[int, Field(ge=1)]


def _user_dir(xdg_var: str, fallback: str) -> Path:
    base = os.environ.get(xdg_var) or str(Path.home() / fallback)
    return Path(base) / "specbatch"


def _default_database_url() -> str:
    return f"sqlite:///{_user_dir('XDG_DATA_HOME', '.local/share') / 'specbatch.db'}"


def _default_files_dir() -> str:
    return str(_user_dir("XDG_DATA_HOME", ".local/share") / "files")


def _default_cache_dir() -> str:
    return str(_user_dir("XDG_CACHE_HOME", ".cache"))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore",
                                      env_ignore_empty=True, case_sensitive=False)

    database_url: str = Field(default_factory=_default_database_url)
    broker_url: str = "redis://127.0.0.1:6379/0"
    cache_dir: str = Field(default_factory=_default_cache_dir)
    visibility_timeout: Positive = 3600   # seconds; above the longest task
    lease_seconds: Positive = 300         # a claimed request's lease, renewed while working
    lease_sweep_seconds: Positive = 30    # how often a worker queues again what a dead worker held
    max_attempts: Positive = 3            # a request that kills its worker this often is failed
    chunk_size: Positive = 8              # request ids per Celery task
    max_requests: Positive = 100_000      # per prompt file
    max_line_bytes: Positive = 1_000_000  # per JSONL line
    default_target: str = "smollm2-135m"
    default_draft: str = "smollm2-135m-int8"
    # submit/serve: take model names this machine cannot check (paths only the workers hold)
    allow_remote_models: bool = False
    device: str = "cpu"                   # cpu, cuda, cuda:N or mps (the machine's are checked at load)
    # (engine/loading.py's DTYPES maps each name to torch's dtype)
    dtype: Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] = "float32"
    batch_size: int | str = "auto"        # "auto" (the throughput autopilot) or rows decoded together
    max_memory: str = ""                  # KV cache + activations budget, e.g. "8GiB"; "": a share of free
    threads: int = Field(default=0, ge=0)  # torch CPU threads; 0: usable cores / local_workers, capped by OMP_NUM_THREADS
    local_workers: Positive = 1           # worker processes started together on this machine
    lanes: Positive = 1                   # decode loops a process runs over its models (engine/lanes.py)
    processes: Positive = 1               # `specbatch run`: processes decoding after one load (worker/forked.py)
    compile: Literal["auto", "on", "off", "static"] = "auto"   # compiled forward, or static: docs/COMPILE.md
    prefix_cache: bool = True             # shared prompt prefixes computed once (engine/prefix.py)
    # how float32 CPU Linears multiply (engine/packed.py): auto multiplies weights of llama.cpp's blocks as
    # such (engine/blocks.py) and picks a packed kernel by the CPU's vendor for the rest
    linears: Literal["auto", "onednn", "mkl", "off"] = "auto"
    flower_user: str = "admin"
    flower_password: str = ""
    flower_port: int = Field(default=5555, ge=1, le=65535)
    metrics_port: int = Field(default=0, ge=0, le=65535)  # `specbatch worker` serves /metrics here; 0: off
    metrics_address: str = "0.0.0.0"
    broker_timeout: float = Field(default=5.0, gt=0)  # seconds: connect/read bound on every broker call
    # `specbatch worker` started while the broker is down: seconds it waits for it, then exits 1
    broker_wait_seconds: float = Field(default=60.0, ge=0)
    breaker_max_backoff: float = Field(default=60.0, gt=0)  # seconds between outage probes, at most
    target_failure_limit: Positive = 3    # consecutive target (engine) failures before unhealthy
    ready_dir: str = ""                   # worker readiness files (default: a tmp dir per user)
    api_keys: str = Field(default="", repr=False)  # comma-separated bearer keys of `specbatch serve`
    files_dir: str = Field(default_factory=_default_files_dir)  # the HTTP API's uploads and outputs
    max_upload_bytes: Positive = 200_000_000  # per uploaded file (OpenAI's batch file limit)
    # `specbatch serve`: routes run at once per process (threads, DB connections). Not more: 40
    # threads contending for the GIL cost ~10% more CPU per request and starved the event loop
    # (/healthz p50 55-150 ms vs 15-25 ms under 200 clients, docs/bench/api-load.md). Since the
    # reads are plain rows (2026-12-03), 8 rather than 16: /healthz p50 0.41x on PostgreSQL, req/s 1.19x
    api_threads: Positive = 8
    api_public_docs: bool = False         # `specbatch serve`: /docs and /openapi.json without a key
    # `specbatch serve --health-port`: GET /healthz also on this port, answered by a thread of its
    # own (api/health.HealthPort); set by the flag, with the API's host, for every server process
    health_port: int | None = None
    health_host: str = "127.0.0.1"

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, url: str) -> str:
        url = normalize_database_url(url)
        check_database_url(url)
        return url

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, url: str) -> str:
        return normalize_broker_url(url)

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, value: object) -> int | str:
        from specbatch.engine.autopilot import check_batch_size

        return check_batch_size(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not DEVICE_NAME.fullmatch(value.strip()):
            raise ValueError(DEVICE_HINT)
        return value.strip()

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, value: str) -> str:
        # (raised only where no key is in it: nothing secret is echoed)
        if value and not any(k.strip() for k in value.split(",")):
            raise ValueError("set, but names no key: give comma-separated keys, or leave it unset for none")
        return value

    @field_validator("linears", mode="before")
    @classmethod
    def _linears(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value   # MKL, " off " as written

    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, value: str) -> str:
        from specbatch.engine.memory import parse_bytes

        if value:
            parse_bytes(value)
        return value

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        env = _ENV_OVERRIDE.get("env")
        if env is not None:
            return init_settings, _MappingEnvSource(settings_cls, env)
        return init_settings, env_settings

    @property
    def api_key_list(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.api_keys.split(",") if k.strip())

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``env`` (default ``os.environ``); raises SettingsError on bad values."""
        _ENV_OVERRIDE["env"] = None if env is None else dict(env)
        try:
            return cls()
        except ValidationError as e:
            raise SettingsError(describe(e)) from None
        finally:
            _ENV_OVERRIDE["env"] = None


# from_env(mapping) hands its mapping to settings_customise_sources through here (classmethods
# take no extra arguments); only ever set for the duration of one construction.
_ENV_OVERRIDE: dict[str, dict[str, str] | None] = {"env": None}


class _MappingEnvSource(EnvSettingsSource):
    """The environment source, reading a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._mapping = dict(env)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k.lower(): v for k, v in self._mapping.items() if v != ""}


def normalize_database_url(url: str) -> str:
    """``postgres://`` and ``postgresql://`` (no driver named, as psql and most hosts write them)
    mean psycopg 3, the driver ``specbatch[postgres]`` installs; SQLAlchemy would pick psycopg2."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql+psycopg://{rest}" if sep and scheme in ("postgres", "postgresql") else url


def normalize_broker_url(url: str) -> str:
    """A Redis URL's ``?password=`` (and ``?username=``), which redis-py reads, moved into the URL's
    user part: kombu hands query parameters to its connection as keyword arguments and fails with
    "got multiple values for keyword argument 'password'". Other URLs are returned unchanged."""
    from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.query:
        return url
    query = parse_qsl(parts.query, keep_blank_values=True)
    given = {k: [v for name, v in query if name == k] for k in ("username", "password")}
    if not any(given.values()):
        return url
    if any(len(v) > 1 for v in given.values()) or (given["password"] and parts.password is not None) or \
            (given["username"] and parts.username):
        raise ValueError("gives the Redis user or password twice (in the URL's user part and as a "
                         "?username=/?password= parameter): keep one")
    # the query's values are decoded, the user part's are not (urlsplit keeps them percent-encoded)
    user = quote(given["username"][0], safe="") if given["username"] else (parts.username or "")
    password = quote(given["password"][0], safe="") if given["password"] else parts.password
    userinfo = user + (f":{password}" if password is not None else "")
    netloc = f"{userinfo}@{parts.netloc.rpartition('@')[2]}"
    rest = urlencode([(k, v) for k, v in query if k not in given])
    return urlunsplit((parts.scheme, netloc, parts.path, rest, parts.fragment))


def check_database_url(url: str) -> None:
    """ValueError unless ``url`` is a SQLAlchemy URL whose driver is installed."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        u = make_url(url)
        dialect = u.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as e:
        raise ValueError(f"is not a database URL ({mask(str(e))})") from None
    if u.host and "@" in u.host:
        # SQLAlchemy ends the password at its first "@", so the rest of it became the host, which
        # the driver's error then prints ("failed to resolve host 'rest@host'"): say nothing of it
        # (no example URL: the masking of every message would hide its password part)
        raise ValueError("the user or password holds an unencoded '@'; percent-encode it as %40 "
                         "(the password p@ss is written p%40ss)")
    try:
        dialect.import_dbapi()
    except ImportError as e:
        extra = " (pip install 'specbatch[postgres]')" if u.get_backend_name() == "postgresql" else ""
        raise ValueError(f"the {u.drivername} driver is not installed: {e}{extra}") from None
    if u.get_backend_name() == "sqlite" and u.database and Path(u.database).expanduser().is_dir():
        raise ValueError(f"{u.database} is a directory, not a SQLite database file")
    # (whether an existing file is a SQLite database is checked where it is opened, in
    # specbatch.db: reading it here would drop this process's SQLite locks on it, see there)


def describe(error: ValidationError) -> str:
    """One line per bad setting: ``SPECBATCH_BATCH_SIZE='0': must be >= 1``."""
    lines = []
    for err in error.errors():
        name = str(err["loc"][0]) if err.get("loc") else "?"
        value: Any = err.get("input")
        shown = mask(str(value)) if isinstance(value, str | int | float) else ""
        msg = mask(str(err.get("msg", "invalid")))
        msg = msg.removeprefix("Value error, ")
        lines.append(f"{ENV_PREFIX}{name.upper()}={shown!r}: {msg}")
    return "bad settings:\n" + "\n".join(lines) if len(lines) > 1 else lines[0]


def otel_traces_exporters(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The span exporters the standard OTEL_* variables ask for (("otlp",), ("console",), ...).

    Empty, so tracing is off, unless OTEL_TRACES_EXPORTER names one or an OTLP endpoint
    (OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; OTEL_SDK_DISABLED
    switches it off. The OpenTelemetry SDK reads the other OTEL_* variables itself.
    """
    env = dict(os.environ if env is None else env)
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    return tuple(n for n in names if n != "none")


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings. Tests call ``get_settings.cache_clear()`` after changing env."""
    return Settings.from_env()
