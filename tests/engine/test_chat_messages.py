"""OpenAI chat messages through a model's chat template: the developer role, names."""

from __future__ import annotations

from pathlib import Path

from specbatch.engine.chat import template_messages

DEV = [{"role": "developer", "content": "Be brief.", "name": "ops"}, {"role": "user", "content": "Hi"}]


def test_developer_becomes_system_unless_the_template_names_it():
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert template_messages(DEV, plain) == [{"role": "system", "content": "Be brief.", "name": "ops"},
                                             {"role": "user", "content": "Hi"}]
    knows = "{% if m['role'] == 'developer' %}...{% endif %}"
    assert template_messages(DEV, knows) == DEV
    assert template_messages(DEV, {"default": plain, "tool_use": knows}) == DEV
    assert DEV[0]["role"] == "developer"                     # the caller's messages are not changed


def test_encode_renders_developer_as_system(tiny_models: Path):
    from specbatch.engine import Engine

    engine = Engine.load(str(tiny_models / "llama"))
    tok = engine.target.tokenizer
    ids = engine.encode(messages=DEV)
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert ids == engine.encode(messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}])
