"""--chat-template: a Jinja file (or a JSON file holding ``chat_template``), or a built-in template name."""

from __future__ import annotations

import json
import os
from typing import Any

# Built-in templates by name (the formats SGLang's registry also names). A model's own template is used
# when --chat-template is not given.
BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}


def load_chat_template(spec: str) -> str:
    """The Jinja source named by ``spec`` (raise ValueError naming --chat-template when it is neither)."""
    if spec in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[spec]
    if not os.path.isfile(spec):
        raise ValueError(
            f"--chat-template {spec!r} is neither a file nor a built-in template ({', '.join(sorted(BUILTIN_CHAT_TEMPLATES))})"
        )
    with open(spec, encoding="utf-8") as f:
        text = f.read()
    if spec.endswith(".json"):
        try:
            template = json.loads(text).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            template = None
        if not isinstance(template, str):
            raise ValueError(f"--chat-template {spec!r}: a JSON file must hold a string 'chat_template'")
        return template
    return text


def apply_chat_template_arg(tokenizer: Any, spec: Any) -> None:
    """Install --chat-template on the tokenizer (no-op when the flag is not given)."""
    if spec:
        tokenizer.chat_template = load_chat_template(spec)
