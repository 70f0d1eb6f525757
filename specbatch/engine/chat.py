"""OpenAI chat messages as a model's chat template expects them."""

from __future__ import annotations

from typing import Any


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
