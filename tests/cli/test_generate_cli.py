"""specbatch generate / models through the real Click entry point, on tiny models.

``generate --json`` prints one object, a contract other tools parse:
{"text", "token_ids" (new tokens only), "finish_reason", "stats"}.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specbatch.cli.main import cli
from specbatch.config import get_settings

DESIGN_FIELDS = {"drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
                 "accepted_per_position", "target_forwards", "draft_forwards", "draft_seconds",
                 "verify_seconds", "wall_seconds", "tokens_per_second"}
KNOWN = {"smollm2-135m", "smollm2-135m-int8", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-int8",
         "qwen2.5-coder-1.5b"}
PROMPT = "Write a haiku about"


@pytest.fixture(autouse=True)
def isolated_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    monkeypatch.setenv("SPECBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECBATCH_DEVICE", "cpu")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def run(*args: str):
    return CliRunner().invoke(cli, list(args), obj={})


def models(tiny_models, *names: str) -> list[str]:
    return [str(tiny_models / n) for n in names]


def target_greedy(model_dir, prompt: str, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def generate_json(tiny_models, *extra: str, target: str = "llama", drafts=("llama-partial",)) -> dict:
    args = ["generate", "--target", str(tiny_models / target)]
    for d in drafts:
        args += ["--draft", str(tiny_models / d)]
    r = run(*args, *extra, "--json")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    return json.loads(r.stdout)


def test_generate_json_contract(tiny_models):
    out = generate_json(tiny_models, "--prompt", PROMPT, "--max-new-tokens", "24")
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    assert out["token_ids"] == target_greedy(tiny_models / "llama", PROMPT, 24)
    assert out["finish_reason"] in ("stop", "length")
    assert isinstance(out["text"], str)
    assert DESIGN_FIELDS <= set(out["stats"])
    s = out["stats"]
    assert s["accepted_tokens"] <= s["drafted_tokens"]
    assert s["new_tokens"] == len(out["token_ids"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_pool_with_ngram_is_exact(tiny_models, arch):
    out = generate_json(tiny_models, "--ngram", "--prompt", "def fibonacci(n):", "--max-new-tokens", "40",
                        target=arch, drafts=(f"{arch}-partial", f"{arch}-random"))
    assert out["token_ids"] == target_greedy(tiny_models / arch, "def fibonacci(n):", 40)
    names = set(models(tiny_models, f"{arch}-partial", f"{arch}-random")) | {"ngram"}
    assert set(out["stats"]["pool_wins"]) <= names
    assert len(out["stats"]["step_winners"]) == out["stats"]["verify_steps"]


def test_generate_ngram_only(tiny_models):
    out = generate_json(tiny_models, "--ngram", "--prompt", PROMPT, "--max-new-tokens", "16", drafts=())
    assert out["token_ids"] == target_greedy(tiny_models / "llama", PROMPT, 16)
    assert out["stats"]["draft_forwards"] == 0


def test_generate_draft_none_is_the_target_alone_and_takes_threads(tiny_models):
    """As on run: --draft none decodes with the target alone; --threads is accepted as on run."""
    r = run("generate", "--target", str(tiny_models / "llama"), "--draft", "none", "--prompt", PROMPT,
            "--max-new-tokens", "12", "--threads", "1", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["token_ids"] == target_greedy(tiny_models / "llama", PROMPT, 12)
    assert out["stats"]["drafted_tokens"] == 0 and out["stats"]["draft_forwards"] == 0
    mixed = run("generate", "--target", str(tiny_models / "llama"), "--draft", "none", "--draft",
                str(tiny_models / "llama-partial"), "--prompt", PROMPT)
    assert mixed.exit_code == 2 and "'none' cannot be combined with other drafts" in mixed.stderr


def test_generate_fixed_gamma(tiny_models):
    out = generate_json(tiny_models, "--prompt", PROMPT, "--max-new-tokens", "20", "--gamma", "3",
                        "--fixed-gamma", drafts=("llama-same",))
    assert out["stats"]["final_gamma"] == 3 and out["stats"]["speculation_disabled"] is False
    assert out["stats"]["acceptance_rate"] == 1.0


def test_generate_messages_and_stop(tiny_models):
    full = generate_json(tiny_models, "--message", "hello", "--max-new-tokens", "24")
    text = full["text"]
    if len(text) < 4:
        pytest.skip("the tiny model's reply is too short to cut")
    stop = text[2:4]
    cut = generate_json(tiny_models, "--message", "hello", "--max-new-tokens", "24", "--stop", stop)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.index(stop)]


@pytest.mark.parametrize("gamma_mode", [
    "--fixed-gamma",
    "",  # adaptive gamma: the seed fixes the sample, not the drafting (engine/sampling.py, RowNoise)
])
def test_generate_sampling_is_reproducible_with_a_seed(tiny_models, gamma_mode):
    args = ["--prompt", PROMPT, "--max-new-tokens", "40", "--temperature", "0.9", "--top-p", "0.9",
            "--top-k", "50", "--seed", "7"] + ([gamma_mode] if gamma_mode else [])
    runs = [generate_json(tiny_models, *args)["token_ids"] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) >= 1


def test_generate_human_output(tiny_models):
    r = run("generate", "--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"),
            "--prompt", PROMPT, "--max-new-tokens", "8")
    assert r.exit_code == 0, r.output
    assert "tokens" in r.stderr and "acceptance" in r.stderr
    assert not r.stdout.lstrip().startswith("{")


def test_generate_says_on_stderr_which_models_load(tiny_models):
    """A first load takes a minute or more: `generate` printed nothing until the text came."""
    target, draft = str(tiny_models / "llama"), str(tiny_models / "llama-partial")
    r = run("generate", "--target", target, "--draft", draft, "--prompt", PROMPT, "--max-new-tokens", "4")
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == f"loading {target} and its draft {draft} ...", r.stderr
    assert "loading" not in r.stdout


BAD = {
    "empty prompt": (["--prompt", ""], ["prompt", "empty"]),
    "whitespace prompt": (["--prompt", "   "], ["prompt", "empty"]),
    "top-p 0": (["--prompt", "hi", "--top-p", "0"], ["--top-p", "0<x<=1"]),
    "top-p > 1": (["--prompt", "hi", "--top-p", "1.5"], ["--top-p", "0<x<=1"]),
    "temperature < 0": (["--prompt", "hi", "--temperature", "-1"], ["--temperature", "0<=x<=2"]),
    "temperature > 2": (["--prompt", "hi", "--temperature", "5"], ["--temperature", "0<=x<=2"]),
    "max-new-tokens 0": (["--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens", "x>=1"]),
    "gamma too large": (["--prompt", "hi", "--gamma", "100"], ["--gamma", "0<=x<=64"]),
    "beyond context": (["--prompt", "hi", "--max-new-tokens", "600"], ["512", "context"]),
    "unknown device": (["--prompt", "hi", "--device", "tpu"], ["tpu"]),
    "unknown dtype": (["--prompt", "hi", "--dtype", "float64"], ["float64"]),
    "no prompt": ([], ["--prompt", "--message"]),
    "prompt and message": (["--prompt", "hi", "--message", "hi"], ["--prompt", "--message"]),
    "max-new-tokens not a number": (["--prompt", "hi", "--max-new-tokens", "many"], ["max-new-tokens"]),
}


@pytest.mark.parametrize(("command", "option", "value"), [
    (c, o, v) for c in ("generate", "run", "worker", "bench") for o, v in (("--device", "cpux"),
                                                                                   ("--dtype", "float23"))])
def test_a_device_or_dtype_typo_is_a_usage_error_before_anything_loads(command, option, value, tmp_path):
    r = run(command, *([str(tmp_path / "none.jsonl")] if command in ("run", "submit") else []),
            option, value)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.stderr and value in r.stderr, r.stderr


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_readable_line(tiny_models, case):
    extra, words = BAD[case]
    r = run("generate", "--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"),
            *extra, "--json")
    assert r.exit_code != 0
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    # --json: the failure is one JSON document on stdout too (README), never a result's shape
    assert set(json.loads(r.stdout)) == {"error"} and json.loads(r.stdout)["error"]["exit_code"] == r.exit_code
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in r.stderr, (case, r.stderr)


def test_missing_target_path(tmp_path):
    missing = tmp_path / "no-such-model"
    r = run("generate", "--target", str(missing), "--prompt", "hi", "--json")
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit)
    assert str(missing) in r.stderr and "Traceback" not in r.output


def test_draft_with_another_tokenizer(tiny_models, tmp_path):
    """A draft whose vocabulary differs: the error names both models."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.engine.test_errors import _build_other_tokenizer

    out = tmp_path / "foreign"
    _build_other_tokenizer(out, 320)
    tok = AutoTokenizer.from_pretrained(out)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
                     ).save_pretrained(out)
    r = run("generate", "--target", str(tiny_models / "llama"), "--draft", str(out), "--prompt", "hi", "--json")
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit)
    assert str(out) in r.stderr and str(tiny_models / "llama") in r.stderr
    assert "Traceback" not in r.output


def test_debug_flag_shows_the_exception(tiny_models):
    r = CliRunner().invoke(cli, ["--debug", "generate", "--target", str(tiny_models / "llama"),
                                 "--prompt", ""], obj={})
    assert r.exit_code != 0
    from specbatch.errors import RequestError

    assert isinstance(r.exception, RequestError)


def test_models_json():
    r = run("models", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert {row["name"] for row in rows} == KNOWN and len(rows) == 5
    for row in rows:
        assert {"name", "description", "installed", "install"} <= set(row)
        assert isinstance(row["installed"], bool)


@pytest.mark.parametrize("columns", ["80", "40", "200"])
def test_models_table(columns, monkeypatch):
    """Install commands print whole on one line each, whatever the terminal's width (a table
    cell folded them mid-word at 80 columns), with no markup eaten."""
    monkeypatch.setenv("COLUMNS", columns)
    r = run("models")
    assert r.exit_code == 0, r.output
    for name in KNOWN:
        assert name in r.stdout
    from specbatch.engine.loading import known_model_status

    lines = r.stdout.splitlines()
    for row in known_model_status():
        if not row["installed"]:
            (line,) = [x for x in lines if x.endswith(": " + row["install"])]
            assert row["name"] in line.split(": ")[0].split(", "), line


def test_generate_plans_its_compile_for_one_row(tiny_models, monkeypatch):
    """One prompt decodes at batch 1, so a compiled forward warms only the single-row graphs
    (planning for the autopilot's 8-row prior warmed two batched graphs nothing used)."""
    import specbatch.engine.engine as engine_mod
    from specbatch.engine.compile.decision import CompilePlan
    from specbatch.engine.compile.warmup import warm_shapes

    planned: list[int] = []

    def fake_prepare(target, drafts, *, mode, batch_size, cache_dir, expected_new_tokens=None, notify=None):
        planned.append(batch_size)
        return CompilePlan(mode, False, "recorded by the test")

    monkeypatch.setattr(engine_mod, "prepare_compiled", fake_prepare)
    generate_json(tiny_models, "--prompt", PROMPT, "--max-new-tokens", "4", "--compile", "on")
    assert planned == [1]
    assert warm_shapes(1) != warm_shapes(8)  # the plan decides which graphs warm


def test_the_cli_says_before_compiling_that_it_compiles_and_about_how_long(tiny_models, tmp_path,
                                                                          monkeypatch, capsys):
    """Minutes of compiling must not be a silent wait: prepare tells ``notify`` before each model
    compiles, and the CLI's notifier prints it (the CLI logs at WARNING, so a log line would not)."""
    from specbatch.cli.compile_text import compiling_notice
    from specbatch.engine.compile import prepare as P
    from specbatch.engine.compile import record as R
    from specbatch.engine.compile import warmup as W
    from specbatch.engine.loading import load_model

    order: list[str] = []
    monkeypatch.setattr(W, "warm_up", lambda lm, shapes, cache_dir, **_: order.append("warm") or
                        R.CompileReport(model=lm.name, enabled=True))
    monkeypatch.setattr(W, "compare_not_frozen", lambda lm, shapes, cache_dir, report, **_: report)
    target = load_model(str(tiny_models / "llama"))

    def notify(notice: P.CompileNotice) -> None:
        order.append("notice")
        compiling_notice(notice)

    P.prepare(target, [], mode="on", batch_size=1, cache_dir=tmp_path, notify=notify)
    assert order == ["notice", "warm"]
    err = capsys.readouterr().err
    # a first start here compiles them frozen and not, and keeps freezing only where it pays (docs/COMPILE.md)
    assert (f"specbatch: {target.name}: compiling 2 graphs before decoding, frozen and not frozen to compare "
            "them here, about ") in err
    assert "s (compile on)" in err


@pytest.mark.parametrize("command", ["generate", "run", "submit", "bench"])
def test_a_token_limit_under_one_is_a_usage_error(command, tmp_path):
    """Exit 2, like every other bad option value (README, "Exit status"), before anything loads."""
    from click.testing import CliRunner

    from specbatch.cli.main import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    args = {"generate": ["--prompt", "hi"], "run": [str(prompts)], "submit": [str(prompts)], "bench": []}
    r = CliRunner().invoke(cli, [command, *args[command], "--max-new-tokens", "0"])
    assert r.exit_code == 2, r.output
    assert "'--max-new-tokens'" in r.output and "0 is not in the range x>=1" in r.output


# (option, value, what Click's message says): each is outside what GenerationParams.validate accepts
BAD_GENERATION_VALUES = [
    ("--temperature", "-1", "-1.0 is not in the range 0<=x<=2"),
    ("--temperature", "inf", "inf is not in the range 0<=x<=2"),
    ("--temperature", "2.5", "2.5 is not in the range 0<=x<=2"),      # OpenAI's range
    ("--top-p", "0", "0.0 is not in the range 0<x<=1"),
    ("--top-p", "1.01", "1.01 is not in the range 0<x<=1"),
    ("--top-p", "nan", "nan is not a finite number"),
    ("--top-k", "-1", "-1 is not in the range x>=0"),
    ("--seed", "-1", "-1 is not in the range 0<=x<9223372036854775808"),
    ("--seed", str(2**63), "9223372036854775808 is not in the range 0<=x<9223372036854775808"),
    ("--stop", "", "stop strings must not be empty"),
]


@pytest.mark.parametrize(("command", "option", "value", "message"), [
    *((c, *bad) for c in ("generate", "run", "submit") for bad in BAD_GENERATION_VALUES),
    ("generate", "--gamma", "65", "65 is not in the range 0<=x<=64"),
    ("generate", "--gamma", "-1", "-1 is not in the range 0<=x<=64"),
])
def test_a_generation_value_the_engine_refuses_is_a_usage_error(command, option, value, message, tmp_path,
                                                                monkeypatch):
    """Exit 2 with Click's message naming the option, before any model loads (as --max-new-tokens);
    the engine's own check stays for library callers and per-line file values."""
    from specbatch.engine import Engine

    def no_load(*a, **k):
        raise AssertionError("a model loaded for a bad option value")

    monkeypatch.setattr(Engine, "load", no_load)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    args = {"generate": ["--prompt", "hi"], "run": [str(prompts)], "submit": [str(prompts)]}
    r = run(command, *args[command], option, value)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}': {message}" in r.stderr, r.stderr


def test_generation_values_at_their_bounds_are_accepted(tiny_models):
    """The closed ends (temperature 0, top-p 1, top-k 0, seed 0 and 2**63 - 1, gamma 0 and 64) and a
    top-p just above its open end decode."""
    for extra in (["--temperature", "0", "--top-p", "1", "--top-k", "0", "--seed", "0", "--gamma", "0"],
                  ["--temperature", "0.5", "--top-p", "1e-9", "--seed", str(2**63 - 1), "--gamma", "64",
                   "--stop", "x"]):
        out = generate_json(tiny_models, "--prompt", PROMPT, "--max-new-tokens", "3", *extra)
        assert 1 <= len(out["token_ids"]) <= 3, extra


def test_compile_auto_says_once_why_it_decodes_eagerly(tiny_models, monkeypatch):
    """auto declines to compile for 4 tokens; the CLI says so in one stderr line, off says nothing."""
    args = ["generate", "--target", str(tiny_models / "llama"), "--prompt", PROMPT, "--max-new-tokens", "4"]
    auto = run(*args, "--compile", "auto")
    assert auto.exit_code == 0, auto.output
    lines = [ln for ln in auto.stderr.splitlines() if "decoding eagerly" in ln]
    assert len(lines) == 1, auto.stderr
    assert lines[0].startswith("specbatch: decoding eagerly: compiling would take about ")
    assert lines[0].endswith("of eager decoding (at 1.17x); --compile on compiles anyway"), lines[0]
    off = run(*args, "--compile", "off")
    assert off.exit_code == 0, off.output
    assert "eagerly" not in off.stderr and "compil" not in off.stderr, off.stderr
    # the default mode is auto too (tests set off: set it back); for a one-off generate its
    # declining is the usual case, not news
    monkeypatch.setenv("SPECBATCH_COMPILE", "auto")
    get_settings.cache_clear()
    assert get_settings().compile == "auto"
    default = run(*args)
    assert default.exit_code == 0, default.output
    assert "eagerly" not in default.stderr, default.stderr


@pytest.mark.parametrize(("reason", "said"), [
    ("auto: compiling would take about 370 s and save about 0.2 s of the job's about 1.2 s of eager "
     "decoding (at 1.25x)",
     "compiling would take about 370 s and save about 0.2 s of the job's about 1.2 s of eager decoding "
     "(at 1.25x); --compile on compiles anyway"),
    ("auto: compiling gains 0.93x at 8 rows (measured here at the last warm-up); auto compiles only above 1.05x",
     "compiling gains 0.93x at 8 rows (measured here at the last warm-up); auto compiles only above 1.05x; "
     "--compile on compiles anyway"),
    ("the target is not compiled: dynamically quantized (int8) layers are not compiled",
     "the target is not compiled: dynamically quantized (int8) layers are not compiled"),
])
def test_the_eager_line_reads_well_for_every_reason(reason, said):
    from specbatch.cli.compile_text import eager_reason

    assert eager_reason(reason) == said


def test_a_compile_failure_is_not_said_twice(capsys):
    """A failure to compile was already a warning: no eager line on top of it."""
    from specbatch.cli.compile_text import report_compile
    from specbatch.engine.compile.decision import CompilePlan
    from specbatch.engine.compile.record import CompileReport

    report_compile(CompilePlan("auto", False, "compiling failed, eager instead: no C++ compiler",
                               [CompileReport(model="m", enabled=False, error="no C++ compiler")]))
    report_compile(CompilePlan("off", False, "compile off"))
    assert capsys.readouterr().err == ""


def test_the_summary_line_says_nothing_was_drafted_instead_of_acceptance_zero(tiny_models):
    args = ["generate", "--target", str(tiny_models / "llama"), "--draft", str(tiny_models / "llama-partial"),
            "--prompt", PROMPT, "--max-new-tokens", "6"]
    plain = run(*args, "--gamma", "0")
    assert plain.exit_code == 0, plain.output
    assert "nothing drafted, drafters " in plain.stderr and "acceptance" not in plain.stderr
    drafted = run(*args, "--gamma", "2")
    assert drafted.exit_code == 0, drafted.output
    assert "acceptance " in drafted.stderr and "tokens/step" in drafted.stderr
