"""Which requests the KV index can route, the ``/tokenize`` body that reproduces their prompt ids, and their cache.

:func:`plan` looks at a request once and says either how to get its prompt
token ids (a ``/tokenize`` body, or the ids themselves) with the extra keys
vLLM mixes into its block hashes, or why the request cannot be indexed (a
short reason, used as a metric label):

=========================  ===========================================================================
reason                     when
=========================  ===========================================================================
``path``                   not ``/v1/chat/completions`` nor ``/v1/completions`` (embeddings, responses...)
``bad_body``               the body is not what the engine would accept (no messages, bad types...)
``non_text_content``       a chat message has a part other than text (images, audio, files, video):
                           its tokens and hashes depend on the engine's multimodal processing
``batched_prompt``         a completion with several prompts
``prompt_embeds``          a completion with prompt embeddings
``empty_prompt``           an empty prompt
``unknown_lora``           ``model`` names neither the base model nor a LoRA adapter whose path is known
``bad_cache_salt``         a ``cache_salt`` that is not a non-empty string
``both_prompt_flags``      ``add_generation_prompt`` and ``continue_final_message`` both true (a 400)
=========================  ===========================================================================

Token parity: the chat ``/tokenize`` body carries exactly the fields of the
chat request that change the rendered prompt (``messages``, ``tools``,
``add_generation_prompt``, ``continue_final_message``, ``chat_template``,
``chat_template_kwargs``, ``add_special_tokens``), only when the request sets
them, so the engine applies the same defaults to both (vLLM's chat defaults:
generation prompt on, no BOS added). A completion's string prompt is sent
with its ``add_special_tokens`` (default true, BOS added). A completion whose
prompt is token ids needs no ``/tokenize`` call at all.

Bounded: a prompt longer than ``max_chars`` characters (the tier's
``max_tokenize_chars``) is cut before it is sent: a completion's prompt to its
first ``max_chars`` characters, a chat's messages up to the one holding the
``max_chars``-th character of content, whose content is cut there (the later
messages dropped). The cut goes back to a whitespace when one is near
(:func:`cut_at`). The ids of the cut body equal the full prompt's up to a few
tokens before the cut: what the template appends after the cut message and the
tokens of the word at the cut differ, so the tier drops the last
``CUT_MARGIN_TOKENS`` ids of a cut body's answer (and hashes full blocks only).
A template that renders early messages differently when later ones are there
(one that moves the system prompt to the last user turn) gets other ids for a
cut prompt: such prompts then miss in the index, nothing worse.

Lone surrogates (``"\ud800"``, legal JSON) cannot be encoded as UTF-8: the
``/tokenize`` body carries U+FFFD in their place, so routing tokenizes the
prompt rather than failing (the engine itself refuses such a request with a
400, wherever it is routed).

Extra keys: ``cache_salt`` goes on block 0 and a LoRA adapter's ``("lora",
name, path)`` on every block, as vLLM 0.31+ hashes them
(:func:`llmgw.kv.keys.request_extra_keys`). A LoRA adapter is indexable
only when its path is known (from the profile's ``lora_adapters`` or the
tier's ``lora_adapters`` option): vLLM hashes the path, which the request
does not carry.

:class:`TokenizeCache` keeps the ids of ``/tokenize`` bodies in an LRU keyed
by the body bytes, bounded by total tokens. The client that calls a
replica's ``/tokenize`` is the ``replica`` tokenizer source
(:class:`llmgw.plugins.replica_tokenizer.TokenizeClient`): this module makes
no calls and depends on nothing above ``llmgw.kv``.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .keys import request_extra_keys

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
CHAT_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
               "chat_template_kwargs", "add_special_tokens")
TEXT_PART_TYPES = frozenset({"text", "input_text"})
DEFAULT_TOKENIZE_TIMEOUT = 0.05
DEFAULT_TOKENIZE_TIMEOUT_PER_KB = 0.002
DEFAULT_CACHE_TOKENS = 4_000_000  # at most about 16 MB of ids (4 bytes each) and as much of bodies
CACHE_ENTRY_OVERHEAD = 64  # tokens an entry is charged beside its own: ~256 bytes of key, array and dict node
CUT_MARGIN_TOKENS = 64  # ids dropped from the end of a cut prompt's answer (the template's suffix, the cut word)
CUT_LOOKBACK_CHARS = 64  # a cut moves back at most this far to a whitespace
_SURROGATE = re.compile("[\ud800-\udfff]")
_U32 = next(code for code in "IL" if array(code).itemsize == 4)


@dataclass(frozen=True, slots=True)
class Plan:
    """How to index one request: ``reason`` is "" when it can be indexed.

    Exactly one of ``body`` (the ``/tokenize`` JSON, canonical bytes) and
    ``token_ids`` is set for an indexable request.
    """

    reason: str = ""
    body: bytes | None = None
    token_ids: Sequence[int] | None = None  # the request's own list (not copied: never mutate it)
    cache_salt: str | None = None
    lora: tuple[str, str] | None = None
    prompt_chars: int = 0  # characters of prompt text (a completion's prompt, a chat's contents)
    cut_chars: int = 0  # when the body was cut (max_chars): the characters of prompt text it kept; 0 when whole

    @property
    def indexable(self) -> bool:
        return not self.reason

    def extra_keys(self, num_tokens: int, block_size: int, *,
                   style: str = "current") -> list[tuple[object, ...] | None] | None:
        """The per-block extra-key items vLLM hashes for this request (None when there are none)."""
        if self.cache_salt is None and self.lora is None:
            return None
        return request_extra_keys(num_tokens, block_size, lora=self.lora, cache_salt=self.cache_salt, style=style)


def _refuse(reason: str) -> Plan:
    return Plan(reason=reason)


def _canonical(body: dict[str, Any]) -> bytes:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: U+FFFD in its place (the module's docstring)
        return _SURROGATE.sub("\ufffd", text).encode()


def cut_at(text: str, limit: int) -> int:
    """Where to cut ``text`` to at most ``limit`` characters: just after the last whitespace within
    ``CUT_LOOKBACK_CHARS`` of the limit (a word is not split), else at the limit."""
    if len(text) <= limit:
        return len(text)
    window_start = max(0, limit - CUT_LOOKBACK_CHARS)
    for i in range(limit, window_start, -1):
        if text[i - 1].isspace():
            return i
    return limit


def plan(path: str, body: Mapping[str, Any], *, base_models: frozenset[str] | set[str] = frozenset(),
         loras: Mapping[str, str] | None = None, max_chars: int | None = None) -> Plan:
    """Whether and how to index a request to ``path`` with JSON ``body`` (see the module docstring).

    ``base_models`` are the names the replicas serve the base model under (a
    request without ``model`` is the base model); ``loras`` maps LoRA adapter
    names to the paths the engine loaded them from; a prompt of more than
    ``max_chars`` characters is cut to that (None: never).
    """
    if not isinstance(body, Mapping):
        return _refuse("bad_body")
    model = body.get("model")
    lora = None
    if model is not None and model not in base_models:
        path_of = (loras or {}).get(model) if isinstance(model, str) else None
        if path_of is None:
            return _refuse("unknown_lora")
        lora = (model, path_of)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        return _refuse("bad_cache_salt")
    if path == CHAT_PATH:
        return _chat_plan(body, model, salt, lora, max_chars)
    if path == COMPLETIONS_PATH:
        return _completion_plan(body, model, salt, lora, max_chars)
    return _refuse("path")


def _chat_plan(body: Mapping[str, Any], model: Any, salt: str | None, lora: tuple[str, str] | None,
               max_chars: int | None) -> Plan:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _refuse("bad_body")
    for message in messages:
        if not isinstance(message, dict):
            return _refuse("bad_body")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return _refuse("bad_body")
        for part in content:
            if isinstance(part, str):
                continue
            if not isinstance(part, dict) or part.get("type", "text") not in TEXT_PART_TYPES \
                    or not isinstance(part.get("text"), str):
                return _refuse("non_text_content")
    if body.get("add_generation_prompt", True) is True and body.get("continue_final_message") is True:
        return _refuse("both_prompt_flags")
    tokenize_body = {name: body[name] for name in CHAT_FIELDS if name in body}
    chars = sum(_content_chars(m.get("content")) for m in messages)
    kept = chars
    if max_chars is not None and chars > max_chars:
        tokenize_body["messages"], kept = _cut_messages(messages, max_chars)
    if model is not None:
        tokenize_body["model"] = model
    return Plan(body=_canonical(tokenize_body), cache_salt=salt, lora=lora, prompt_chars=chars,
                cut_chars=kept if kept < chars else 0)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part if isinstance(part, str) else part["text"]) for part in content)
    return 0


def _cut_messages(messages: list[dict[str, Any]], max_chars: int) -> tuple[list[dict[str, Any]], int]:
    """The messages up to the one holding the ``max_chars``-th character of content, that one's content cut
    there (:func:`cut_at`); and the characters of content kept."""
    kept: list[dict[str, Any]] = []
    left = max_chars
    for message in messages:
        content = message.get("content")
        size = _content_chars(content)
        if size <= left:
            kept.append(message)
            left -= size
            continue
        if isinstance(content, str):
            cut = cut_at(content, left)
            kept.append({**message, "content": content[:cut]})
            left -= cut
        elif isinstance(content, list):  # a size above 0: a str or a list of text parts (checked by the plan)
            parts: list[Any] = []
            for part in content:
                text = part if isinstance(part, str) else part["text"]
                if len(text) > left:
                    cut = cut_at(text, left)
                    parts.append(text[:cut] if isinstance(part, str) else {**part, "text": text[:cut]})
                    left -= cut
                    break
                parts.append(part)
                left -= len(text)
            kept.append({**message, "content": parts})
        break
    return kept, max_chars - left


def _token_ids(value: list[Any]) -> bool:
    """A non-empty list of ints, checked at C speed (32k ids in about 0.5 ms).

    Values are not range-checked: the engine refuses ids outside its vocabulary
    with a 400, whatever replica the request went to.
    """
    return bool(value) and set(map(type, value)) == {int}


def _completion_plan(body: Mapping[str, Any], model: Any, salt: str | None,
                     lora: tuple[str, str] | None, max_chars: int | None) -> Plan:
    if body.get("prompt_embeds") is not None:
        return _refuse("prompt_embeds")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) is not int:
        if len(prompt) > 1:
            return _refuse("batched_prompt")
        prompt = prompt[0]  # one prompt written as a list of one
    if isinstance(prompt, str):
        if not prompt:
            return _refuse("empty_prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            return _refuse("bad_body")
        cut = cut_at(prompt, max_chars) if max_chars is not None else len(prompt)
        tokenize_body = {"prompt": prompt[:cut] if cut < len(prompt) else prompt, "add_special_tokens": add_special}
        if model is not None:
            tokenize_body["model"] = model
        return Plan(body=_canonical(tokenize_body), cache_salt=salt, lora=lora, prompt_chars=len(prompt),
                    cut_chars=cut if cut < len(prompt) else 0)
    if isinstance(prompt, list):
        if not prompt:
            return _refuse("empty_prompt")
        if _token_ids(prompt):
            return Plan(token_ids=prompt, cache_salt=salt, lora=lora)
    return _refuse("bad_body")


# --------------------------------------------------------------------------- the error and the cache


class TokenizeError(Exception):
    """A ``/tokenize`` call failed; ``kind`` is ``timeout``, ``status``, ``connect``, ``protocol`` or ``answer``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TokenizeCache:
    """An LRU of ``body bytes -> token ids``, bounded by ``max_tokens`` charged across its entries.

    An entry is charged its ids (uint32 each) or a quarter of its body's bytes, whichever is more, plus
    :data:`CACHE_ENTRY_OVERHEAD`: so the cache holds at most ``4 x max_tokens`` bytes of ids, as many of bodies,
    and ``max_tokens / CACHE_ENTRY_OVERHEAD`` entries, whatever the answers (an empty one, a short answer to a
    large body) and whoever sends them.
    """

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, array[int]] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, body: bytes) -> list[int] | None:
        ids = self._entries.get(body)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(body)
        return ids.tolist()

    def put(self, body: bytes, ids: Sequence[int]) -> None:
        if self.max_tokens <= 0 or len(ids) > self.max_tokens:
            return
        try:
            packed = array(_U32, ids)
        except (OverflowError, TypeError):
            return
        if self._charge(body, packed) > self.max_tokens:
            return
        old = self._entries.pop(body, None)
        if old is not None:
            self.tokens -= self._charge(body, old)
        self._entries[body] = packed
        self.tokens += self._charge(body, packed)
        while self.tokens > self.max_tokens:
            evicted_body, evicted = self._entries.popitem(last=False)
            self.tokens -= self._charge(evicted_body, evicted)

    @staticmethod
    def _charge(body: bytes, ids: array[int]) -> int:
        return max(len(ids), -(-len(body) // 4)) + CACHE_ENTRY_OVERHEAD
