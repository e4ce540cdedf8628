"""Load shared between the gateways of a cluster: each one's own in-flight requests, seen by all the others.

Every gateway reports its own load per replica (``local_inflight``,
``local_inflight_tokens``: the requests it handed there and their estimated
prompt tokens; ``local_queued_tokens``, ``local_queued_requests``: the prefill
it queued there, requests without a first token yet) to the cluster's ``load`` stream: every ``load_interval``
(50 ms by default) while it changes, and every quarter of ``load_ttl`` when it
does not (a heartbeat). A report is the origin's whole load (a replica not in
it has none from there) and lives ``load_ttl`` seconds (2 by default) after it
arrived, so a gateway that died stops counting within that time.

Each gateway sums the others' latest live reports into each replica's
``peer_*`` figures; what its tiers read (``inflight``, ``inflight_tokens``,
``queued_tokens``, ``queued_requests``) is its own exact count plus those. The hot
path reads only these numbers: nothing on it waits for Redis.

A report also carries the requests the gateway's overload control holds per
model (``q``, from :meth:`LoadSharing.count_queued`'s source: llmgw/flow's room),
so each gateway's room can split the free room among the gateways that have
requests waiting (:meth:`LoadSharing.peer_queued`). And per model what the
others decide with (``f``, :class:`~.records.ModelFigures`, from
:meth:`LoadSharing.report_figures`' source): the requests that entered its
queue, its first tokens within the TTFT SLO, the output allowance in flight, and
the drain rate per band it trusts (:meth:`LoadSharing.peer_figures`), so that the
leader's autoscaler reads the cluster's arrivals and attainment, and a gateway
sheds on the cluster's drain before its own third of it is measured. The cluster
layer does not import the flow layer: the gateway hands each the other's
callables.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import trio

from . import records
from .link import RedisLink, Unavailable
from .records import LOAD_FIGURES as FIGURES, Keys, Load, ModelFigures, RecordError
from .streams import follow_stream

if TYPE_CHECKING:
    from ..config.schema import StateConfig
    from ..router.replicas import ReplicaSet
    from .metrics import ClusterMetrics

log = logging.getLogger(__name__)

LOAD_STREAM_LENGTH = 10_000
NO_FIGURES = ModelFigures()


def combined(reports: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Several reports' figures for one replica: the counts added, the oldest queued request's age kept."""
    if not reports:
        return (0,) * FIGURES
    return (*(sum(r[i] for r in reports) for i in range(FIGURES - 1)), max(r[FIGURES - 1] for r in reports))


class PeerReport:
    __slots__ = ("received", "expires", "load", "queued", "figures")

    def __init__(self, received: float, expires: float, load: Load, queued: dict[str, int] | None = None,
                 figures: dict[str, ModelFigures] | None = None):
        self.received = received  # time.monotonic() when it arrived: the clock of Replica.queued_since
        self.expires = expires
        self.load = load
        self.queued = queued or {}  # model -> requests its overload control holds
        self.figures = figures  # model -> what it measured (None: a gateway of the version before says nothing)


class LoadSharing:
    def __init__(self, link: RedisLink, keys: Keys, settings: "StateConfig", replicas: "ReplicaSet",
                 metrics: "ClusterMetrics", origin: str, signer: records.Signer | None = None,
                 max_requests: int = 10_000):
        """``max_requests``: the most in-flight (or queued) requests one gateway can have on a replica (this
        gateway's ``max_connections``): a peer's report claiming more is clamped to it."""
        self.link = link
        self.signer = signer or records.Signer(None)
        self.keys = keys
        self.settings = settings
        self.replicas = replicas
        self.metrics = metrics
        self.origin = origin
        self.peers: dict[str, PeerReport] = {}
        self._applied: set[str] = set()  # replicas whose peer figures are non-zero
        self.max_requests = max_requests
        self.max_queued = max_requests  # a peer's requests held per model, at most (count_queued sets it)
        self._queued: Callable[[], dict[str, int]] | None = None
        self._figures: Callable[[], dict[str, ModelFigures]] | None = None
        self._listeners: list[Callable[[], None]] = []
        self._crowded_told = False
        self._failures_told: set[str] = set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._publish)
            nursery.start_soon(self._receive)
            nursery.start_soon(self._expire)
            task_status.started()

    # -- this gateway's load ---------------------------------------------------------------------------------------

    def own_load(self) -> Load:
        """This process's figures per replica (:data:`~.records.LOAD_FIGURES`); replicas without any are left out."""
        load: Load = {}
        now = time.monotonic()  # the router's clock for the queue (Router.routed)
        for replica in self.replicas:
            since = replica.local_queued_since
            figures = (replica.local_inflight, replica.local_inflight_tokens, replica.local_queued_tokens,
                       replica.local_queued_requests, 0 if since is None else int((now - since) * 1000))
            if any(figures):
                before = load.get(replica.name)  # two objects of one name while the old one drains
                load[replica.name] = figures if before is None else combined([before, figures])
        return load

    def count_queued(self, source: Callable[[], dict[str, int]], max_queued: int) -> None:
        """Report ``source()`` (requests held per model by this gateway's overload control) with the load, and
        take at most ``max_queued`` per model from a peer's report (what an honest gateway can hold)."""
        self._queued = source
        self.max_queued = max_queued

    def report_figures(self, source: Callable[[], dict[str, ModelFigures]]) -> None:
        """Report ``source()`` (this gateway's figures per model) with the load."""
        self._figures = source

    def own_figures(self) -> dict[str, ModelFigures]:
        """This gateway's figures per model; nothing when its source fails (logged once)."""
        return self._counted(self._figures, "this gateway's figures per model (arrivals, first tokens, drain rates)")

    def peer_figures(self, model: str) -> dict[str, ModelFigures]:
        """What each live peer measured of ``model``, by origin (nothing, for a peer whose report does not list it;
        peers of the version before, whose reports carry no figures, left out)."""
        return {origin: report.figures.get(model, NO_FIGURES) for origin, report in self.peers.items()
                if report.figures is not None}

    def peer_output(self, model: str) -> int | None:
        """The output allowance of the requests every live peer has in flight on ``model``; None when one of them
        does not report it (a gateway of the version before)."""
        total = 0
        for report in self.peers.values():
            if report.figures is None:
                return None
            total += report.figures.get(model, NO_FIGURES).output_inflight
        return total

    def watch(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the peers' figures change (a report arrived, one expired)."""
        self._listeners.append(listener)

    def own_queued(self) -> dict[str, int]:
        """The requests this gateway holds per model (those holding some); nothing when its source fails (logged
        once)."""
        return {model: n for model, n in self._counted(self._queued, "the requests held per model").items() if n > 0}

    def _counted(self, source: Callable[[], dict[str, Any]] | None, what: str) -> dict[str, Any]:
        """``source()``; nothing when it fails (logged once per ``what``: the load report, which every other gateway
        counts on, goes out all the same, without it)."""
        if source is None:
            return {}
        try:
            return source()
        except Exception:
            if what not in self._failures_told:
                self._failures_told.add(what)
                log.exception("cluster state: %s could not be counted; load reports go without them (logged once)",
                              what)
            return {}

    def peer_queued(self, model: str) -> list[int]:
        """The requests each live peer holds for ``model`` (those holding some)."""
        return [n for report in self.peers.values() if (n := report.queued.get(model, 0)) > 0]

    async def _publish(self) -> None:
        settings = self.settings
        heartbeat = settings.load_ttl / 4
        last: tuple[Load, dict[str, int], dict[str, ModelFigures]] | None = None
        sent_at = -1e9
        failures = 0
        while True:
            state = (self.own_load(), self.own_queued(), self.own_figures())
            now = trio.current_time()
            if state != last or now - sent_at >= heartbeat:
                try:
                    await self._send(*state)
                except Unavailable:
                    failures += 1
                    await self.link.backoff(failures)
                    continue
                failures = 0
                last, sent_at = state, now
            await trio.sleep(settings.load_interval)

    async def _send(self, load: Load, queued: dict[str, int] | None = None,
                    figures: dict[str, ModelFigures] | None = None) -> None:
        fields = {b"o": self.origin.encode(), b"x": str(int(self.settings.load_ttl * 1000)).encode(),
                  b"l": records.pack([[name, *figures] for name, figures in load.items()])}
        fields[b"s"] = self.signer.sign(fields[b"o"], fields[b"x"], fields[b"l"])
        if queued:
            fields[b"q"] = records.encode_load_queued(queued)
            fields[b"t"] = self.signer.sign(fields[b"o"], fields[b"x"], fields[b"l"], fields[b"q"])
        if figures:
            fields[b"f"] = records.encode_load_figures(figures)
            fields[b"g"] = self.signer.sign(fields[b"o"], fields[b"x"], fields[b"l"], fields[b"f"])
        await self.link.add_to_stream("load_report", self.keys.load, fields, LOAD_STREAM_LENGTH)
        self.metrics.load_reports.labels("sent").inc()

    # -- the others' load ------------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        await follow_stream(self.link, "load_read", self.keys.load, self.take_reports, stream="load",
                            max_bytes=lambda: records.load_report_bytes(self.limits()) + records.ENTRY_FIELDS_BYTES
                            + records.MAX_QUEUED_BYTES + records.MAX_FIGURES_BYTES)

    def take_reports(self, reports: list[dict[str, Any]]) -> None:
        """One read's reports: recorded, and applied when another gateway's were among them."""
        changed = False
        limits = self.limits()
        for fields in reports:
            changed |= self.take_report(fields, limits)
        if changed:
            self.apply()

    def limits(self) -> records.LoadLimits:
        """What a report may say now: of the replicas in this process's table (and not many more of them), for at
        most ``load_ttl``, at most ``max_requests`` requests each."""
        return records.load_limits(frozenset(replica.name for replica in self.replicas), self.settings.load_ttl,
                                   self.max_requests)

    def take_report(self, fields: dict[str, Any], limits: records.LoadLimits | None = None) -> bool:
        """Record one report from the stream; True when it is another gateway's."""
        try:
            signed = (fields.get("o", b""), fields.get("x", b""), fields.get("l", b""))
            if not self.signer.valid(fields.get("s"), *signed):
                raise RecordError("not signed with the cluster secret")
            if "q" in fields and not self.signer.valid(fields.get("t"), *signed, fields["q"]):
                raise RecordError("its requests held (q) are not signed with the cluster secret")
            if "f" in fields and not self.signer.valid(fields.get("g"), *signed, fields["f"]):
                raise RecordError("its figures per model (f) are not signed with the cluster secret")
            origin, ttl, load = records.decode_load_report(fields, limits or self.limits())
            models = frozenset(self.replicas.declared_models())
            queued = records.decode_load_queued(fields, models, self.max_queued)
            figures = records.decode_load_figures(fields, models)
        except RecordError:
            self.metrics.bad_records.labels("load").inc()
            return False
        if origin == self.origin:
            return False
        if origin not in self.peers and len(self.peers) >= records.MAX_LOAD_ORIGINS:
            self.metrics.load_reports.labels("refused").inc()
            if not self._crowded_told:
                self._crowded_told = True
                log.warning("cluster state: %d other gateways already report load; gateway %s's reports are not "
                            "counted until one of them expires (llmgw_cluster_load_reports{direction=\"refused\"}; "
                            "logged once)", records.MAX_LOAD_ORIGINS, origin)
            return False
        self.metrics.load_reports.labels("received").inc()
        self.peers[origin] = PeerReport(time.monotonic(), trio.current_time() + ttl, load, queued, figures)
        return True

    async def _expire(self) -> None:
        while True:
            await trio.sleep(min(0.1, self.settings.load_ttl / 4))
            now = trio.current_time()
            dead = [origin for origin, report in self.peers.items() if report.expires <= now]
            for origin in dead:
                del self.peers[origin]
                log.info("cluster state: gateway %s sent no load report for %gs; its load no longer counts",
                         origin, self.settings.load_ttl)
            if dead:
                self.apply()

    def apply(self) -> None:
        """Set every replica's peer figures from the live reports: their sums, and their oldest queued request."""
        by_name: dict[str, list[tuple[int, ...]]] = {}
        oldest: dict[str, float] = {}
        for report in self.peers.values():
            for name, figures in report.load.items():
                by_name.setdefault(name, []).append(figures)
                if figures[3]:  # queued requests: the age of their oldest is meaningful
                    since = report.received - figures[4] / 1000
                    oldest[name] = min(since, oldest.get(name, since))
        for replica in self.replicas:
            if replica.name in by_name or replica.name in self._applied:
                total = combined(by_name.get(replica.name, []))
                (replica.peer_inflight, replica.peer_inflight_tokens, replica.peer_queued_tokens,
                 replica.peer_queued_requests) = total[:4]
                replica.peer_queued_since = oldest.get(replica.name)
        self._applied = set(by_name)
        self.metrics.peers.set(len(self.peers))
        for listener in self._listeners:
            listener()

    def describe(self) -> dict[str, Any]:
        now = trio.current_time()
        return {origin: {"expires_in_s": round(report.expires - now, 3),
                         "inflight": {name: figures[0] for name, figures in report.load.items()},
                         "queued_tokens": {name: figures[2] for name, figures in report.load.items() if figures[2]},
                         "held": report.queued}
                for origin, report in self.peers.items()}
