"""An OpenAI batch file through the CLI: `run -` from stdin with --model-map on tiny models (each
request token-identical to its routed target alone), `export --errors` / `--force`, `submit --wait`
and `status --watch`."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch import db
from specbatch.cli.main import cli
from specbatch.config import get_settings
from specbatch.jobs import store
from specbatch.jobs.intake import ParsedRequest
from tests.jobs.test_export import check_line

PARAMS = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}


@pytest.fixture(autouse=True)
def db_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'specbatch.db'}"
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPECBATCH_BROKER_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    yield url
    db.forget_engines()


def invoke(*args: str, stdin: bytes | None = None):
    return CliRunner().invoke(cli, list(args), input=stdin, obj={})


def _line(cid: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_run_stdin_with_model_map_export_pair(tmp_path: Path, tiny_models: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from specbatch.engine import Engine, GenerationParams
    from specbatch.jobs import intake

    # a target whose vocabulary intake cannot read (files only the worker holds): then a prompt
    # token id past it reaches the engine, which refuses that request alone (a local target's
    # vocabulary refuses the line at intake: tests/cli/test_queue_cli.py)
    monkeypatch.setattr(intake, "local_vocab_size", lambda model, cache_dir: None)
    monkeypatch.setattr(intake, "check_token_ids", lambda parsed, name, vocab_of: None)

    llama, gpt2 = str(tiny_models / "llama"), str(tiny_models / "gpt2")
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "name": "ann", "content": [{"type": "text", "text": "The quick brown fox"}]}]
    file = "\n".join([
        _line("chat-a", "/v1/chat/completions", {"model": "model-a", "messages": messages, "max_tokens": 6,
                                                 "presence_penalty": 0.8, "logit_bias": {"7": 2},
                                                 "logprobs": True, "top_logprobs": 2, "store": True,
                                                 "metadata": {"split": "train"}}),
        _line("ids-b", "/v1/completions", {"model": "model-b", "prompt": [10, 11, 12, 13], "max_tokens": 6,
                                           "echo": False}),
        _line("text-b", "/v1/completions", {"model": "model-b", "prompt": "Once upon a time", "max_tokens": 6}),
        # a token id past the vocabulary: valid JSON that only the engine refuses here (above; a
        # prompt too long for the context is refused at intake, before any job exists)
        _line("bad-ids", "/v1/completions", {"model": "model-a", "prompt": [10**6], "max_tokens": 6}),
    ]) + "\n"
    result = invoke("run", "-", "--model-map", f"model-a={llama},{tiny_models / 'llama-partial'}",
                    "--model-map", f"model-b={gpt2},{tiny_models / 'gpt2-partial'}", "--target", llama,
                    "--json", stdin=file.encode())
    assert result.exit_code == 3, result.output   # partial failure (README "Exit status")
    assert ("warning: accepted with no effect on the generated text: echo (1 line), metadata (1 line), "
            "store (1 line); metadata is kept and exported") in result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "completed_with_errors" and summary["source"] == "<stdin>"
    jid = summary["id"]
    (failure,) = summary["failures"]                 # why it exited 3, where the user looks
    assert (failure["line_no"], failure["custom_id"]) == (4, "bad-ids") and "token ids must be in" in failure["error"]
    assert [(r["model"], r["target"], r["requests"]) for r in summary["models"]] == [
        ("model-a", llama, 2), ("model-b", gpt2, 2)]
    shown = invoke("status", jid).stdout
    assert f"model-b: {gpt2} <- {tiny_models / 'gpt2-partial'} (2 requests)" in " ".join(shown.split())

    out, err = tmp_path / "output.jsonl", tmp_path / "errors.jsonl"
    result = invoke("export", jid, "-o", str(out), "--errors", str(err), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"id": jid, "format": "jsonl", "path": str(out), "rows": 3,
                                         "errors_path": str(err), "error_rows": 1}
    lines = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    for x in lines.values():
        check_line(x)
    # each request is exactly what its routed target generates alone (greedy, lossless)
    params = GenerationParams(max_new_tokens=6)
    alone_a, alone_b = Engine.load(llama), Engine.load(gpt2)
    # chat-a's penalty and bias reach the worker: the target alone with the same processors
    processed = GenerationParams(max_new_tokens=6, presence_penalty=0.8, logit_bias={"7": 2}, logprobs=2)
    want = {"chat-a": alone_a.generate(messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "name": "ann",
                                                  "content": "The quick brown fox"}], params=processed),
            "ids-b": alone_b.generate(input_ids=[10, 11, 12, 13], params=params),
            "text-b": alone_b.generate(prompt="Once upon a time", params=params)}
    for cid, ref in want.items():
        body = lines[cid]["response"]["body"]
        got = body["choices"][0]["message"]["content"] if cid == "chat-a" else body["choices"][0]["text"]
        assert got == ref.text, cid
        assert body["usage"]["completion_tokens"] == len(ref.token_ids)
        assert body["model"] == (llama if cid == "chat-a" else gpt2)
        if cid == "chat-a":     # the target's logprobs, two alternatives per token
            content = body["choices"][0]["logprobs"]["content"]
            assert [c["logprob"] for c in content] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
            assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert want["ids-b"].text != alone_a.generate(input_ids=[10, 11, 12, 13], params=params).text
    (bad_ids,) = map(json.loads, err.read_text().splitlines())
    assert check_line(bad_ids).response.status_code == 400
    # named as the line wrote it (prompt), not as the engine takes it (input_ids)
    error = bad_ids["response"]["body"]["error"]
    assert error["param"] == "prompt" and error["message"] == "prompt: token ids must be in [0, 384)", error

    again = invoke("export", jid, "-o", str(out))
    assert again.exit_code == 1 and again.stderr.strip() == f"Error: {out} exists; give --force to overwrite it"
    assert invoke("export", jid, "-o", str(out), "--errors", str(err), "--force").exit_code == 0
    assert invoke("export", jid, "-f", "csv", "-o", str(out), "--errors", str(err)).exit_code == 2


def test_stdin_intake_errors_name_stdin() -> None:
    bad = _line("x", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "n": 129})
    result = invoke("run", "-", stdin=(bad + "\n").encode())
    assert result.exit_code == 1
    assert "<stdin>:1: body.n: must be in [1, 128], got 129" in result.stderr


def _job(url: str, n: int = 3) -> tuple[str, list[int]]:
    reqs = [ParsedRequest(i + 1, f"c{i}", "completion", f"p{i}", None, PARAMS) for i in range(n)]
    with db.session_factory(url).begin() as s:
        job_id = store.create_job(s, target="tgt", drafts=[], params={}, requests=reqs,
                                  queue="q").id
        return job_id, store.resumable_request_ids(s, job_id)


def _finish_later(url: str, job_id: str, ids: list[int], fail: int = 0, delay: float = 0.5) -> threading.Thread:
    """A stand-in worker: after ``delay`` s, completes the requests (``fail`` of them failed)."""
    from tests.jobs.test_store import output

    def work() -> None:
        time.sleep(delay)
        with db.session_factory(url).begin() as s:
            store.claim_requests(s, ids, "w", 60, 3)
            for i, rid in enumerate(ids):
                if i < fail:
                    store.record_failure(s, rid, "bad prompt", "w")
                else:
                    store.record_result(s, rid, output(), "w")
            store.refresh_job(s, job_id)

    t = threading.Thread(target=work)
    t.start()
    return t


@pytest.mark.parametrize("fail", [0, 1])
def test_submit_wait_exits_by_outcome(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      fail: int) -> None:
    import specbatch.worker.enqueue as enqueue
    import specbatch.worker.monitor as monitor

    threads: list[threading.Thread] = []

    def fake_enqueue(settings, job_id, routes, job_queue, ngram):
        ids = [i for v in routes.values() for i in v]
        threads.append(_finish_later(db_url, job_id, ids, fail=fail))
        return {job_queue: 1}

    monkeypatch.setattr(enqueue, "check_broker", lambda settings: None)
    monkeypatch.setattr(enqueue, "enqueue_routes", fake_enqueue)
    monkeypatch.setattr(monitor, "queue_workers",
                        lambda settings, queue, **_: [monitor.WorkerView("w@h", True, None)])
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    if fail:
        result = invoke("submit", str(path), "--wait", "--json")
    else:       # from standard input
        result = invoke("submit", "-", "--wait", "--json", stdin=path.read_bytes())
    for t in threads:
        t.join()
    summary = json.loads(result.stdout)
    if fail:
        assert result.exit_code == 1
        assert summary["status"] == "completed_with_errors"
        assert result.stderr.strip().splitlines()[-1] == (
            f"Error: job {summary['id']} ended completed_with_errors: 1 completed, 1 failed, 0 cancelled; "
            f"`specbatch export {summary['id']} --errors errors.jsonl` lists them")
    else:
        assert result.exit_code == 0, result.output
        assert summary["status"] == "completed" and summary["request_counts"]["completed"] == 2
        assert summary["source"] == "<stdin>"


def test_status_watch_refreshes_until_the_job_ends(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import specbatch.worker.monitor as monitor

    monkeypatch.setattr(monitor, "queue_workers",
                        lambda settings, queue, **_: [monitor.WorkerView("w@h", True, None)])
    job_id, ids = _job(db_url)
    t = _finish_later(db_url, job_id, ids, delay=0.6)
    result = invoke("status", job_id, "--watch", "--interval", "0.2", "--json")
    t.join()
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "completed"

    job2, ids2 = _job(db_url)
    t = _finish_later(db_url, job2, ids2, delay=0.6)
    result = invoke("status", job2, "--watch", "--interval", "0.2")
    t.join()
    assert result.exit_code == 0, result.output
    assert "completed" in result.stdout and "completed 3" in result.stdout
    assert result.stdout.endswith("\n")         # piped, the last line had no newline


def test_shell_completion() -> None:
    """The README's completion line: Click's bash script for `specbatch`, and it completes commands."""
    result = CliRunner().invoke(cli, [], prog_name="specbatch", env={"_SPECBATCH_COMPLETE": "bash_source"})
    assert result.exit_code == 0 and "_SPECBATCH_COMPLETE=bash_complete" in result.output
    result = CliRunner().invoke(cli, [], prog_name="specbatch",
                                env={"_SPECBATCH_COMPLETE": "bash_complete", "COMP_WORDS": "specbatch exp",
                                     "COMP_CWORD": "1"})
    assert result.output.strip().splitlines() == ["plain,export"]


def test_version() -> None:
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0 and version("specbatch") in result.output


def test_run_loads_the_jobs_own_pair_again_after_a_routed_pair(tiny_models: Path) -> None:
    """Routes run in the order of their first request: a --model-map route first, then the lines
    that name no mapped model (the job's own pair) must run on the job's target again, not on the
    routed pair still loaded."""
    from specbatch.engine import Engine, GenerationParams

    llama, gpt2 = str(tiny_models / "llama"), str(tiny_models / "gpt2")
    file = "\n".join([
        _line("routed", "/v1/completions", {"model": "model-b", "prompt": "Once upon a time", "max_tokens": 6}),
        _line("own", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6}),   # no model
    ]) + "\n"
    result = invoke("run", "-", "--model-map", f"model-b={gpt2}", "--target", llama, "--json",
                    stdin=file.encode())
    assert result.exit_code == 0, result.output
    jid = json.loads(result.stdout)["id"]
    out = invoke("export", jid).stdout
    lines = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, out.splitlines())}
    params = GenerationParams(max_new_tokens=6)
    assert lines["routed"]["model"] == gpt2 and lines["own"]["model"] == llama
    assert lines["routed"]["choices"][0]["text"] == Engine.load(gpt2).generate(prompt="Once upon a time",
                                                                               params=params).text
    assert lines["own"]["choices"][0]["text"] == Engine.load(llama).generate(prompt="Once upon a time",
                                                                             params=params).text
