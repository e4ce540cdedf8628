"""A replica the router can send requests to: its address, state and live load.

A replica is one engine endpoint serving one model (for multi-GPU or
multi-node engines, the rank-0 shard's HTTP endpoint). Its state is what the
health prober and passive failure counting say; ``engine_load`` is what the
engine's own ``/metrics`` said last, when a tier asked for it to be scraped
(:mod:`llmgw.router.load_scraper`), read with ``gauges``: the names its engine
plugin gives, vLLM's for a static replica.

Its load is counted in two halves, because several gateways may route to the
same replica as one cluster (docs/scaling.md) and each must see the others'
requests too:

- ``local_inflight`` (requests this process handed to the replica and not yet
  finished; the data plane counts them) and ``local_inflight_tokens`` (the
  router's estimate of their prompt tokens; ``local_inflight_output_tokens``
  the output they may still write, which with the prompt is the KV cache they
  hold: what the flow room counts) are this process's exact counts,
  and the only load figures anything here increments or decrements;
- ``peer_inflight`` and ``peer_inflight_tokens`` are the other gateways'
  latest figures, 0 alone: the cluster-sharing code replaces them whole (one
  assignment each), never adds to them.

``inflight`` and ``inflight_tokens`` (read-only) are the sums: what tiers,
``explain`` and scorers see. Readers that mean this process alone (the
``llmgw_inflight_requests`` metric: each gateway exports its own) read the
``local_`` fields.

Every connection to a replica (requests, health probes, ``/metrics`` scrapes,
``/tokenize`` calls) goes through the pool :meth:`Replica.open_pool` makes,
so an ``https://`` replica is always spoken to over TLS with its ``tls``
trust options (certificate and host name verified against the system store
by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from ..engines.probe import VLLM_GAUGES, EngineGauges, EngineLoad
from ..http.client import UpstreamPool
from ..tls import TlsClientOptions, client_context
from .engine_itl import EngineItl
from .engine_prefill import EnginePrefillRate


class ReplicaState(str, Enum):
    UNKNOWN = "unknown"  # not probed yet: routable, so a cold start serves at once
    UP = "up"
    DOWN = "down"
    DRAINING = "draining"  # no new requests; in-flight ones finish

    @property
    def routable(self) -> bool:
        return self in (ReplicaState.UP, ReplicaState.UNKNOWN)


@dataclass(eq=False)
class Replica:
    name: str
    model: str
    url: str
    api_key: str | None = field(default=None, repr=False)
    weight: int = 1
    prefill_tokens_per_s: float | None = None  # configured: its prefill rate before it answers (the cost model's prior)
    priority_scheduling: bool = False  # its engine runs vLLM's priority scheduling: requests carry a class's priority
    state: ReplicaState = ReplicaState.UNKNOWN
    reason: str = ""
    local_inflight: int = 0  # this process's requests to it, not finished (the data plane counts them)
    local_inflight_tokens: int = 0  # the router's estimate of their prompt tokens
    local_inflight_output_tokens: int = 0  # their output allowances (router.routed): KV they may come to hold
    peer_inflight: int = 0  # the other gateways' latest figures (assigned whole by the cluster-sharing code)
    peer_inflight_tokens: int = 0
    local_queued_tokens: int = 0  # new (uncached) prompt tokens of this process's requests there without a first token
    local_queued_requests: int = 0  # those requests (the router counts what a tier's Decision.prefill_tokens said)
    peer_queued_tokens: int = 0  # the other gateways' latest figures of the same
    peer_queued_requests: int = 0
    peer_queued_since: float | None = None  # when the oldest of theirs was routed (this process's monotonic clock)
    _queued_at: dict[int, float] = field(default_factory=dict, repr=False)  # this process's queue: ticket -> routed
    consecutive_failures: int = 0
    served: int = 0
    engine_load: EngineLoad | None = None
    prefill_rate: EnginePrefillRate = field(default_factory=EnginePrefillRate, repr=False)  # from its /metrics
    engine_itl: EngineItl = field(default_factory=EngineItl, repr=False)  # its ITL fit, from its /metrics
    pool: UpstreamPool | None = field(default=None, repr=False)
    labels: dict[str, str] = field(default_factory=dict)
    tls: TlsClientOptions = field(default_factory=TlsClientOptions)  # used when the URL is https://
    gauges: EngineGauges = field(default=VLLM_GAUGES, repr=False)  # its engine plugin's; vLLM's for static ones
    # The engine behind it, the same in every gateway of a cluster and new when the engine is (a restart, a new
    # placement): what is learnt of its speed belongs to it. Deployed replicas get replica/generation/pid/start
    # from the control plane; by default, name@url (a static replica's engine is not llmgw's to know).
    engine_id: str = ""

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = f"{self.name}@{self.url}"
        parts = urlsplit(self.url)
        self.host = parts.hostname or "127.0.0.1"
        self.uses_tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.uses_tls else 80)
        self.base_path = parts.path.rstrip("/")
        if self.api_key:
            self.auth_header: tuple[bytes, bytes] | None = (b"authorization", b"Bearer " + self.api_key.encode())
        else:
            self.auth_header = None

    @property
    def routable(self) -> bool:
        return self.state.routable

    @property
    def inflight(self) -> int:
        """Requests in flight to it from the whole cluster: this process's exact count plus its peers' latest."""
        return self.local_inflight + self.peer_inflight

    @property
    def inflight_tokens(self) -> int:
        """Their estimated prompt tokens, this process's plus its peers' latest."""
        return self.local_inflight_tokens + self.peer_inflight_tokens

    @property
    def queued_tokens(self) -> int:
        """Prefill queued there: the new prompt tokens of requests without a first token yet, this process's
        plus its peers' latest."""
        return self.local_queued_tokens + self.peer_queued_tokens

    @property
    def queued_requests(self) -> int:
        """The requests those tokens belong to."""
        return self.local_queued_requests + self.peer_queued_requests

    @property
    def local_queued_since(self) -> float | None:
        """When the oldest request of this process's queue there was routed (monotonic), None when it is empty."""
        return min(self._queued_at.values()) if self._queued_at else None

    @property
    def queued_since(self) -> float | None:
        """When the oldest queued request there, this process's or a peer's, was routed: the engine has been
        working through the queue at least since then (a cost model counts only what is left of it)."""
        times = [t for t in (self.local_queued_since, self.peer_queued_since) if t is not None]
        return min(times) if times else None

    def queue_prefill(self, ticket: int, tokens: int, now: float) -> None:
        """A request with ``tokens`` to prefill was routed here at ``now`` (``ticket``: its id until unqueued)."""
        self.local_queued_tokens += tokens
        self.local_queued_requests += 1
        self._queued_at[ticket] = now

    def unqueue_prefill(self, ticket: int, tokens: int) -> None:
        """Its first token came, or it ended: its prefill is off the queue."""
        self.local_queued_tokens = max(0, self.local_queued_tokens - tokens)
        self.local_queued_requests = max(0, self.local_queued_requests - 1)
        self._queued_at.pop(ticket, None)

    def open_pool(self, connect_timeout: float) -> UpstreamPool:
        """A connection pool to this replica: TLS with its trust options when the URL is ``https://``.

        ``OSError``/``ssl.SSLError`` when a CA, certificate or key file cannot be used.
        """
        context = client_context(self.tls) if self.uses_tls else None
        return UpstreamPool(self.host, self.port, connect_timeout=connect_timeout, tls=context,
                            server_hostname=self.host)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "url": self.url,
            "state": self.state.value,
            "reason": self.reason,
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "local_inflight": self.local_inflight,
            "local_inflight_tokens": self.local_inflight_tokens,
            "peer_inflight": self.peer_inflight,
            "peer_inflight_tokens": self.peer_inflight_tokens,
            "queued_tokens": self.queued_tokens,
            "queued_requests": self.queued_requests,
            "local_queued_tokens": self.local_queued_tokens,
            "peer_queued_tokens": self.peer_queued_tokens,
            "served": self.served,
            "engine_load": None if self.engine_load is None else {
                "running": self.engine_load.running, "waiting": self.engine_load.waiting},
            "consecutive_failures": self.consecutive_failures,
            "labels": self.labels,
            "engine_id": self.engine_id,
        }
