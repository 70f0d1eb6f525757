"""Bad settings and bad numeric options end in one readable line, through every command (#16 item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import Settings, get_settings
from specbatch.errors import SettingsError


def _invoke(args: list[str], env: dict[str, str]) -> tuple[int, str, BaseException | None]:
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, args, env=env)
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, result.output, exc


@pytest.mark.parametrize("name,value,expected", [
    ("SPECBATCH_CHUNK_SIZE", "eight", "SPECBATCH_CHUNK_SIZE='eight': Input should be a valid integer"),
    ("SPECBATCH_BATCH_SIZE", "0", "SPECBATCH_BATCH_SIZE='0': must be an integer >= 1 or 'auto'"),
    ("SPECBATCH_BATCH_SIZE", "2.5", "SPECBATCH_BATCH_SIZE='2.5': must be an integer >= 1 or 'auto'"),
    ("SPECBATCH_MAX_MEMORY", "lots", "SPECBATCH_MAX_MEMORY='lots': 'lots' is not a size"),
    ("SPECBATCH_THREADS", "-1", "SPECBATCH_THREADS='-1': Input should be greater than or equal to 0"),
    ("SPECBATCH_DATABASE_URL", "mysql://u:S3CRETPW@127.0.0.1/db", "the mysql driver is not installed"),
    ("SPECBATCH_DATABASE_URL", "not a url at all", "not a database URL"),
    # an unencoded "@" in the password: the driver read the rest as the host and printed it
    # ("failed to resolve host 'S3CRETPW@127.0.0.1'"); qa53
    ("SPECBATCH_DATABASE_URL", "postgresql+psycopg://u:pw@S3CRETPW@127.0.0.1:1/db",
     "SPECBATCH_DATABASE_URL='postgresql+psycopg://u:***@127.0.0.1:1/db': the user or password holds "
     "an unencoded '@'; percent-encode it as %40"),
    # (read by engine/packed.py itself before: a warning in the log, the Linears silently unpacked)
    ("SPECBATCH_LINEARS", "blas", "SPECBATCH_LINEARS='blas': Input should be 'auto', 'onednn', 'mkl' or 'off'"),
])
def test_bad_setting_is_one_line(tmp_path: Path, name: str, value: str, expected: str) -> None:
    env = {"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}", name: value}
    code, output, exc = _invoke(["jobs"], env)
    assert exc is None, repr(exc)
    assert code == 2, output   # a usage error, like a bad option
    assert expected in output
    assert "Traceback" not in output and "S3CRETPW" not in output
    assert output.strip().count("\n") == 0, output   # exactly one line


def test_database_url_pointing_at_a_text_file(tmp_path: Path) -> None:
    text = tmp_path / "prompts.jsonl"
    text.write_text('{"prompt": "hi"}\n')
    code, output, exc = _invoke(["jobs"], {"SPECBATCH_DATABASE_URL": f"sqlite:///{text}"})
    assert exc is None, repr(exc)
    assert code == 1 and "is not a SQLite database" in output and "Traceback" not in output
    assert text.read_text() == '{"prompt": "hi"}\n'   # untouched


def test_several_bad_settings_one_line_each() -> None:
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"SPECBATCH_LEASE_SECONDS": "1.5", "SPECBATCH_MAX_ATTEMPTS": "-1",
                           "SPECBATCH_DATABASE_URL": "sqlite://"})
    lines = str(e.value).splitlines()
    assert lines[0] == "bad settings:"
    assert any(line.startswith("SPECBATCH_LEASE_SECONDS='1.5'") for line in lines)
    assert any(line.startswith("SPECBATCH_MAX_ATTEMPTS='-1'") for line in lines)


def test_from_env_reads_only_the_mapping_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECBATCH_CHUNK_SIZE", "5")
    assert Settings.from_env({"SPECBATCH_DATABASE_URL": "sqlite://"}).chunk_size == 8
    assert Settings.from_env({"SPECBATCH_DATABASE_URL": "sqlite://", "SPECBATCH_CHUNK_SIZE": ""}).chunk_size == 8
    get_settings.cache_clear()
    assert get_settings().chunk_size == 5
    with pytest.raises(ValueError):   # frozen: one settings object, never mutated
        get_settings().chunk_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("command", ["run", "worker"])
@pytest.mark.parametrize("size", ["0", "-2"])
def test_batch_size_must_be_positive(tmp_path: Path, command: str, size: str) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    args = [command, *([str(prompts)] if command == "run" else []), "--batch-size", size]
    code, output, exc = _invoke(args, {"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}"})
    assert exc is None, repr(exc)
    assert code == 2 and "--batch-size" in output and "Traceback" not in output
    assert not (tmp_path / "db.sqlite").exists()   # nothing written


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_a_postgres_url_without_a_driver_means_psycopg_3(scheme: str, pg_database: str) -> None:
    """What psql and most hosts print works as is: SQLAlchemy alone would pick psycopg2, which the
    postgres extra does not install, and say the driver is missing."""
    given = pg_database.replace("postgresql+psycopg://", f"{scheme}://")
    assert given != pg_database
    assert Settings.from_env({"SPECBATCH_DATABASE_URL": given}).database_url == pg_database
    code, output, exc = _invoke(["jobs", "--json"], {"SPECBATCH_DATABASE_URL": given})
    assert exc is None and code == 0 and "driver" not in output, output


@pytest.mark.parametrize("command", ["run", "generate", "worker"])
def test_the_linears_setting_reaches_the_engine_of_every_command_that_loads_models(
        tmp_path: Path, tiny_models: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """SPECBATCH_LINEARS is Settings' (config.py reads the environment, the engine none): each
    command that loads models hands it to ``Engine.load``."""
    from specbatch.engine import Engine, threads
    from specbatch.errors import ModelLoadError

    given: list[object] = []

    def load(cls: type, *args: object, **kwargs: object) -> Engine:
        given.append(kwargs.get("linears"))
        raise ModelLoadError("stop here: loading is not what this test is about")

    monkeypatch.setattr(Engine, "load", classmethod(load))
    monkeypatch.setattr(threads, "_SET", [threads.Plan(1, 1, 1, False)])   # this process's threads stay
    env = {"SPECBATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}", "SPECBATCH_LINEARS": "OFF"}
    if command == "worker":      # the worker process's load (its CLI first waits for a broker)
        from specbatch.worker import tasks

        monkeypatch.setenv("SPECBATCH_LINEARS", "OFF")
        get_settings.cache_clear()
        with pytest.raises(ModelLoadError):
            tasks.build_engine({"target": "t"})
        get_settings.cache_clear()
    else:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"prompt": "hi"}\n')
        args = ["run", str(prompts)] if command == "run" else ["generate", "--prompt", "hi"]
        code, output, _ = _invoke([*args, "--target", str(tiny_models / "llama"), "--draft", "none"], env)
        assert code == 1 and "stop here" in output, output
    assert given == ["off"]


def _loads_without_linears(path: Path) -> list[int]:
    """The lines of ``path``'s model loads (``load_model(...)``, ``Engine.load(...)``) that pass no
    ``linears``: neither as a keyword nor in a ``**kw`` dict of that file that names it."""
    import ast

    tree = ast.parse(path.read_text())
    named = {t.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
             and isinstance(node.value, ast.Dict)
             and any(isinstance(k, ast.Constant) and k.value == "linears" for k in node.value.keys)
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if not ((isinstance(f, ast.Name) and f.id == "load_model")
                or (isinstance(f, ast.Attribute) and f.attr == "load" and isinstance(f.value, ast.Name)
                    and f.value.id == "Engine")):
            continue
        if not any(k.arg == "linears" or (k.arg is None and isinstance(k.value, ast.Name) and k.value.id in named)
                   for k in node.keywords):
            out.append(node.lineno)
    return out


def test_every_model_load_passes_the_linears_setting() -> None:
    """SPECBATCH_LINEARS reaches the engine only as ``linears=`` (engine/packed.py read the
    environment itself before): a load that passes none multiplies as "auto" whatever the
    variable says. scripts/ loaded so, so `SPECBATCH_LINEARS=off python scripts/...` measured
    packed Linears without a word (review52)."""
    root = Path(__file__).resolve().parents[2]
    files = sorted([*(root / "specbatch").rglob("*.py"), *(root / "scripts").glob("*.py")])
    missing = {str(p.relative_to(root)): lines for p in files if (lines := _loads_without_linears(p))}
    assert missing == {}
