"""`submit` of a known model whose weights package is not installed here: queued (the workers may
run where the weights are; `submit` reads no weights), with a warning that names the model and
the pip command. Real redis-server, SQLite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings
from specbatch.engine.known_models import KNOWN_MODELS, QWEN_PIP
from tests.worker.services import RedisServer

pytestmark = pytest.mark.integration


def test_a_known_model_without_its_weights_here_is_queued_with_the_pip_hint(
        redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    if any(importlib.util.find_spec(KNOWN_MODELS[n].packages[0]) for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")):
        pytest.skip("the Qwen weights are installed here")
    monkeypatch.setenv("SPECBATCH_BROKER_URL", redis_server.url)
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'sb.db'}")
    get_settings.cache_clear()
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "prompt": "hi"}) + "\n")
    result = CliRunner().invoke(cli, ["submit", str(path), "--target", "qwen2.5-coder-1.5b",
                                      "--draft", "qwen2.5-coder-0.5b", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 1
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        package = KNOWN_MODELS[name].packages[0]
        assert (f"warning: model {name!r}: weights are not installed (missing {package}); install them "
                f"with: {QWEN_PIP}") in result.stderr, result.stderr
