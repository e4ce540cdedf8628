"""Built-in tokenizer sources for the ``kv_index`` tier: ``auto`` (the default), ``local`` and ``replica``.

A tokenizer source is built by ``factory(options)`` with the model's
``routing_options`` (plus ``tokenizer_path``: the model's tokenizer files,
from the option or the profile's ``model_path``, and ``base_models``: the
names the base model is served under) and answers
``await source.tokenize(replica, body)`` with the prompt token ids, where
``body`` is the ``/tokenize`` JSON (bytes) that :func:`llmgw.kv.tokenize.plan`
built for the request. It raises :class:`llmgw.kv.tokenize.TokenizeError`
(kind ``timeout`` when too slow).

- ``replica``: a replica's own ``/tokenize`` (:class:`llmgw.plugins.replica_tokenizer.TokenizeClient`);
- ``auto``: :class:`LocalFirstTokenizer`, the model's ``tokenizer.json`` in the
  router when the files are there, ``/tokenize`` otherwise (and for what the
  local tokenizer cannot reproduce exactly);
- ``local``: the same, with a warning at start when the files cannot be loaded.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

import trio

from ..kv.local_tokenizer import LocalTokenizer, LocalTokenizerError, has_tokenizer_files
from ..plugin import TokenizeError, hookimpl
from .replica_tokenizer import TokenizeClient

log = logging.getLogger(__name__)

VERIFY_ANSWERS = 3  # the first answers the local tokenizer gives are checked against a replica's /tokenize
LOCAL_INLINE_BYTES = 32 * 1024  # larger bodies are tokenized in a worker thread, off the event loop


class LocalFirstTokenizer:
    """Token ids from the model's own tokenizer files in the router, else from a replica's ``/tokenize``.

    The first ``VERIFY_ANSWERS`` bodies the local tokenizer can do are also sent
    to ``/tokenize`` (whose answer is used); one disagreement turns the local
    tokenizer off for good, with a warning. Answers of both kinds share the
    ``/tokenize`` client's LRU cache.
    """

    reports_asked = True  # its /tokenize calls go through TokenizeClient, which sets ASKED

    def __init__(self, options: Mapping[str, Any] | None = None, *, required: bool = False):
        options = dict(options or {})
        self.replica = TokenizeClient(options)
        self.cache = self.replica.cache
        self.base_models = frozenset(options.get("base_models") or ())
        self.max_ids = self.replica.max_ids  # as many ids as a /tokenize answer gives, to compare and cache alike
        self.count_source: Callable[[str], None] | None = None  # set by the tier: llmgw_kv_tokenize_source_total
        self.local: LocalTokenizer | None = None
        self.verify_left = VERIFY_ANSWERS
        self.mismatches = 0
        self._limiter = trio.CapacityLimiter(1)
        path = options.get("tokenizer_path")
        if path and has_tokenizer_files(path):
            try:
                self.local = LocalTokenizer(path)
            except LocalTokenizerError as exc:
                log.warning("routing tokenizes with /tokenize on a replica: %s", exc)
        elif required:
            log.warning("tokenizer: local needs the model's tokenizer.json; %s has none: asking replicas' /tokenize",
                        path or "no tokenizer_path was given and the profile's model_path")

    @property
    def observe(self):
        return self.replica.observe

    @observe.setter
    def observe(self, value) -> None:
        self.replica.observe = value

    def _count(self, source: str) -> None:
        if self.count_source is not None:
            self.count_source(source)

    async def tokenize(self, replica, body: bytes) -> list[int]:
        local = self.local
        if local is None:
            return await self._remote(replica, body)
        cached = self.cache.get(body)
        if cached is not None:
            self._count("cache")
            return cached
        if len(body) > LOCAL_INLINE_BYTES:
            ids = await trio.to_thread.run_sync(self._local_ids, local, body, limiter=self._limiter)
        else:
            ids = self._local_ids(local, body)
        if ids is None:
            return await self._remote(replica, body)
        ids = ids[:self.max_ids]
        if self.verify_left > 0:
            return await self._verify(replica, body, ids)
        self.cache.put(body, ids)
        self._count("local")
        return ids

    def _local_ids(self, local: LocalTokenizer, body: bytes) -> list[int] | None:
        try:
            request = json.loads(body)
        except ValueError:
            return None
        model = request.get("model") if isinstance(request, dict) else None
        if model is not None and model not in self.base_models:
            return None  # a LoRA adapter's request: its tokenizer may differ
        return local.ids(request)

    async def _remote(self, replica, body: bytes) -> list[int]:
        hit = self.cache.hits
        ids = await self.replica.tokenize(replica, body)
        self._count("cache" if self.cache.hits > hit else "replica")
        return ids

    async def _verify(self, replica, body: bytes, ids: list[int]) -> list[int]:
        self.verify_left -= 1  # taken now: concurrent requests meanwhile use the local answer
        try:
            remote = await self.replica.tokenize(replica, body)
        except TokenizeError:
            self.verify_left += 1  # not verified this time
            self._count("local")
            return ids
        self._count("replica")
        if remote != ids:
            self.mismatches += 1
            self.local = None
            self._count("local_mismatch")
            log.warning("the local tokenizer (%s) disagreed with %s's /tokenize (%d vs %d ids, first difference at "
                        "%d): routing tokenizes with /tokenize from now on", self._describe(), replica.name,
                        len(ids), len(remote), _first_difference(ids, remote))
        return remote

    def _describe(self) -> str:
        return str(self.local.directory) if self.local is not None else "off"


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def local_tokenizer(options: Mapping[str, Any] | None = None) -> LocalFirstTokenizer:
    return LocalFirstTokenizer(options, required=True)


@hookimpl
def register_tokenizer_sources():
    return {"replica": TokenizeClient, "auto": LocalFirstTokenizer, "local": local_tokenizer}
