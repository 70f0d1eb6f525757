"""OpenAI chat messages as a model's chat template expects them."""

from __future__ import annotations

from typing import Any

from specbatch.errors import RequestError


def _names_role(template: Any, role: str) -> bool:
    if isinstance(template, dict):      # named templates (tokenizer_config "chat_template": [...])
        return any(_names_role(t, role) for t in template.values())
    return isinstance(template, str) and role in template


def template_messages(messages: list[dict[str, Any]], template: Any) -> list[dict[str, Any]]:
    """``developer`` messages become ``system`` ones unless the template names the developer role:
    OpenAI reads them alike (developer replaced system for its newer models), while an open model's
    template would otherwise print an unknown role header the model never saw in training. ``name``
    and ``tool_call_id`` stay; templates that know them use them, the others ignore them."""
    if _names_role(template, "developer"):
        return [dict(m) for m in messages]
    return [{**m, "role": "system"} if m.get("role") == "developer" else dict(m) for m in messages]


def encode(tok: Any, model_name: str, prompt: str | None = None,
           messages: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a request, as the engine decodes it: a prompt is tokenized as is; messages go
    through the model's chat template. (No torch here: intake counts tokens with it too.)"""
    if (prompt is None) == (messages is None):
        raise RequestError('give exactly one of "prompt" or "messages"', field="prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise RequestError("must be a string", field="prompt")
        if not prompt.strip():
            raise RequestError("prompt is empty", field="prompt")
        ids = tok(prompt)["input_ids"]
    else:
        if not messages or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} objects",
                               field="messages")
        if not getattr(tok, "chat_template", None):
            raise RequestError(f"model {model_name!r} has no chat template; "
                               'send "prompt" instead of "messages"', field="messages")
        text = tok.apply_chat_template(template_messages(messages, tok.chat_template),
                                       add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise RequestError("prompt is empty after tokenization", field="prompt")
    return list(ids)
