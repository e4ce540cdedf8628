"""The shared state of one gateway process, by role: what it writes to Redis, what it follows, what it shares.

With ``state.backend: redis`` every ``llmgw serve`` of a cluster runs one
:class:`SharedState` in its root nursery:

- a **candidate** (started without ``--role gateway``) stands for the
  cluster's lease (:mod:`.election`); through each term it wins it leads
  (:class:`~.term.LeaderTerm`, reached as :attr:`SharedState.term`): its
  control plane's replica sources and KV feeds write through the term's
  published table and index, which apply every change locally and record it
  for the term's :class:`~.writer.LogWriter`, and it answers the other
  gateways' resync asks; between terms it follows like a gateway;
- a **gateway** process (``--role gateway``) runs no control plane: its replica
  table and KV index follow the control process's (:class:`~.follower.LogFollower`),
  and a drifted index asks the control process for a resync through Redis;
- both publish their own in-flight load and read the others'
  (:class:`~.load.LoadSharing`), and, with ``share_learning`` (the default),
  the predictions their ``kv_index`` tiers make and apply the others'
  (:class:`~.learn.PredictionSharing`).

The hot path reads only this process's copies; Redis failing degrades the
shared state (metric, ``/health``, one log line) and nothing else.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from ..config.tls import replica_tls_options
from ..engines.probe import VLLM_GAUGES, engine_gauges
from ..logfields import log_fields
from ..router.replica import Replica
from ..router.replicas import DEPLOYED, STATIC
from ..wire.liveness import adoption_window, hold_window
from . import records
from .election import Election, Fence, LeaderWatch, Term
from .follower import FollowedReplicas, LogFollower
from .identities import SharedIdentities, placement_key
from .learn import PredictionSharing
from .link import RedisLink, Unavailable, cluster_secret, previous_cluster_secret
from .load import LoadSharing
from .metrics import ClusterMetrics
from .records import Keys, ReplicaRecord
from .streams import follow_stream
from .term import LeaderTerm
from .tier_learning import TierLearning
from .writer import LogWriter, PublishedKv, PublishedReplicaTable

Lead = Callable[[LeaderTerm], Awaitable[None]]

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..config import Config
    from ..kv.index import KvIndex
    from ..plugins_manager import Registry
    from ..router.replicas import ReplicaSet

log = logging.getLogger(__name__)

CONTROL = "control"
GATEWAY = "gateway"
ROLES = (CONTROL, GATEWAY)
MAX_ASKS = 10_000  # the requests stream's length
ASK_INTERVAL = 5.0  # seconds: one replica is resynced for the other gateways at most once in this time
FAILED_TERM_PAUSE = 5  # lease_ttls a candidate whose control plane failed waits before it stands again


class SharedState:
    def __init__(self, config: "Config", role: str, replicas: "ReplicaSet", kv_index: "KvIndex",
                 registry: "Registry", metrics_registry: "CollectorRegistry | None"):
        assert role in ROLES
        self.config = config
        self.role = role
        self.settings = config.state
        self.origin = uuid.uuid4().hex[:12]
        self.keys = Keys(self.settings.cluster)
        self.metrics = ClusterMetrics(metrics_registry, role, self.settings.cluster, self.origin)
        self.link = RedisLink(self.settings, self.metrics)
        secret = cluster_secret(self.settings)
        previous = previous_cluster_secret(self.settings) if secret is not None else None
        self.signer = records.Signer(secret, previous, self.metrics.previous_secret.inc)
        self.placement_key = placement_key(secret)
        self.previous_placement_key = placement_key(previous)  # proofs under it are accepted, and issued anew
        self.replicas = replicas
        self.kv_index = kv_index
        self.load = LoadSharing(self.link, self.keys, self.settings, replicas, self.metrics, self.origin, self.signer,
                                config.limits.max_connections)
        self.learn = PredictionSharing(self.link, self.keys, replicas, kv_index, self.metrics, self.origin,
                                       self.signer) if self.settings.share_learning else None
        self.tier_learning = TierLearning(self.link, self.keys, self.metrics, self.origin, self.signer) \
            if self.settings.share_learning else None
        # Every process follows the cluster; a candidate (the control role) also stands for its lease, and while
        # it leads it writes instead (a writer, and the published table and index, for each term).
        self.followed = FollowedReplicas(replicas, ReplicaBuilder(lambda: self.config, registry))
        self.follower = LogFollower(self.link, self.keys, self.followed, kv_index, self.metrics, self.signer)
        self.election = Election(self.link, self.keys, self.settings, self.metrics, self.origin, self.signer) \
            if role == CONTROL else None
        self.leader_watch = LeaderWatch(self.link, self.keys, self.settings, self.signer) if role == GATEWAY else None
        self.identities = SharedIdentities(self.link, self.keys, self.signer, self.metrics)
        self._term: LeaderTerm | None = None
        kv_index.add_resync_listener(self._ask_resync)
        self._asks: list[tuple[str, str, str]] = []
        self._ask_wake = trio.Event()
        self._answered: dict[str, float] = {}  # replica: when an ask for it was last answered
        self._terms_led = 0

    @property
    def term(self) -> LeaderTerm | None:
        """The term this process leads now: None while it follows, and from the moment a term is over (its lease
        expired or was taken, a write was fenced), before what it ran has even unwound."""
        term = self._term
        return term if term is not None and not term.over else None

    @property
    def leading(self) -> bool:
        return self.term is not None

    async def run(self, lead: "Lead | None" = None, settled: Callable[[], bool] | None = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled. A candidate (control role) runs ``lead(term)`` in each term it wins (a
        :class:`~.term.LeaderTerm`); ``settled``: the term's control plane is past its adoption window (nothing is
        published before)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.link.run)
            await nursery.start(self.load.run)
            if self.learn is not None:
                await nursery.start(self.learn.run)
            if self.tier_learning is not None:
                await nursery.start(self.tier_learning.run)
            await nursery.start(self.followed.run)
            nursery.start_soon(self._send_asks)
            if self.election is None:
                await nursery.start(self.follower.run)
                assert self.leader_watch is not None
                await nursery.start(self.leader_watch.run)
            else:
                assert lead is not None
                await nursery.start(self.election.run)
                await nursery.start(self.identities.follow, self.settings.snapshot_interval)  # Redis may lose them
                nursery.start_soon(self._terms, lead, settled or (lambda: True))
            log.info("cluster state: %s %s of cluster %r on Redis at %s", self.role, self.origin,
                     self.settings.cluster, self.link.address)
            task_status.started()

    def listening(self, control_url: str) -> None:
        """This process's control API is up: a candidate stands from now on (the lease names the URL)."""
        if self.election is not None:
            self.election.listening(control_url)

    async def _terms(self, lead: "Lead", settled: Callable[[], bool]) -> None:
        """Follow the cluster until elected; lead through the term; follow again; for ever."""
        assert self.election is not None
        while True:
            async with trio.open_nursery() as following:
                await following.start(self.follower.run)
                term = await self.election.wait_elected()
                following.cancel_scope.cancel()
            await self._lead(term, lead, settled)

    async def _lead(self, lease: Term, lead: "Lead", settled: Callable[[], bool]) -> None:
        """One term: the control plane runs on the table and index this process followed, which it publishes on
        from where the previous leader's log ended when it holds that state exactly (:meth:`LogFollower.catch_up`);
        the replicas it followed stay in routing, held, until ``lead``'s sources claim them (the config's, the
        agents that reconnect) or :attr:`held_for` passes. Everything is written under the term's fence. At the
        end the table and index stay as they are, followed from then on (fail-static until the next leader's log)."""
        assert self.election is not None
        self._terms_led += 1  # in the writer's id: Redis may lose its generation counter (a restart, no persistence)
        failed = False
        continues = await self.follower.catch_up(min(self.settings.timeout, self.settings.lease_ttl / 4))
        self.followed.hold()
        fence = Fence(self.link, self.keys, self.election, lease, self.metrics)
        writer = LogWriter(self.link, self.keys, self.settings, self.replicas, self.kv_index, self.metrics,
                           f"{self.origin}.{lease.generation}.{self._terms_led}", fence, self.signer, continues)
        table, kv = PublishedReplicaTable(self.replicas, writer, self._hand_over), PublishedKv(self.kv_index, writer)
        log.info("cluster state: term %d %s", lease.generation,
                 "continues the log of %s from batch %d" % continues if continues is not None else
                 "starts a new log", extra=log_fields(term=lease.generation, leader=self.origin))
        try:
            with lease.scope:
                async with trio.open_nursery() as nursery:
                    self._term = term = LeaderTerm(lease, writer, table, kv, nursery)
                    # A process that holds the cluster's state (it followed it, or led before) publishes it at
                    # once; only a fresh one waits until its control plane has settled (agents back, KV copies in).
                    known = self.follower.loaded.is_set() or self._terms_led > 1 or continues is not None
                    await term.start(writer.run, (lambda: True) if known else settled)
                    term.start_soon(self._answer_asks)
                    term.start_soon(self._let_held_go, term, self.held_for)
                    await lead(term)
                    nursery.cancel_scope.cancel()  # the control plane stopped (it could not start): so does the term
                    failed = True
        except Exception:  # a bug in the control plane ends the term, never the process (it stands again)
            log.exception("cluster leader: term %d failed", lease.generation,
                          extra=log_fields(term=lease.generation, leader=self.origin))
            failed = True
        finally:
            kv.close()
            self._term = None
            self.followed.adopt_all()
            self.follower.restart()
            self.election.end_term("ended", lease)
            if failed:  # let another candidate lead; this one stands again later
                self.election.pause(FAILED_TERM_PAUSE * self.settings.lease_ttl)

    @property
    def held_for(self) -> float:
        """How long a new leader routes to the replicas it held from the previous one without a source of its own
        claiming them: until every agent of the previous leader can have noticed and re-registered here
        (:func:`llmgw.wire.liveness.hold_window`)."""
        return hold_window(self.config.agents.heartbeat_interval, self.settings.lease_ttl)

    def _hand_over(self, replica: Replica) -> ReplicaRecord | None:
        record = self.followed.hand_over(replica)
        if record is not None:
            self.metrics.held.labels("claimed").inc()
        return record

    async def _let_held_go(self, term: LeaderTerm, after: float) -> None:
        """The held replicas no source claimed within ``after`` seconds leave routing (and the index), here and
        on every follower."""
        await trio.sleep(after)
        for name, record in self.followed.held().items():
            log.warning("replica %s (%s at %s) leaves routing: held from the previous leader, it was not claimed "
                        "within %gs of this term's start (its agent did not re-register, or the config here does "
                        "not list it)", name, record.model, record.url, after, extra=log_fields(replica=name))
            self.metrics.held.labels("dropped").inc()
            term.writer.record([records.REMOVE, name])
            self.followed.remove(name, "not claimed by the new leader")
            term.kv.remove(name)

    @property
    def leader_holder(self) -> dict[str, Any] | None:
        """The leader as last read from Redis (``origin``, ``control_url``, ``generation``); None when unknown."""
        watch = self.election or self.leader_watch
        return watch.holder if watch is not None else None

    def apply_config(self, config: "Config") -> None:
        """A reload: secrets of followed replicas are looked up in the new config from now on."""
        self.config = config

    async def wait_for_replica(self, model: str, poll: float = 0.05) -> bool:
        """A request that found no replica at start waits for the first snapshot (gateway role)."""
        return bool(await self._wait_loaded(self.has_state)) and any(
            replica.routable for replica in self.replicas.members(model))

    @property
    def has_state(self) -> bool:
        """Whether this process holds a copy of the cluster's models and replicas to route on: it leads, it led
        (its last term's table, kept when the term ended, even if it never loaded a snapshot: the one that led
        from a cluster's start), it loaded a snapshot, or, a candidate with no copy yet, it routes its own
        config's static replicas."""
        return self.leading or self._terms_led > 0 or self.follower.loaded.is_set() or bool(self.followed.followed)

    @property
    def knows_models(self) -> bool:
        """Whether a model unknown here is unknown to the cluster: it leads or led, or loaded a snapshot (its own
        config's static replicas, routed meanwhile, say nothing of the models the cluster deploys)."""
        return self.leading or self._terms_led > 0 or self.follower.loaded.is_set()

    async def wait_for_models(self) -> bool | None:
        """Before the first snapshot, a follower does not know the cluster's models yet: wait for it. None when
        nothing is pending (:attr:`knows_models`), else whether it came in time."""
        return await self._wait_loaded(self.knows_models)

    async def _wait_loaded(self, known: bool) -> bool | None:
        if known:
            return None
        return await self.follower.wait_loaded(adoption_window(self.config.agents.heartbeat_interval))

    def describe(self) -> dict[str, Any]:
        """For ``/health`` and ``/admin/cluster``."""
        answer: dict[str, Any] = {"backend": "redis", "role": self.role, "cluster": self.settings.cluster,
                                  "origin": self.origin, "redis": self.link.address, "degraded": not self.link.healthy,
                                  "reason": self.link.reason or None, "peers": self.load.describe(),
                                  "share_learning": self.learn is not None}
        watch = self.election or self.leader_watch
        if watch is not None:
            answer["leader"] = watch.describe()
        term = self.term
        if term is not None:
            writer = term.writer
            answer["log"] = {"writer": writer.writer_id, "seq": writer.seq, "published": writer.published}
        else:
            answer["log"] = {"writer": self.follower.writer, "seq": self.follower.seq,
                             "loaded": self.follower.loaded.is_set()}
        return answer

    # -- resync asks: a follower's drifted index, answered by the control plane's agents ---------------------------

    def _ask_resync(self, replica_id: str, mode: str, reason: str) -> None:
        if self.leading:
            return  # the control plane here hears it itself
        if len(self._asks) < 1000:
            self._asks.append((replica_id, mode, reason))
            self._ask_wake.set()

    async def _send_asks(self) -> None:
        while True:
            await self._ask_wake.wait()
            self._ask_wake = trio.Event()
            asks, self._asks = self._asks, []
            try:
                for replica_id, mode, reason in asks:
                    ask = records.pack(["resync", replica_id, mode, reason[:records.MAX_NAME]])
                    fields = {b"o": self.origin.encode(), b"a": ask}
                    fields[b"s"] = self.signer.sign(fields[b"o"], fields[b"a"])
                    await self.link.add_to_stream("ask", self.keys.requests, fields, MAX_ASKS)
            except Unavailable:
                pass  # the index asks again every resync_retry seconds while it stays suspect

    async def _answer_asks(self) -> None:
        await follow_stream(self.link, "ask_read", self.keys.requests, self._answer_all, stream="requests",
                            max_bytes=lambda: records.MAX_ASK_BYTES + records.ENTRY_FIELDS_BYTES, count=100)

    def _answer_all(self, asks: list[dict[str, Any]]) -> None:
        for fields in asks:
            self._answer(fields)

    def _answer(self, fields: dict[str, Any]) -> None:
        try:
            if not self.signer.valid(fields.get("s"), fields.get("o", b""), fields.get("a", b"")):
                raise records.RecordError("not signed with the cluster secret")
            origin = fields["o"].decode()[:64]
            kind, replica_id, mode, reason = records.unpack(fields["a"])
            if kind != "resync" or mode not in ("full", "reset") or not isinstance(replica_id, str):
                raise records.RecordError("not a resync ask")
        except (KeyError, ValueError, TypeError, AttributeError, records.RecordError):
            self.metrics.bad_records.labels("requests").inc()
            return
        term = self.term
        if term is None:
            return  # the term just ended
        if self.replicas.get(replica_id) is None:
            self.metrics.asks.labels("unknown").inc()  # no replica of this control plane: nothing to resync
            return
        now = trio.current_time()
        if now < self._answered.get(replica_id, -ASK_INTERVAL) + ASK_INTERVAL:
            self.metrics.asks.labels("repeated").inc()  # the resync under way answers this one too
            return
        if len(self._answered) >= 1024:
            self._answered = {name: at for name, at in self._answered.items() if now < at + ASK_INTERVAL}
        self._answered[replica_id] = now
        self.metrics.asks.labels("answered").inc()
        term.kv.remote_resync(replica_id, mode, f"{str(reason)[:300]} (seen by gateway {origin})")


class ReplicaBuilder:
    """A followed replica as this gateway routes to it: the record's address, this gateway's own secrets.

    A static replica must be in this gateway's config under the same name and URL (its API key and TLS come
    from there; a record that points it elsewhere is refused, so Redis can never send a key to another
    address). A deployed replica gets its profile's API key and its engine's load gauges.
    """

    def __init__(self, config: Callable[[], "Config"], registry: "Registry"):
        self.config = config
        self.registry = registry

    def __call__(self, record: ReplicaRecord) -> Replica:
        config = self.config()
        labels = dict(record.labels)
        if record.source == STATIC:
            for model in config.models:
                for index, spec in enumerate(model.replicas):
                    if (spec.name or f"{model.name}-{index}") == record.name:
                        if spec.url != record.url:
                            raise RefusedRecord(f"replica {record.name} is at {spec.url} in this gateway's config, "
                                                f"not where the cluster says")
                        return Replica(name=record.name, model=record.model, url=spec.url, api_key=spec.api_key,
                                       weight=spec.weight, prefill_tokens_per_s=spec.prefill_tokens_per_s,
                                       priority_scheduling=spec.scheduling_policy == "priority",
                                       labels=labels, engine_id=record.engine_id,
                                       tls=replica_tls_options(spec, config.upstream_tls))
            raise RefusedRecord(f"static replica {record.name} is not in this gateway's config")
        api_key, gauges, prefill, priority = None, VLLM_GAUGES, None, False
        if record.source == DEPLOYED:
            try:
                profile = config.profile(labels.get("profile", ""))
            except KeyError:
                log.warning("replica %s: profile %r is not in this gateway's config: routed without its API key",
                            record.name, labels.get("profile"))
            else:
                api_key, gauges = profile.api_key, engine_gauges(self.registry, profile.engine)
                prefill = profile.prefill_tokens_per_s
                priority = profile.scheduling_policy == "priority"
        return Replica(name=record.name, model=record.model, url=record.url, api_key=api_key,
                       weight=record.weight, prefill_tokens_per_s=prefill, priority_scheduling=priority,
                       labels=labels, gauges=gauges,
                       engine_id=record.engine_id)


class RefusedRecord(ValueError):
    """A replica record this gateway will not route to (logged; the replica stays out)."""
