"""The canonical text of a request: what routing compares between requests, and a cheap token estimate.

Two requests whose prompts start the same way render to texts that start the
same way, without a tokenizer: a chat is ``role\\x1fcontent\\x1e`` per message
(text parts joined by newlines; other parts as their JSON, so two different
images differ), preceded by the LoRA adapter, the ``tools`` and the
``cache_salt`` when present (each changes what the engine caches); a completion is its prompt (the first
one of a batch; token ids written as decimal numbers); an embedding its
input. The result is cached on the :class:`~llmgw.router.tier.RouteRequest`.
"""

from __future__ import annotations

import json
from typing import Any

from .tier import RouteRequest

UNIT = "\x1f"  # between a field's name and its value
RECORD = "\x1e"  # after each message or field
CHARS_PER_TOKEN = 4  # the usual estimate for English text with BPE tokenizers


def canonical_text(request: RouteRequest) -> str:
    """The request's canonical text (computed once per request)."""
    text = request.canonical_text
    if text is None:
        text = request.canonical_text = render_body(request.body, request.adapter)
    return text


def estimated_prompt_tokens(request: RouteRequest) -> int:
    """Prompt tokens guessed from the canonical text: characters / 4, at least 1."""
    return len(canonical_text(request)) // CHARS_PER_TOKEN + 1


def render_body(body: dict[str, Any], adapter: str | None = None) -> str:
    parts: list[str] = []
    if adapter:
        parts.append(f"lora{UNIT}{adapter}{RECORD}")
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        parts.append(f"salt{UNIT}{salt}{RECORD}")
    messages = body.get("messages")
    if isinstance(messages, list):
        tools = body.get("tools")
        if tools:
            parts.append(f"tools{UNIT}{_json(tools)}{RECORD}")
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if type(content) is not str:
                    content = _content(content)
                parts.append(f"{message.get('role', '')}{UNIT}{content}{RECORD}")
        return "".join(parts)
    prompt = body.get("prompt", body.get("input"))
    parts.append(_prompt(prompt))
    return "".join(parts)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(part if isinstance(part, str)
                         else part["text"] if isinstance(part, dict) and isinstance(part.get("text"), str)
                         else _json(part)
                         for part in content)
    return _json(content)


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # one prompt of token ids
            return ",".join(map(str, prompt))
        return _prompt(first)  # a batch: route by its first prompt
    return ""


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
