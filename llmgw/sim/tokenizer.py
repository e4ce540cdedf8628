"""The simulator's tokenizer: byte-level token ids, a few special tokens, and the chat template.

One function turns a completion prompt into ids and one turns chat messages into
ids; ``/tokenize`` and generation both call them, so the ids a router gets from
``/tokenize`` are exactly the prompt the engine caches and hashes.

Ids follow the tiny Llama of the vLLM CPU tests (``docs/vllm-notes.md`` section 5) for the special
tokens (``<unk>``=0, ``<s>``=1, ``</s>``=2, ``<|user|>``=3, ``<|assistant|>``=4,
``<|system|>``=5, ``<|end|>``=6); every byte ``b`` of UTF-8 text is the id
``BYTE_OFFSET + b``. Special-token strings inside text become their single id,
as with a Hugging Face tokenizer. The chat template is that model's:
``<|role|>content<|end|>\\n`` per message, then ``<|assistant|>`` when a
generation prompt is asked for.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
UNK_ID, BOS_ID, EOS_ID, USER_ID, ASSISTANT_ID, SYSTEM_ID, END_ID = range(len(SPECIAL_TOKENS))
BYTE_OFFSET = 16  # ids 7..15 are reserved and never produced
VOCAB_SIZE = BYTE_OFFSET + 256

_SPECIAL_IDS = {text: i for i, text in enumerate(SPECIAL_TOKENS)}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_byte_to_id = BYTE_OFFSET.__add__


class TokenizerError(ValueError):
    """A request the tokenizer or the chat template cannot turn into ids (an HTTP 400)."""


def _gpt2_byte_alphabet() -> list[str]:
    """The printable stand-in character of each byte, as byte-level BPE tokenizers show tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_TOKEN_STRS = list(SPECIAL_TOKENS) + [f"<reserved_{i}>" for i in range(len(SPECIAL_TOKENS), BYTE_OFFSET)] \
    + _gpt2_byte_alphabet()


def encode(text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text``; ``add_special_tokens`` prepends BOS like the tiny model's post-processor."""
    ids = [BOS_ID] if add_special_tokens else []
    if "<" not in text:  # fast path: no special token can occur
        ids.extend(map(_byte_to_id, text.encode("utf-8")))
        return ids
    for i, part in enumerate(_SPECIAL_SPLIT.split(text)):
        if i % 2:
            ids.append(_SPECIAL_IDS[part])
        elif part:
            ids.extend(map(_byte_to_id, part.encode("utf-8")))
    return ids


def check_ids(ids: Iterable[Any]) -> list[int]:
    """``ids`` as a list, or :class:`TokenizerError` when one is not a token id of this vocabulary."""
    out = list(ids)
    for t in out:
        if type(t) is not int or not 0 <= t < VOCAB_SIZE:
            raise TokenizerError(f"Token id {t!r} is out of vocabulary")
    return out


def decode(ids: Iterable[int], *, skip_special_tokens: bool) -> str:
    """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD."""
    data = bytearray()
    pieces: list[str] = []
    for t in ids:
        if t >= BYTE_OFFSET:
            data.append(t - BYTE_OFFSET)
        elif not skip_special_tokens and t < len(SPECIAL_TOKENS):
            if data:
                pieces.append(data.decode("utf-8", errors="replace"))
                data.clear()
            pieces.append(SPECIAL_TOKENS[t])
    if data:
        pieces.append(data.decode("utf-8", errors="replace"))
    return "".join(pieces)


def token_strs(ids: Iterable[int]) -> list[str]:
    """Each id's token string (byte-level alphabet, e.g. ``Ġ`` for a space), as ``return_token_strs`` shows."""
    return [_TOKEN_STRS[t] for t in ids]


def message_text(message: Any) -> tuple[str, str]:
    """``(role, text)`` of one chat message; list content is joined text parts, as vLLM does."""
    if not isinstance(message, dict):
        raise TokenizerError("each message must be an object with 'role' and 'content'")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise TokenizerError("each message needs a 'role' string")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") in ("text", "input_text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TokenizerError(f"content part of type {kind!r} is not supported by the simulator "
                                     "(text parts only)")
        return role, "\n".join(texts)
    raise TokenizerError("message 'content' must be a string, a list of parts, or null")


def render_chat(messages: Any, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The chat template applied to ``messages`` (the tiny test model's template)."""
    if add_generation_prompt and continue_final_message:
        raise TokenizerError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("'messages' must be a non-empty list")
    parts = []
    for role, text in map(message_text, messages):
        parts.append(f"<|{role}|>{text}<|end|>\n")
    if continue_final_message:
        parts[-1] = parts[-1][: -len("<|end|>\n")]
    elif add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts)


def encode_chat(messages: Any, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False) -> list[int]:
    """Prompt ids of a chat request: the rendered template, tokenized (no BOS by default, as vLLM)."""
    text = render_chat(messages, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message)
    return encode(text, add_special_tokens=add_special_tokens)
