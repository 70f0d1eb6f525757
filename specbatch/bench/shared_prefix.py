"""A generated job whose requests share one long system prompt: what the prefix cache is for.

``requests(tokenizer, tokens)``: ``n`` chat lines, each the same system prompt of about ``tokens``
tokens (a product manual's paragraphs, repeated in order until long enough) plus a short question
of its own, ``max_tokens`` from 32 to 64. Deterministic: the same arguments give the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANUAL = [
    "The Orbit 3 dishwasher has three racks: the lower rack holds plates and pots, the upper rack "
    "holds glasses and cups, and the cutlery tray sits on top.",
    "Before the first wash, fill the salt container with dishwasher salt and set the water hardness "
    "in the settings menu; the salt light goes off once the softener is ready.",
    "Programs: Eco 50 degrees for everyday loads, Intensive 70 degrees for pans with burnt-on food, "
    "Quick 45 degrees for lightly soiled dishes, and Glass 40 degrees for delicate items.",
    "Delay start: press Delay repeatedly to postpone the start by one to twenty-four hours; the "
    "display counts down and the door may be opened to add dishes until the program begins.",
    "Error E15 means water was found in the base: turn off the tap, unplug the machine and call "
    "service. Error E24 means the drain is blocked: clean the filter and check the drain hose.",
    "Clean the filter once a week: turn the cylinder anticlockwise, lift it out, rinse it under "
    "running water, and put it back until it clicks; never run the machine without the filter.",
    "Rinse aid improves drying; refill it when the rinse aid light comes on and wipe away spills, "
    "which can foam. Use only detergent made for dishwashers.",
    "The child lock is set by holding Start for three seconds; it locks the buttons, not the door.",
]

QUESTIONS = [
    "How do I clean the filter?", "What does error E15 mean?", "Which program is best for pans?",
    "How long can I delay the start?", "Where do the glasses go?", "What is the salt for?",
    "When should I refill rinse aid?", "How do I lock the buttons?", "What does E24 mean?",
    "Can I open the door during a delayed start?", "Which program is the quickest?",
    "What temperature is the Eco program?", "Can I run it without the filter?",
    "Where does the cutlery go?", "Why are my dishes wet after a wash?", "What detergent should I use?",
]


def system_prompt(tokenizer: Any, tokens: int) -> str:
    """The manual's paragraphs in order, repeated, until about ``tokens`` tokens."""
    parts: list[str] = []
    while len(tokenizer(" ".join(parts)).input_ids) < tokens:
        parts.append(MANUAL[len(parts) % len(MANUAL)])
    return "You answer questions about the user's dishwasher from its manual, in one or two sentences.\n\n" \
        + " ".join(parts)


def requests(tokenizer: Any, tokens: int, n: int = 48) -> list[dict[str, Any]]:
    system = system_prompt(tokenizer, tokens)
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):              # each question once per round, rounds told apart
            q = f"(customer {i // len(QUESTIONS) + 1}) {q}"
        out.append({"custom_id": f"q{i}", "messages": [{"role": "system", "content": system},
                                                       {"role": "user", "content": q}],
                    "max_tokens": 32 + (i * 11) % 33})
    return out


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path
