"""--model-map with the real thing: redis-server, two `specbatch worker` subprocesses holding two
different pairs, `specbatch submit --model-map --wait` from the CLI, then the OpenAI export."""

from __future__ import annotations

import io
import json

import pytest
from click.testing import CliRunner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_submit_routes_each_model_to_the_workers_of_its_pair(cluster) -> None:  # noqa: ANN001
    from specbatch.cli.main import cli
    from specbatch.db import session_factory
    from specbatch.jobs import export
    from tests.jobs.test_export import check_line

    m = cluster.models
    cluster.worker("llama", target="llama", draft="llama-partial")
    cluster.worker("gpt2", target="gpt2", draft="gpt2-partial")
    lines = []
    for i in range(3):
        for model in ("small", "other"):
            lines.append({"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": model, "prompt": f"The quick brown fox {i}", "max_tokens": 5,
                                   "n": 1, "user": "me"}})
    path = cluster.prompts([])
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(cli, [
        "submit", str(path), "--target", str(m / "llama"), "--draft", str(m / "llama-partial"),
        "--model-map", f"small={m / 'llama'},{m / 'llama-partial'}",
        "--model-map", f"other={m / 'gpt2'},{m / 'gpt2-partial'}", "--wait", "--json"], obj={})
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["status"] == "completed" and set(summary["queues"]) == {
        cluster.queue("llama", "llama-partial"), cluster.queue("gpt2", "gpt2-partial")}
    assert "accepted with no effect on the generated text: user (6 lines)" in result.stderr

    workers = {r["custom_id"]: r["worker"] for r in cluster.rows(summary["id"])}
    assert {w.split("@")[0] for c, w in workers.items() if c.startswith("small")} == {"llama"}
    assert {w.split("@")[0] for c, w in workers.items() if c.startswith("other")} == {"gpt2"}
    buf = io.StringIO()
    with session_factory(cluster.settings.database_url, readonly=True).begin() as s:
        export.write_openai(s, summary["id"], buf)
    out = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]       # input order
    for x in out:
        check_line(x)
        want = m / ("llama" if x["custom_id"].startswith("small") else "gpt2")
        assert x["response"]["body"]["model"] == str(want)
