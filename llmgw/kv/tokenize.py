"""Which requests the KV index can route, the ``/tokenize`` body that reproduces their prompt ids, and the client.

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

Extra keys: ``cache_salt`` goes on block 0 and a LoRA adapter's ``("lora",
name, path)`` on every block, as vLLM 0.31+ hashes them
(:func:`llmgw.kv.keys.request_extra_keys`). A LoRA adapter is indexable
only when its path is known (from the profile's ``lora_adapters`` or the
tier's ``lora_adapters`` option): vLLM hashes the path, which the request
does not carry.

:class:`TokenizeClient` calls a replica's ``/tokenize`` through its pooled
connection (``replica.pool``) with its API key and a deadline, and keeps the
answers in an LRU cache keyed by the body bytes, bounded by total tokens.
"""

from __future__ import annotations

import json
import logging
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import trio

from ..http.client import UpstreamError, UpstreamPool
from .keys import request_extra_keys

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
CHAT_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
               "chat_template_kwargs", "add_special_tokens")
TEXT_PART_TYPES = frozenset({"text", "input_text"})
DEFAULT_TOKENIZE_TIMEOUT = 0.05
DEFAULT_TOKENIZE_TIMEOUT_PER_KB = 0.002
ADAPTIVE_FACTOR = 2.0  # the deadline grows to twice the p99 of the recent calls' latency (per KiB of body)
ADAPTIVE_CEILING = 0.5  # seconds: never longer than this, whatever was observed
ADAPTIVE_WINDOW = 256  # the recent calls
ADAPTIVE_MIN_CALLS = 16  # observed before the p99 is used; recomputed every ADAPTIVE_UPDATE_EVERY calls
ADAPTIVE_UPDATE_EVERY = 16
DEFAULT_CACHE_TOKENS = 4_000_000  # about 16 MB of ids (4 bytes each) plus the bodies
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
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def plan(path: str, body: Mapping[str, Any], *, base_models: frozenset[str] | set[str] = frozenset(),
         loras: Mapping[str, str] | None = None) -> Plan:
    """Whether and how to index a request to ``path`` with JSON ``body`` (see the module docstring).

    ``base_models`` are the names the replicas serve the base model under (a
    request without ``model`` is the base model); ``loras`` maps LoRA adapter
    names to the paths the engine loaded them from.
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
        return _chat_plan(body, model, salt, lora)
    if path == COMPLETIONS_PATH:
        return _completion_plan(body, model, salt, lora)
    return _refuse("path")


def _chat_plan(body: Mapping[str, Any], model: Any, salt: str | None, lora: tuple[str, str] | None) -> Plan:
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
    if model is not None:
        tokenize_body["model"] = model
    return Plan(body=_canonical(tokenize_body), cache_salt=salt, lora=lora)


def _token_ids(value: list[Any]) -> bool:
    """A non-empty list of ints, checked at C speed (32k ids in about 0.5 ms).

    Values are not range-checked: the engine refuses ids outside its vocabulary
    with a 400, whatever replica the request went to.
    """
    return bool(value) and set(map(type, value)) == {int}


def _completion_plan(body: Mapping[str, Any], model: Any, salt: str | None,
                     lora: tuple[str, str] | None) -> Plan:
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
        tokenize_body = {"prompt": prompt, "add_special_tokens": add_special}
        if model is not None:
            tokenize_body["model"] = model
        return Plan(body=_canonical(tokenize_body), cache_salt=salt, lora=lora)
    if isinstance(prompt, list):
        if not prompt:
            return _refuse("empty_prompt")
        if _token_ids(prompt):
            return Plan(token_ids=prompt, cache_salt=salt, lora=lora)
    return _refuse("bad_body")


# --------------------------------------------------------------------------- the client


class TokenizeError(Exception):
    """A ``/tokenize`` call failed; ``kind`` is ``timeout``, ``status``, ``connect``, ``protocol`` or ``answer``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TokenizeCache:
    """An LRU of ``body bytes -> token ids``, bounded by the total ids held (as uint32 arrays)."""

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
        old = self._entries.pop(body, None)
        if old is not None:
            self.tokens -= len(old)
        self._entries[body] = packed
        self.tokens += len(packed)
        while self.tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= len(evicted)


class TokenizeClient:
    """``await client.tokenize(replica, body)`` -> the prompt ids ``replica`` computes for a ``/tokenize`` body.

    The deadline bounds the whole call (connection, request, answer) and
    grows with the body: ``timeout + timeout_per_kb x KiB of body``; a slow
    replica raises :class:`TokenizeError` ``timeout`` and the tier routes as
    the prefix tree would. Defaults 50 ms + 2 ms/KiB: a short chat must not
    wait long (a hit saves little on it), while a 32k-token prompt (about
    128 KiB of text: 306 ms) saves seconds of prefill when routed to its
    cache, and its ``/tokenize`` alone takes 8-16 ms at the median and up to
    60 ms at p99 on a busy machine (the simulator, ``docs/kv-routing.md``;
    vLLM's fast tokenizers are in the same range) plus the API server's
    queueing. The deadline adapts to what is observed (:meth:`deadline`): when
    twice the p99 of the last 256 calls' latency (scaled by body size) is
    longer than the configured one, that is used instead, up to 500 ms; a
    timeout counts as a call that took its deadline, so a run of them
    lengthens the next deadlines.
    """

    def __init__(self, options: Mapping[str, Any] | None = None, *, timeout: float | None = None,
                 timeout_per_kb: float | None = None, cache_tokens: int | None = None,
                 observe: Callable[[float], None] | None = None, clock: Callable[[], float] = time.perf_counter):
        options = options or {}
        self.timeout = float(timeout if timeout is not None else options.get("tokenize_timeout",
                                                                            DEFAULT_TOKENIZE_TIMEOUT))
        self.timeout_per_kb = float(timeout_per_kb if timeout_per_kb is not None
                                    else options.get("tokenize_timeout_per_kb", DEFAULT_TOKENIZE_TIMEOUT_PER_KB))
        self.cache = TokenizeCache(int(cache_tokens if cache_tokens is not None
                                       else options.get("tokenize_cache_tokens", DEFAULT_CACHE_TOKENS)))
        self.observe = observe  # callable(seconds) for llmgw_kv_tokenize_seconds
        self.clock = clock
        self.calls = 0
        self.timeouts = 0
        self.errors = 0
        self._pools: "WeakKeyDictionary[object, UpstreamPool]" = WeakKeyDictionary()
        self._latencies: deque[float] = deque(maxlen=ADAPTIVE_WINDOW)  # seconds per KiB (at least 1 KiB) of body
        self._since_update = 0
        self._p99_per_kib: float | None = None
        self._adapted = False  # whether the observed latency sets the deadline (logged when it changes)

    def deadline(self, body: bytes) -> float:
        """Seconds a ``/tokenize`` call with this body may take: the configured deadline, or
        ``ADAPTIVE_FACTOR`` x the p99 of the recent calls' seconds per KiB x this body's KiB when that is longer
        (at most ``ADAPTIVE_CEILING``)."""
        kib = max(len(body), 1024) / 1024
        configured = self.timeout + self.timeout_per_kb * len(body) / 1024
        if self._p99_per_kib is None:
            return configured
        return max(configured, min(ADAPTIVE_FACTOR * self._p99_per_kib * kib, ADAPTIVE_CEILING))

    def _learn_latency(self, seconds: float, body: bytes) -> None:
        """One call's latency (a timeout counts as its deadline, so a run of timeouts lengthens the next ones)."""
        self._latencies.append(seconds / (max(len(body), 1024) / 1024))
        self._since_update += 1
        if self._since_update >= ADAPTIVE_UPDATE_EVERY or self._p99_per_kib is None \
                and len(self._latencies) >= ADAPTIVE_MIN_CALLS:
            self._since_update = 0
            ordered = sorted(self._latencies)
            self._p99_per_kib = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
            adapted = ADAPTIVE_FACTOR * self._p99_per_kib > self.timeout + self.timeout_per_kb
            if adapted != self._adapted:
                self._adapted = adapted
                log.info("/tokenize deadline for routing: %s (p99 of the last %d calls: %.1f ms per KiB)",
                         "twice the observed p99, above the configured one" if adapted else "the configured one",
                         len(ordered), self._p99_per_kib * 1000)

    def _pool(self, replica: Any) -> UpstreamPool:  # a llmgw.router.replica.Replica
        pool: UpstreamPool | None = getattr(replica, "pool", None)
        if pool is not None:
            return pool
        pool = self._pools.get(replica)
        if pool is None:
            pool = self._pools[replica] = replica.open_pool(self.timeout)
        return pool

    async def tokenize(self, replica: Any, body: bytes) -> list[int]:
        cached = self.cache.get(body)
        if cached is not None:
            return cached
        self.calls += 1
        started = self.clock()
        try:
            ids = await self._call(replica, body)
        except TokenizeError as exc:
            if exc.kind == "timeout":
                self.timeouts += 1
                self._learn_latency(self.deadline(body), body)
            else:
                self.errors += 1
            raise
        else:
            self._learn_latency(self.clock() - started, body)
        finally:
            if self.observe is not None:
                self.observe(self.clock() - started)
        self.cache.put(body, ids)
        return ids

    async def _call(self, replica: Any, body: bytes) -> list[int]:
        headers = [(b"content-type", b"application/json")]
        auth = getattr(replica, "auth_header", None)
        if auth is not None:
            headers.append(auth)
        target = getattr(replica, "base_path", "") + "/tokenize"
        timeout = self.deadline(body)
        answer = None
        with trio.move_on_after(timeout):
            try:
                response = await self._pool(replica).request("POST", target, headers, body,
                                                             first_byte_timeout=timeout, idle_timeout=timeout)
                payload = await response.read()
            except UpstreamError as exc:
                if exc.kind == "timeout":
                    raise TokenizeError("timeout", str(exc)) from None
                raise TokenizeError("connect" if exc.kind in ("connect", "tls") else "protocol", str(exc)) from None
            answer = (response.status, payload)
        if answer is None:
            raise TokenizeError("timeout", f"/tokenize on {getattr(replica, 'name', '?')} took longer than "
                                           f"{timeout * 1000:g} ms")
        status, payload = answer
        if status != 200:
            raise TokenizeError("status", f"/tokenize answered {status}: {payload[:200]!r}")
        try:
            tokens = json.loads(payload)["tokens"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TokenizeError("answer", f"/tokenize answer without tokens: {exc}") from None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise TokenizeError("answer", "/tokenize answer: tokens is not a list of ints")
        return tokens
