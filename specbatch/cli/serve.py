"""``specbatch serve``: the OpenAI-compatible Batch API (specbatch.api) under uvicorn."""

from __future__ import annotations

import inspect
import ipaddress
import os
import socket

import click

from specbatch.cli.common import require_extra
from specbatch.config import Settings, get_settings
from specbatch.plural import plural

# what the api extra installs that the server imports (pyproject.toml; uvloop and httptools are
# optional speed-ups uvicorn takes when present)
API_MODULES = ("fastapi", "uvicorn", "python_multipart", "swagger_ui")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False        # a host name: it may resolve to anything


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; any non-loopback address needs SPECBATCH_API_KEYS.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (in use: one line, exit 1).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              help="Server log level; debug also logs every request.")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Server processes sharing the port (one Python process uses about one core).")
@click.option("--health-port", type=click.IntRange(1, 65535), default=None,
              help="Also answer GET /healthz on this port (same host), from a thread of each server "
                   "process: not queued behind the API's requests under load. /healthz stays on the API port.")
@click.option("--allow-remote-models", is_flag=True,
              help="Take specbatch_target/specbatch_draft names this machine cannot check (paths only "
                   "the workers hold, known models whose weights only they have installed); same as "
                   "SPECBATCH_ALLOW_REMOTE_MODELS=1.")
def serve(host: str, port: int, log_level: str, workers: int, health_port: int | None,
          allow_remote_models: bool) -> None:
    """Serve OpenAI's Files and Batches API (plus /healthz and /metrics) over the job queue.

    Clients use the official `openai` package with base_url="http://HOST:PORT/v1" and one of the
    keys in SPECBATCH_API_KEYS (comma-separated) as api_key. Batches become jobs for `specbatch
    worker`s; the server never loads a model. Files go to SPECBATCH_FILES_DIR.

    \b
    Example:
      specbatch serve                                   # 127.0.0.1:8000, no key needed
      SPECBATCH_API_KEYS=k1,k2 specbatch serve --host 0.0.0.0 --port 8000
      specbatch serve --workers 2                       # both cores of a 2-core machine
      specbatch serve --workers 2 --health-port 8001    # probes: /healthz on 8000 and 8001
    """
    # some of the extra's modules are imported only as the app is built, after the database is opened
    require_extra("api", API_MODULES, "the HTTP API")
    try:
        import uvicorn

        from specbatch.api.app import create_app, swagger_ui_static

        swagger_ui_static()     # /docs' files (the extra's swagger-ui-py)
    except ImportError as e:      # installed without the extra: say which one
        raise click.ClickException(f"the HTTP API needs the api extra ({e}): "
                                   "pip install 'specbatch[api]'") from e
    from specbatch.cli.common import open_db

    settings = get_settings()
    if allow_remote_models:
        settings = settings.model_copy(update={"allow_remote_models": True})
    if health_port is not None:
        if health_port == port:
            raise click.UsageError("--health-port must differ from --port")
        settings = settings.model_copy(update={"health_port": health_port, "health_host": host})
    keys = settings.api_key_list
    if not keys and not is_loopback(host):
        raise click.UsageError(f"refusing to serve on {host} without keys: set SPECBATCH_API_KEYS "
                               "(comma-separated) or bind 127.0.0.1")
    sock = bind(host, port)         # a busy port fails here, as one line, before anything is opened
    port = sock.getsockname()[1]    # --port 0: the one the system chose, which the line below says
    open_db(settings, create=True)      # a bad database URL fails here, as one line
    _warn_default_weights(settings)
    app = create_app(settings) if workers == 1 else None
    click.echo(f"specbatch API on http://{host}:{port}/v1 ({plural(len(keys), 'key')}; "
               f"{'no authentication' if not keys else 'bearer keys required'}"
               f"{f'; {workers} processes' if workers > 1 else ''})", err=True)
    if app is not None:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug")
        uvicorn.Server(config).run(sockets=[sock])
        return
    # several processes, spawned: each builds its own app from the environment (the flag above
    # travels as its variable) and, where the system allows, accepts on a socket of its own
    from specbatch.api.processes import can_share_port, reuseport_sockets, supervise

    if allow_remote_models:
        os.environ["SPECBATCH_ALLOW_REMOTE_MODELS"] = "1"
    if health_port is not None:
        os.environ.update(SPECBATCH_HEALTH_PORT=str(health_port), SPECBATCH_HEALTH_HOST=host)
    config = uvicorn.Config("specbatch.api.app:app_from_env", factory=True, host=host, port=port,
                            workers=workers, log_level=log_level, access_log=log_level == "debug")
    if can_share_port():
        if supervise(config, reuseport_sockets(sock, workers)):
            raise click.ClickException("the server processes failed to start (their log is above)")
        return
    from uvicorn.supervisors import Multiprocess

    # uvicorn before 0.30 takes the process body as target=; later ones build it themselves
    takes_target = "target" in inspect.signature(Multiprocess).parameters
    extra = {"target": uvicorn.Server(config).run} if takes_target else {}
    Multiprocess(config, sockets=[sock], **extra).run()

def _warn_default_weights(settings: Settings) -> None:
    """A warning per model of the default pair (batches whose metadata names none) whose weights are
    not installed here, as `submit` warns: the workers may hold them. A batch naming such a model in
    its metadata is refused (api.metadata.check_weights): the client chose it, and sees no warning."""
    from specbatch.cli.common import warn
    from specbatch.engine.drafter_specs import model_names, parse_drafters
    from specbatch.engine.known_models import missing_weights
    from specbatch.errors import ModelLoadError

    # the draft setting is a drafter spec ("model:NAME", a pool): its models, as submit reads them
    try:
        drafts = model_names(parse_drafters([settings.default_draft]))
    except ModelLoadError:     # not a drafter spec: the batches that use it are refused, each saying why
        drafts = []
    names = [settings.default_target, *drafts]
    for hint in filter(None, map(missing_weights, dict.fromkeys(names))):
        warn(f"{hint} (the default pair, for batches whose metadata names no model: the workers must hold it)")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (as uvicorn binds one), or a one-line ClickException:
    uvicorn itself logs the OSError and exits 3."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise click.ClickException(f"cannot serve on {host}:{port}: {e.strerror or e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise click.ClickException(f"cannot serve on {host}:{port}: {e.strerror or e}; pick another "
                                   "--port or stop what listens there") from e
    sock.set_inheritable(True)
    return sock
