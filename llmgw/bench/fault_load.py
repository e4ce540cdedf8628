"""A steady load on an llmgw data plane that tells a failed request from one that never started.

Used by ``llmgw bench fault`` and the fault-matrix tests. Each of ``concurrency``
workers sends completions (every ``stream_every``-th one streamed) at its share
of ``rate`` requests per second, on a fresh connection each (as a client behind
a load balancer: no kept-alive connection to a dead process is ever reused).

Every logical request ends in one outcome:

- ``ok``: HTTP 200 and the whole answer (a stream ends with ``data: [DONE]``);
- ``http_<status>``: the gateway answered with an error status;
- ``in_flight``: the connection broke after the request was sent, before any
  answer byte (its start time is kept: only a request in flight when its
  process was killed may end this way);
- ``stream_cut``: a stream broke off after its first bytes;
- ``timeout``: no answer within ``request_timeout``;
- ``gave_up``: the gateway refused connections for the whole ``retry_deadline``.

A connection refused (or reset before the request was sent) is *not started*:
the worker counts it in ``not_started_retries`` and sends the same request
again after ``retry_backoff`` seconds, as a client would.

Given several data planes (``SteadyLoad([url, ...])``: the gateways of a
cluster), request number *n* goes to ``urls[n % len(urls)]`` (round robin), and a
request not started on one is sent again to the next, as a load balancer
would; each outcome is also counted for the data plane of the last attempt
(``by_target``), and each refused connection for the one that refused it
(``refused_by_target``).

With several ``models`` (:class:`LoadSettings`), the requests take them in turn,
so that every data plane is sent each of them.

Outcomes are counted per ``phase``: the label current when the request ended
(a request broken by a kill counts in the phase of the kill, even if it started
before), and each retry in the phase current when it was retried.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import trio

MODEL = "tiny"


@dataclass
class LoadSettings:
    concurrency: int = 4
    rate: float = 20.0  # requests per second, all workers together
    stream_every: int = 4  # every n-th request is streamed (0: none)
    max_tokens: int = 8
    prompt_words: int = 60
    request_timeout: float = 30.0
    retry_backoff: float = 0.2
    retry_deadline: float = 60.0
    api_key: str = ""  # sent as "Authorization: Bearer" with every request ("": none)
    models: tuple[str, ...] = (MODEL,)  # request n asks for models[n // data planes % len(models)]

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, rate_scale: float = 1.0, **more) -> "LoadSettings":
        """The settings :func:`add_load_options` read (``--rate`` times ``rate_scale``); ``more``: other fields."""
        return cls(concurrency=args.concurrency, rate=args.rate * rate_scale, stream_every=args.stream_every,
                   max_tokens=args.max_tokens, **more)


def add_load_options(parser: argparse.ArgumentParser, *, rate: float, concurrency: int, max_tokens: int,
                     rate_help: str = "requests per second") -> None:
    """A benchmark's options of its steady load: ``--rate``, ``--concurrency``, ``--stream-every``, ``--max-tokens``
    (read back with :meth:`LoadSettings.from_args`)."""
    parser.add_argument("--rate", type=float, default=rate, help=f"{rate_help} (default {rate:g})")
    parser.add_argument("--concurrency", type=int, default=concurrency, help=f"load workers (default {concurrency})")
    parser.add_argument("--stream-every", type=int, default=4, help="every n-th request streamed (default 4)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"tokens per answer (default {max_tokens})")


@dataclass
class PhaseCounts:
    """What one phase's requests came to, by kind (``plain`` = non-streamed, ``stream``)."""

    outcomes: dict[str, collections.Counter] = field(
        default_factory=lambda: {"plain": collections.Counter(), "stream": collections.Counter()})
    not_started_retries: int = 0
    lost_started_at: list[float] = field(default_factory=list)  # monotonic start of each in_flight/stream_cut
    # by data plane (the last attempt's): outcome -> count, kinds together; connections each one refused
    by_target: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    refused_by_target: collections.Counter = field(default_factory=collections.Counter)
    first_ok_at: float | None = None  # monotonic end of the phase's first successful request

    def failed(self, kind: str) -> dict[str, int]:
        return {outcome: n for outcome, n in self.outcomes[kind].items() if outcome != "ok"}

    def sent(self) -> int:
        return sum(sum(c.values()) for c in self.outcomes.values())

    def as_dict(self) -> dict:
        return {"sent": self.sent(), "plain": dict(self.outcomes["plain"]), "stream": dict(self.outcomes["stream"]),
                "not_started_retries": self.not_started_retries,
                "by_target": {url: dict(c) for url, c in self.by_target.items()},
                "refused_by_target": dict(self.refused_by_target)}


class SteadyLoad:
    """``async with load.running():`` runs the workers; :attr:`phase` labels what they send from now on."""

    def __init__(self, data_url: str | Sequence[str], settings: LoadSettings | None = None):
        self.data_urls = [data_url] if isinstance(data_url, str) else list(data_url)
        assert self.data_urls, "at least one data plane"
        self.data_url = self.data_urls[0]
        self.settings = settings or LoadSettings()
        self.phase = "warmup"
        self.phases: dict[str, PhaseCounts] = collections.defaultdict(PhaseCounts)
        self.inflight = 0
        self.finished = 0  # requests that ended, every phase
        self._running = trio.Event()
        self._running.set()
        self._numbers = itertools.count()
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else None
        self._http = httpx.AsyncClient(timeout=self.settings.request_timeout, headers=headers,
                                       limits=httpx.Limits(max_keepalive_connections=0))

    @contextlib.asynccontextmanager
    async def running(self):
        """The workers run inside this block; they are cancelled (and the client closed) when it ends."""
        async with self._http, trio.open_nursery() as nursery:
            for worker in range(self.settings.concurrency):
                nursery.start_soon(self._worker, worker)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    async def pause(self) -> None:
        """Stop starting requests, and wait until the ones in flight ended."""
        self._running = trio.Event()
        while self.inflight:
            await trio.sleep(0.02)

    def resume(self) -> None:
        self._running.set()

    async def wait_finished(self, count: int) -> None:
        """Until ``count`` more requests ended (whatever their outcome)."""
        target = self.finished + count
        while self.finished < target:
            await trio.sleep(0.02)

    def failed_phases(self) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
        """The phases where a request failed: phase -> (plain failures, streamed failures), by kind."""
        return {phase: (counts.failed("plain"), counts.failed("stream")) for phase, counts in self.phases.items()
                if counts.failed("plain") or counts.failed("stream")}

    # -- one worker ------------------------------------------------------------------------------------------------

    async def _worker(self, worker: int) -> None:
        s = self.settings
        period = s.concurrency / s.rate
        next_at = trio.current_time() + period * worker / s.concurrency
        while True:
            await trio.sleep_until(next_at)
            await self._running.wait()  # after the sleep: nothing starts once pause() returned
            next_at = max(next_at + period, trio.current_time())
            number = next(self._numbers)
            stream = bool(s.stream_every) and number % s.stream_every == s.stream_every - 1
            self.inflight += 1
            try:
                outcome, started, target = await self._one(number, stream)
            finally:
                self.inflight -= 1
            counts = self.phases[self.phase]
            counts.outcomes["stream" if stream else "plain"][outcome] += 1
            counts.by_target[target][outcome] += 1
            self.finished += 1
            if outcome in ("in_flight", "stream_cut"):
                counts.lost_started_at.append(started)
            elif outcome == "ok" and counts.first_ok_at is None:
                counts.first_ok_at = time.monotonic()

    def body(self, number: int, stream: bool) -> dict:
        topic = number % 8  # a few shared prefixes, so the kv_index tier has something to find
        words = " ".join(f"t{topic}w{i}" for i in range(self.settings.prompt_words))
        models = self.settings.models
        model = models[number // len(self.data_urls) % len(models)]  # every data plane sees every model
        body = {"model": model, "prompt": f"{words} question {number}", "max_tokens": self.settings.max_tokens,
                "ignore_eos": True}
        return body | {"stream": True} if stream else body

    async def _one(self, number: int, stream: bool) -> tuple[str, float, str]:
        """Send one request until it started (on the next data plane after a refusal); its outcome, when its
        last attempt started, and the data plane of that attempt."""
        s = self.settings
        body = self.body(number, stream)
        give_up = time.monotonic() + s.retry_deadline
        urls = self.data_urls
        attempt = number % len(urls)
        while True:
            started = time.monotonic()
            target = urls[attempt % len(urls)]
            try:
                return await self._send(target, body, stream), started, target
            except (httpx.ConnectError, httpx.WriteError):  # refused, or reset before the request was sent
                if time.monotonic() > give_up:
                    return "gave_up", started, target
                counts = self.phases[self.phase]
                counts.not_started_retries += 1
                counts.refused_by_target[target] += 1
                attempt += 1
                await trio.sleep(s.retry_backoff)
            except httpx.TimeoutException:
                return "timeout", started, target

    async def _send(self, data_url: str, body: dict, stream: bool) -> str:
        url = data_url + "/v1/completions"
        if not stream:
            try:
                response = await self._http.post(url, json=body)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                return "in_flight"
            return "ok" if response.status_code == 200 else f"http_{response.status_code}"
        received = False
        try:
            async with self._http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return f"http_{response.status_code}"
                received = True  # the gateway relayed the engine's head: the stream started
                last = ""
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        last = line
                return "ok" if last == "data: [DONE]" else "stream_cut"
        except (httpx.ReadError, httpx.RemoteProtocolError):
            return "stream_cut" if received else "in_flight"
