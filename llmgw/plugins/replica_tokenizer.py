"""The ``replica`` tokenizer source: a replica's own ``/tokenize``, called through its pooled connection.

:class:`TokenizeClient` posts the ``/tokenize`` body that
:func:`llmgw.kv.tokenize.plan` built to the replica (``replica.pool``, with
its API key) within a deadline that grows with the body and adapts to the
latency observed, reads the answer as it arrives and only up to ``max_ids``
ids (:class:`~llmgw.kv.tokenize_answer.TokenizeAnswerReader`: the rest of a
long prompt's answer is never read, the connection is closed instead), and
keeps the answers in a :class:`~llmgw.kv.tokenize.TokenizeCache`. Failures
raise :class:`~llmgw.kv.tokenize.TokenizeError`.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Any
from weakref import WeakKeyDictionary

import trio

from ..http.client import UpstreamError, UpstreamPool
from ..kv.tokenize import DEFAULT_CACHE_TOKENS, DEFAULT_TOKENIZE_TIMEOUT, DEFAULT_TOKENIZE_TIMEOUT_PER_KB, TokenizeCache
from ..kv.tokenize_answer import TokenizeAnswerReader
from ..plugin import TokenizeError

log = logging.getLogger(__name__)

ADAPTIVE_FACTOR = 2.0  # the deadline grows to twice the p99 of the recent calls' latency (per KiB of body)
ADAPTIVE_CEILING = 0.5  # seconds: never longer than this, whatever was observed
ADAPTIVE_WINDOW = 256  # the recent calls
ADAPTIVE_MIN_CALLS = 16  # observed before the p99 is used; recomputed every ADAPTIVE_UPDATE_EVERY calls
ADAPTIVE_UPDATE_EVERY = 16
DEFAULT_MAX_IDS = 131072 + 64  # the kv_index tier passes its max_prompt_tokens plus the cut margin
MAX_ERROR_BYTES = 4096  # of an answer that is not a 200, read for the error message

# The replica whose ``/tokenize`` the current task's last :meth:`TokenizeClient.tokenize` sent a prompt to (None:
# answered from the cache). Per task (Trio gives each task its own context): the kv_index tier's
# ``strict_tokenize`` reads it right after its call to know which replica has seen the prompt.
ASKED: contextvars.ContextVar[object | None] = contextvars.ContextVar("llmgw_tokenize_asked", default=None)


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

    reports_asked = True  # sets ASKED when it sends a prompt to a replica (kv_index's strict_tokenize)

    def __init__(self, options: Mapping[str, Any] | None = None, *, timeout: float | None = None,
                 timeout_per_kb: float | None = None, cache_tokens: int | None = None, observe=None,
                 clock=time.perf_counter):
        options = options or {}
        self.timeout = float(timeout if timeout is not None else options.get("tokenize_timeout",
                                                                            DEFAULT_TOKENIZE_TIMEOUT))
        self.timeout_per_kb = float(timeout_per_kb if timeout_per_kb is not None
                                    else options.get("tokenize_timeout_per_kb", DEFAULT_TOKENIZE_TIMEOUT_PER_KB))
        self.cache = TokenizeCache(int(cache_tokens if cache_tokens is not None
                                       else options.get("tokenize_cache_tokens", DEFAULT_CACHE_TOKENS)))
        self.observe = observe  # callable(seconds) for llmgw_kv_tokenize_seconds
        self.max_ids = int(options.get("max_ids", DEFAULT_MAX_IDS))  # ids read from an answer, at most
        self.answer_bytes = 0  # answer bytes read, in all (the bound is visible in tests)
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

    def _pool(self, replica) -> UpstreamPool:
        pool = getattr(replica, "pool", None)
        if pool is not None:
            return pool
        pool = self._pools.get(replica)
        if pool is None:
            pool = self._pools[replica] = replica.open_pool(self.timeout)
        return pool

    async def tokenize(self, replica, body: bytes) -> list[int]:
        cached = self.cache.get(body)
        if cached is not None:
            return cached
        self.calls += 1
        ASKED.set(replica)  # from here on the replica may have the prompt, whatever the call's outcome
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

    async def _call(self, replica, body: bytes) -> list[int]:
        headers = [(b"content-type", b"application/json")]
        auth = getattr(replica, "auth_header", None)
        if auth is not None:
            headers.append(auth)
        target = getattr(replica, "base_path", "") + "/tokenize"
        timeout = self.deadline(body)
        ids = None
        with trio.move_on_after(timeout):
            try:
                response = await self._pool(replica).request("POST", target, headers, body,
                                                             first_byte_timeout=timeout, idle_timeout=timeout)
                try:
                    ids = await self._read_ids(response)
                finally:
                    await response.aclose()  # closes the connection when the answer was not read to its end
            except UpstreamError as exc:
                if exc.kind == "timeout":
                    raise TokenizeError("timeout", str(exc)) from None
                raise TokenizeError("connect" if exc.kind in ("connect", "tls", "capacity") else "protocol",
                                    str(exc)) from None
        if ids is None:
            raise TokenizeError("timeout", f"/tokenize on {getattr(replica, 'name', '?')} took longer than "
                                           f"{timeout * 1000:g} ms")
        return ids

    async def _read_ids(self, response) -> list[int]:
        """The answer's ids, read piece by piece and no further than ``max_ids`` ids."""
        if response.status != 200:
            payload = b""
            while len(payload) < MAX_ERROR_BYTES and (piece := await response.receive_piece()):
                payload += piece
            raise TokenizeError("status", f"/tokenize answered {response.status}: {payload[:200]!r}")
        reader = TokenizeAnswerReader(self.max_ids)
        try:
            while piece := await response.receive_piece():
                if reader.feed(piece):
                    return reader.ids
                # pieces already buffered come back without a yield: let the other requests run between them
                await trio.lowlevel.checkpoint()
            return reader.finish()
        finally:
            self.answer_bytes += reader.bytes_read
