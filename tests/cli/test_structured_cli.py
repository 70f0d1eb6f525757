"""A 48-line JSON-schema job through `specbatch run` on tiny models: every line that finished
("stop") parses and validates against its schema (jsonschema), a line cut at max_tokens says
"length", and each output is token-identical to the target alone under the same grammar."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

# the same tmp SQLite database and CliRunner as the OpenAI CLI tests (db_url is autouse there)
from tests.cli.test_openai_cli import db_url, invoke  # noqa: F401

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "score", "note"],
          "properties": {"label": {"enum": ["fox", "dog", "queue"]},
                         "score": {"type": "integer", "minimum": 0, "maximum": 100},
                         "note": {"type": "string", "maxLength": 8}}}
PROMPTS = ["The quick brown fox", "Write a haiku about queues", "def fibonacci(n):", "Once upon a time"]


@pytest.mark.slow     # 48 requests (about a minute on a shared 2-core CPU)
def test_a_schema_job_validates(tmp_path: Path, tiny_models: Path) -> None:
    from specbatch.engine import Engine, GenerationParams
    from specbatch.engine.grammar import GrammarSpec

    fmt = {"type": "json_schema", "json_schema": {"name": "tag", "schema": SCHEMA, "strict": True}}
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "m", "prompt": PROMPTS[i % 4], "max_tokens": 6 if i == 47 else 60,
                                  "temperature": 0.0 if i % 2 else 0.8, "seed": i,
                                  "structured_outputs": {"json": SCHEMA}}}) if i % 3 == 0 else
             json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": PROMPTS[i % 4]}],
                                  "max_tokens": 6 if i == 47 else 60, "temperature": 0.0 if i % 2 else 0.8,
                                  "seed": i, "response_format": fmt}})
             for i in range(48)]
    llama = str(tiny_models / "llama")
    result = invoke("run", "-", "--target", llama, "--draft", str(tiny_models / "llama-partial"), "--ngram",
                    "--json", stdin=("\n".join(lines) + "\n").encode())
    assert result.exit_code == 0, result.output
    jid = json.loads(result.stdout)["id"]
    out = tmp_path / "out.jsonl"
    assert invoke("export", jid, "-o", str(out)).exit_code == 0
    rows = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, out.read_text().splitlines())}
    assert len(rows) == 48
    stopped = 0
    for body in rows.values():
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
            stopped += 1
        else:
            assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] in (6, 60)
    assert rows["r47"]["choices"][0]["finish_reason"] == "length"   # 6 tokens cannot close the object
    assert stopped >= 40
    # greedy lines are exactly the target alone under the same grammar (no draft, no batch)
    alone = Engine.load(llama)
    params = GenerationParams(max_new_tokens=60, structured=GrammarSpec.json_schema(SCHEMA))
    want = alone.generate(messages=[{"role": "user", "content": PROMPTS[1]}], params=params)
    assert rows["r1"]["choices"][0]["message"]["content"] == want.text
