"""Who runs the control plane: a lease in Redis, held by one candidate at a time, and the fence on its writes.

With ``state.backend: redis`` every ``llmgw serve`` not started with
``--role gateway`` is a candidate. :class:`Election` tries to take the
cluster's lease (``llmgw:CLUSTER:leader``, set only if absent, with an expiry
of ``state.lease_ttl``) every ``state.lease_renew``; the candidate that takes
it draws the next number of the lease's generation counter (``INCR``) and
holds a :class:`Term` until it cannot renew. The lease's value,
``GENERATION ORIGIN CONTROL_URL``, is the term's fencing token.

A term ends, on the leader's own clock, before its lease can have expired in
Redis: the term's cancel scope has a deadline of the last successful renewal's
*sending* time plus ``lease_ttl`` minus a quarter of it (Redis starts the
expiry later than that), moved on by each renewal. A renewal that finds the
lease taken, or a write that the fence refuses, ends it at once. So a leader
that cannot reach Redis stops placing and writing while its lease still
stands, and no other candidate can have taken it yet.

:class:`Fence` runs the leader's writes to the shared state in one Lua script
that first checks the lease still holds this term's token: a paused old
leader's late write is refused by Redis itself (counted in
``llmgw_cluster_fenced_writes_total``) and ends its term.

Nothing here is reachable by agents: the lease lives in Redis only, and a
candidate is a process with the cluster's Redis credentials.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import trio

from ..logfields import log_fields
from .link import RedisLink, Unavailable
from .records import Keys

if TYPE_CHECKING:
    from ..config.schema import StateConfig
    from .metrics import ClusterMetrics

log = logging.getLogger(__name__)

MAX_HOLDER_BYTES = 600  # a lease value read from Redis (to name the leader) is cut to this

ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current then return {0, current} end
local generation = redis.call('INCR', KEYS[2])
local value = generation .. ' ' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {generation, value}
"""

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

# KEYS[1]: the lease; ARGV[1]: the term's token; then each command as its word count and its words. Only the
# commands the leader's writers use run: the script cannot be turned into a general remote shell by a bad caller.
FENCED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local ALLOWED = {XADD = true, SET = true, PEXPIRE = true, HSET = true, HDEL = true}
local results = {}
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local command = string.upper(ARGV[i + 1])
  if not ALLOWED[command] then
    return redis.error_reply('fenced write: command ' .. command .. ' is not allowed')
  end
  results[#results + 1] = redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return results
"""


ENDINGS = {  # why a term ends: the transition counter's reason label, and what the log line says
    "expired": "its lease could not be renewed in time (Redis unreachable or slow)",
    "taken": "the lease was found taken by another candidate",
    "fenced": "a write was fenced off: the lease is no longer this term's",
    "ended": "its control plane stopped",
}


class Fenced(Unavailable):
    """The lease no longer holds this term's token: the write was refused, and the term is over."""


@dataclass(eq=False)
class Term:
    """One leader's term: its lease generation, its fencing token, and the scope its control plane runs in."""

    generation: int
    token: bytes
    scope: trio.CancelScope

    @property
    def over(self) -> bool:
        return self.scope.cancel_called or trio.current_time() >= self.scope.deadline


def lease_value(generation: int, origin: str, control_url: str) -> bytes:
    return f"{generation} {origin} {control_url}".encode()


def parse_holder(raw: Any) -> dict[str, Any] | None:
    """``{"generation", "origin", "control_url"}`` of a lease value read from Redis; None when it is not one."""
    if not isinstance(raw, bytes) or len(raw) > MAX_HOLDER_BYTES:
        return None
    parts = raw.decode("utf-8", "replace").split(" ")
    if len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()):
        return None
    if not all(part.isascii() and part.isprintable() for part in parts[1:]):
        return None  # it goes into an answer's header, and to agents
    return {"generation": int(parts[0]), "origin": parts[1], "control_url": parts[2]}


class Election:
    """This candidate's campaign: take the lease when it is free, renew it while leading, end the term in time."""

    def __init__(self, link: RedisLink, keys: Keys, settings: "StateConfig", metrics: "ClusterMetrics",
                 origin: str):
        self.link = link
        self.keys = keys
        self.ttl = settings.lease_ttl
        self.renew_every = settings.lease_renew
        self.margin = settings.lease_ttl / 4
        self.metrics = metrics
        self.origin = origin
        self.control_url = ""
        self.term: Term | None = None
        self.holder: dict[str, Any] | None = None  # the leader as last read from Redis (None: no leader known)
        self._elected = trio.Event()
        self._ended: list[Term] = []
        self._stand_after = 0.0
        self._listening = trio.Event()

    def listening(self, control_url: str) -> None:
        """This process's control API is up at ``control_url``: it may stand (the lease names it to agents)."""
        self.control_url = control_url
        self._listening.set()

    def pause(self, seconds: float) -> None:
        """Stand again only ``seconds`` from now (this process's control plane failed: another may lead)."""
        self._stand_after = trio.current_time() + seconds
        log.warning("cluster leader: %s stands again in %gs", self.origin, seconds)

    @property
    def leading(self) -> bool:
        return self.term is not None and not self.term.over

    async def wait_elected(self) -> Term:
        """The next term this candidate wins (it runs its control plane in ``term.scope``)."""
        while True:
            await self._elected.wait()
            term = self.term
            if term is not None and not term.over:
                return term
            self._elected = trio.Event()

    def end_term(self, reason: str, term: Term | None = None) -> None:
        """Stop leading now (``reason``: one of :data:`ENDINGS`): the control plane's scope is cancelled.
        ``term``: only if it is still that one."""
        if term is not None and term is not self.term:
            term.scope.cancel()
            return
        term = self.term
        if term is None:
            return
        self.term = None
        self._elected = trio.Event()
        self._ended.append(term)  # its lease, should it still stand, is given up at once
        term.scope.cancel()
        self.metrics.leader.set(0)
        self.metrics.transitions.labels("follower", reason).inc()
        log.warning("cluster leader: term %d of %s is over (%s): the control plane stops here; this process "
                    "follows the cluster and stands again", term.generation, self.origin, ENDINGS[reason],
                    extra=log_fields(term=term.generation, leader=self.origin))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Campaign until cancelled; on the way out, a leader gives its lease up (another takes over at once)."""
        task_status.started()
        await self._listening.wait()
        try:
            while True:
                while self._ended:
                    await self._release(self._ended.pop())
                term = self.term
                if term is not None and term.over:
                    self.end_term("expired" if not term.scope.cancel_called else "ended")
                    continue
                if term is None and trio.current_time() < self._stand_after:
                    await trio.sleep_until(self._stand_after)
                    continue
                if term is None:
                    await self._stand()
                    if self.term is None:
                        await trio.sleep(self.renew_every)
                else:
                    await trio.sleep_until(min(term.scope.deadline, trio.current_time() + self.renew_every))
                    if not term.over:
                        await self._renew(term)
        finally:
            if self.term is not None:
                self.end_term("ended")
            with trio.CancelScope(shield=True), trio.move_on_after(min(1.0, self.link.settings.timeout)):
                while self._ended:
                    await self._release(self._ended.pop())

    async def _stand(self) -> None:
        keys, origin = self.keys, self.origin
        suffix = f"{origin} {self.control_url}"
        sent = trio.current_time()
        try:
            answer = await self.link.call("lease_acquire", lambda client: client.eval(
                ACQUIRE, keys=[keys.leader, keys.leader_generation], args=[suffix, int(self.ttl * 1000)]),
                timeout=min(self.link.settings.timeout, self.renew_every * 2))
        except Unavailable:
            self.holder = None  # while Redis is away there is no leader anyone can trust
            return
        if not isinstance(answer, list) or len(answer) != 2 or not isinstance(answer[1], bytes):
            log.error("cluster leader: the lease script answered %.200r; standing again later", answer)
            return
        generation, value = int(answer[0]), answer[1]
        self.holder = parse_holder(value)
        if not generation:
            return
        self.term = Term(generation, value, trio.CancelScope(deadline=sent + self.ttl - self.margin))
        self.metrics.leader.set(1)
        self.metrics.elections.inc()
        self.metrics.transitions.labels("leader", "elected").inc()
        log.warning("cluster leader: %s took the lease (term %d): it runs the cluster's control plane now",
                    origin, generation, extra=log_fields(term=generation, leader=origin))
        self._elected.set()

    async def _renew(self, term: Term) -> None:
        keys = self.keys
        sent = trio.current_time()
        remaining = term.scope.deadline - sent
        try:
            renewed = await self.link.call("lease_renew", lambda client: client.eval(
                RENEW, keys=[keys.leader], args=[term.token, int(self.ttl * 1000)]),
                timeout=max(0.01, min(self.link.settings.timeout, remaining)))
        except Unavailable:
            return  # tried again at the next renewal; the term's deadline ends it if none succeeds
        if self.term is not term:
            return
        if renewed:
            term.scope.deadline = sent + self.ttl - self.margin
        else:
            self.end_term("taken", term)

    async def _release(self, term: Term) -> None:
        keys = self.keys
        try:
            released = await self.link.call("lease_release", lambda client: client.eval(
                RELEASE, keys=[keys.leader], args=[term.token]))
        except Unavailable:
            return  # it expires by itself within lease_ttl
        if released:
            log.info("cluster leader: %s gave the lease of term %d up", self.origin, term.generation,
                     extra=log_fields(term=term.generation, leader=self.origin))

    def describe(self) -> dict[str, Any]:
        term = self.term
        return {"leading": self.leading, "term": term.generation if term is not None else None,
                "holder": self.holder, "candidate": True}


class LeaderWatch:
    """Who leads, for a process that does not stand (``--role gateway``): the lease read every ``lease_renew``,
    so its ``/health`` and an agent it refuses name the leader as a candidate's do."""

    def __init__(self, link: RedisLink, keys: Keys, settings: "StateConfig"):
        self.link = link
        self.keys = keys
        self.every = settings.lease_renew
        self.holder: dict[str, Any] | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        lease = self.keys.leader
        while True:
            try:
                raw = await self.link.call("lease_read", lambda client: client.get(lease))
            except Unavailable:
                self.holder = None  # while Redis is away there is no leader anyone can trust
            else:
                self.holder = parse_holder(raw)
            await trio.sleep(self.every)

    def describe(self) -> dict[str, Any]:
        return {"leading": False, "term": None, "holder": self.holder, "candidate": False}


class Fence:
    """The leader's writes, each run by Redis only while the lease still holds the term's token."""

    def __init__(self, link: RedisLink, keys: Keys, election: Election, term: Term, metrics: "ClusterMetrics"):
        self.link = link
        self.keys = keys
        self.election = election
        self.term = term
        self.metrics = metrics

    async def run(self, operation: str, commands: Sequence[Sequence[Any]], timeout: float | None = None) -> list[Any]:
        """Run ``commands`` (each a list of words: ``XADD``, ``SET``, ``PEXPIRE``, ``HSET`` or ``HDEL``)
        atomically under the fence; their results. :class:`Fenced` when the lease is not this term's (the term
        ends), :class:`Unavailable` when Redis fails."""
        args: list[Any] = [self.term.token]
        for command in commands:
            args.append(len(command))
            args.extend(command)
        lease = self.keys.leader
        answer = await self.link.call(operation, lambda client: client.eval(FENCED, keys=[lease], args=args),
                                      timeout=timeout)
        if not isinstance(answer, list):  # 0: the lease is not this term's
            self.metrics.fenced_writes.inc()
            self.election.end_term("fenced", self.term)
            raise Fenced(f"term {self.term.generation}'s lease is gone: {operation} refused")
        return answer
