"""Who runs the control plane: a lease in Redis, held by one candidate at a time, and the fence on its writes.

With ``state.backend: redis`` every ``llmgw serve`` not started with
``--role gateway`` is a candidate. :class:`Election` tries to take the
cluster's lease (``llmgw:CLUSTER:leader``, set only if absent, with an expiry
of ``state.lease_ttl``) every ``state.lease_renew``; the candidate that takes
it draws the next number of the lease's generation counter (``INCR``) and
holds a :class:`Term` until it cannot renew. The lease's value,
``GENERATION ORIGIN CONTROL_URL SIGNATURE`` (an HMAC of the rest with the
cluster secret), is the term's fencing token.

A lease not signed with the secret is no candidate's (anyone who can write
to Redis could set one): the leader puts its own back over it at its next
renewal or fenced write and keeps its term; a candidate replaces it once the
last candidate's lease it read can have expired (at once when there is no
leader). Either is a compare-and-set on the exact bad value's SHA-1 in Lua:
the secret never goes to Redis, and a value of any size is read only in its
first ``MAX_HOLDER_BYTES``.

A lease deleted (``DEL``, by anyone who can write to Redis) ends no term
either: the leader's renewal finds it gone while the generation counter still
holds the term's number (no candidate took a term since: every term taken
sets the counter with its lease, atomically) and puts it back, in the same
script. The other candidates leave a gone lease alone until the last lease
they read could have expired, unless its holder left its release mark
beside it (it gave the lease up: taken at once). A lease gone with the
counter (Redis lost its data) ends the term, and the same process, which
stands at once while the others wait, starts a new one that writes the
cluster's state back.

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
from .records import Keys, Signer

if TYPE_CHECKING:
    from ..config.schema import StateConfig
    from .metrics import ClusterMetrics

log = logging.getLogger(__name__)

MAX_HOLDER_BYTES = 700  # a lease value read from Redis (to name the leader) is cut to this
RESTORED_LOG_EVERY = 60.0  # seconds between two log lines of a deleted lease put back

# The lease as a candidate sees it before standing: for the lease and the generation counter, the SHA-1 of the
# value ('' when absent: what ACQUIRE compares, so no value of any size is sent back to Redis) and its first
# ARGV[1] bytes (enough to check a lease's signature: a longer value is none); then the lease's PTTL.
READ_LEASE = """
local limit = tonumber(ARGV[1])
local seen = {}
for _, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value then
    seen[#seen + 1] = redis.sha1hex(value)
    seen[#seen + 1] = string.sub(value, 1, limit)
  else
    seen[#seen + 1] = ''
    seen[#seen + 1] = ''
  end
end
seen[#seen + 1] = redis.call('PTTL', KEYS[1])
return seen
"""

# Take the lease as read (KEYS: the lease, the generation counter; ARGV: [1] the lease's SHA-1 as read ('' absent),
# [2] '1' to replace it whatever its expiry (it is no candidate's: not signed with the cluster secret), [3] the
# counter's SHA-1 as read, [4] the next generation, [5] the new lease, signed, [6] its ttl in ms, [7] the most ms a
# candidate's lease has left). 1 when taken; 0 when either changed since it was read, or the lease stands.
# A lease with no expiry, or with more left than ARGV[7] ms, was written by no candidate (anyone who can write to
# Redis could, and no leader would ever be elected again): it is taken over too.
ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if (current and redis.sha1hex(current) or '') ~= ARGV[1] then return 0 end
local counter = redis.call('GET', KEYS[2])
if (counter and redis.sha1hex(counter) or '') ~= ARGV[3] then return 0 end
if current and ARGV[2] ~= '1' then
  local left = redis.call('PTTL', KEYS[1])
  if left >= 0 and left <= tonumber(ARGV[7]) then return 0 end
end
redis.call('SET', KEYS[2], ARGV[4])
redis.call('SET', KEYS[1], ARGV[5], 'PX', ARGV[6])
return 1
"""
FOREIGN_LEASE_TTLS = 10  # a lease with more than this many of our lease_ttls left is no candidate's

# KEYS: the lease, the generation counter; ARGV: [1] the term's token, [2] its ttl in ms, [3] a read limit, [4] the
# term's generation. 1 when the lease still holds the token and was renewed; 2 when it was gone and put back: the
# counter still holds the term's generation, so no candidate drew a term since (every term taken sets the counter
# with its lease, atomically, in ACQUIRE): a writer deleted the lease alone. {} when it is gone and the counter
# moved on (a later term was drawn); 0 when both are gone (Redis lost its data). Else {SHA-1, first ARGV[3] bytes}
# of what it holds.
RENEW = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not current then
  local counter = redis.call('GET', KEYS[2])
  if counter == ARGV[4] then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 2
  end
  if not counter then return 0 end
  return {}
end
return {redis.sha1hex(current), string.sub(current, 1, tonumber(ARGV[3]))}
"""

# The leader puts its lease back over one no candidate wrote (compare-and-set on the SHA-1 of the exact bad value,
# ARGV[1]; ARGV[2] the term's token, ARGV[3] its ttl): 1 when the lease is the term's again.
RECLAIM = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[2] or (current and redis.sha1hex(current) == ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: the lease, its release mark; ARGV: [1] the term's token, [2] the mark, [3] its ttl in ms. The mark tells
# the other candidates that the lease is gone because its holder gave it up (take it at once), not because a
# writer deleted it (its holder puts it back at its next renewal: wait).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
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
    "lost": "its lease and the generation counter were gone (Redis lost its data): a new term writes the "
            "cluster's state back",
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


def lease_value(generation: int, origin: str, control_url: str, signer: Signer | None = None) -> bytes:
    """``GENERATION ORIGIN CONTROL_URL``, and with a cluster secret `` SIGNATURE`` (hex HMAC of the rest)."""
    body = f"{generation} {origin} {control_url}".encode()
    signature = (signer or Signer(None)).sign(b"lease", body)
    return body + b" " + signature.hex().encode() if signature else body


def release_mark(token: bytes, signer: Signer | None = None) -> bytes:
    """What a leader that gives its lease ``token`` up leaves beside it: an HMAC of it with the cluster secret
    (the token itself without one), so a writer that deletes the lease cannot pass for its holder giving it up."""
    return release_marks(token, signer)[0]


def release_marks(token: bytes, signer: Signer | None = None) -> list[bytes]:
    """Every release mark of ``token`` a candidate accepts: the current secret's, and the previous one's during a
    rotation (a leader not restarted yet signs with what is the others' previous secret)."""
    return [signature.hex().encode() for signature in (signer or Signer(None)).signatures(b"lease released", token)] \
        or [token]


def parse_holder(raw: Any, signer: Signer | None = None) -> dict[str, Any] | None:
    """``{"generation", "origin", "control_url"}`` of a lease value read from Redis; None when it is not one, or
    (with a cluster secret) not signed with it: a lease no candidate wrote."""
    if not isinstance(raw, bytes) or len(raw) > MAX_HOLDER_BYTES:
        return None
    signer = signer or Signer(None)
    parts = raw.split(b" ")
    if signer.secret is not None:
        if len(parts) != 4:
            return None
        try:
            signature = bytes.fromhex(parts.pop().decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        if not signer.valid(signature, b"lease", b" ".join(parts)):
            return None
    texts = [part.decode("utf-8", "replace") for part in parts]
    if len(texts) != 3 or not (texts[0].isascii() and texts[0].isdigit()) or len(texts[0]) > 15:
        return None
    if not all(text.isascii() and text.isprintable() for text in texts[1:]):
        return None  # it goes into an answer's header, and to agents
    return {"generation": int(texts[0]), "origin": texts[1], "control_url": texts[2]}


def next_generation(counter: bytes, seen: int) -> int:
    """The generation after the counter's (any value someone else wrote there counts as none), and after ``seen``."""
    text = counter.decode("ascii", "replace")
    drawn = int(text) if text.isascii() and text.isdigit() and len(text) <= 15 else 0
    return max(drawn, seen) + 1


class Election:
    """This candidate's campaign: take the lease when it is free, renew it while leading, end the term in time."""

    def __init__(self, link: RedisLink, keys: Keys, settings: "StateConfig", metrics: "ClusterMetrics",
                 origin: str, signer: Signer | None = None):
        self.link = link
        self.keys = keys
        self.signer = signer or Signer(None)
        self._generation = 0  # the highest generation seen in a candidate's lease
        # Until when a candidate's lease may stand that this one did not see live (it read one, or just started):
        # its holder may still lead, and puts its own lease back over a forged one first.
        self._live_until = 0.0
        # Until when the last candidate's lease this one read may stand, and its value: a lease found gone before
        # then was deleted by a writer (its holder puts it back at its next renewal), unless its holder left the
        # release mark of that value (it gave the lease up: taken at once).
        self._seen_until = 0.0
        self._seen_lease = b""
        self._forged_told: set[str] = set()  # the leases no candidate wrote that were logged (their SHA-1)
        self._restored_told = 0.0  # when a lease put back over a deleted one was last logged
        self._restored_untold = 0  # put back since (counted, not logged)
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
                if term is not None and term.over:  # a scope past its deadline says cancel_called too
                    self.end_term("expired" if trio.current_time() >= term.scope.deadline else "ended")
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
                        await self.keep(term)
        finally:
            if self.term is not None:
                self.end_term("ended")
            with trio.CancelScope(shield=True), trio.move_on_after(min(1.0, self.link.settings.timeout)):
                while self._ended:
                    await self._release(self._ended.pop())

    async def _stand(self) -> None:
        keys, origin = self.keys, self.origin
        sent = trio.current_time()
        if not self._live_until:
            self._live_until = sent + self.ttl
        timeout = min(self.link.settings.timeout, self.renew_every * 2)
        try:
            seen: Any = await self.link.call("lease_acquire", lambda client: client.eval(
                READ_LEASE, keys=[keys.leader, keys.leader_generation, keys.leader_released],
                args=[MAX_HOLDER_BYTES + 1]), timeout=timeout)
            lease_sha, lease, counter_sha, counter, _, released, left = seen
        except Unavailable:
            self.holder = None  # while Redis is away there is no leader anyone can trust
            return
        except (TypeError, ValueError):
            log.error("cluster leader: the lease script answered %.200r; standing again later", seen)
            return
        holder = parse_holder(lease, self.signer) if lease_sha else None
        if holder is not None:
            self._generation = max(self._generation, holder["generation"])
            if 0 <= left <= FOREIGN_LEASE_TTLS * self.ttl * 1000:
                self.holder = holder
                self._live_until = self._seen_until = sent + left / 1000
                self._seen_lease = lease
                return  # a candidate's lease, live: it leads
        elif lease_sha and sent < self._live_until:
            return  # a forged lease over a live leader's: it puts its own back at its next renewal
        elif not lease_sha and sent < self._seen_until \
                and released not in release_marks(self._seen_lease, self.signer):
            return  # deleted under a live leader (not given up): it puts its lease back at its next renewal
        generation = next_generation(counter, self._generation)
        value = lease_value(generation, origin, self.control_url, self.signer)
        try:
            taken = await self.link.call("lease_acquire", lambda client: client.eval(
                ACQUIRE, keys=[keys.leader, keys.leader_generation],
                args=[lease_sha, "1" if lease_sha and holder is None else "", counter_sha, generation, value,
                      int(self.ttl * 1000), int(FOREIGN_LEASE_TTLS * self.ttl * 1000)]), timeout=timeout)
        except Unavailable:
            self.holder = None
            return
        if taken != 1:
            self.holder = holder
            return  # it changed since it was read: read again at the next round
        if lease_sha:
            self._replaced(lease_sha, lease, "with no expiry or more than %d lease_ttls left" % FOREIGN_LEASE_TTLS
                           if holder is not None else "not signed with the cluster secret", "took it over")
        self._generation = generation
        self.holder = parse_holder(value, self.signer)
        self.term = Term(generation, value, trio.CancelScope(deadline=sent + self.ttl - self.margin))
        self.metrics.leader.set(1)
        self.metrics.elections.inc()
        self.metrics.transitions.labels("leader", "elected").inc()
        log.warning("cluster leader: %s took the lease (term %d): it runs the cluster's control plane now",
                    origin, generation, extra=log_fields(term=generation, leader=origin))
        self._elected.set()

    def _replaced(self, sha: bytes, value: bytes, why: str, done: str) -> None:
        """A lease no candidate wrote was replaced: counted, and logged once per value."""
        self.metrics.bad_records.labels("lease").inc()
        key = sha.decode("ascii", "replace")
        if key in self._forged_told:
            return
        if len(self._forged_told) >= 1024:
            self._forged_told.clear()
        self._forged_told.add(key)
        log.warning("cluster leader: the lease held %.200r, %s, which no candidate writes: %s %s (someone else "
                    "writes to this cluster's Redis keys; logged once per value)", value, why, self.origin, done)

    async def keep(self, term: Term) -> bool:
        """Renew ``term``'s lease: True when it holds the term's token again (renewed, put back over a value no
        candidate wrote, or put back where a writer deleted it: a forged or deleted lease does not end a term); a
        lease taken by a candidate, or gone with a later term drawn, ends the term, and so does one gone with the
        generation counter (Redis lost its data: a new term writes the cluster's state back). Redis failing leaves
        it to the term's deadline.

        Putting a deleted lease back is safe because the renewal is answered before the term's deadline, which is
        before the lease could have expired: a lease gone then was deleted, and the counter still holding the
        term's generation (compared in the same script) says no candidate took a term since."""
        keys = self.keys
        sent = trio.current_time()
        remaining = term.scope.deadline - sent
        timeout = max(0.01, min(self.link.settings.timeout, remaining))
        try:
            answer: Any = await self.link.call("lease_renew", lambda client: client.eval(
                RENEW, keys=[keys.leader, keys.leader_generation],
                args=[term.token, int(self.ttl * 1000), MAX_HOLDER_BYTES + 1, term.generation]), timeout=timeout)
            if answer != 1 and isinstance(answer, list) and len(answer) == 2 and \
                    parse_holder(answer[1], self.signer) is None:
                reclaimed = await self.link.call("lease_renew", lambda client: client.eval(
                    RECLAIM, keys=[keys.leader], args=[answer[0], term.token, int(self.ttl * 1000)]),
                    timeout=timeout)
                if reclaimed == 1:
                    self._replaced(answer[0], answer[1], "not signed with the cluster secret",
                                   f"put its lease of term {term.generation} back")
                    answer = 1
        except Unavailable:
            return False  # tried again at the next renewal; the term's deadline ends it if none succeeds
        if self.term is not term:
            return False
        if answer == 2:
            self._restored(term)
        if answer in (1, 2):
            term.scope.deadline = sent + self.ttl - self.margin
            return True
        self.end_term("lost" if answer == 0 else "taken", term)
        return False

    def _restored(self, term: Term) -> None:
        """The term's lease was put back where a writer deleted it: counted, logged at most once a minute."""
        self.metrics.lease_restored.inc()
        now = trio.current_time()
        if self._restored_told and now - self._restored_told < RESTORED_LOG_EVERY:
            self._restored_untold += 1
            return
        since = f" ({self._restored_untold} more times since the last line)" if self._restored_untold else ""
        self._restored_told, self._restored_untold = now, 0
        log.warning("cluster leader: the lease of term %d was gone from Redis while its generation counter was "
                    "not: someone deleted it; %s put it back and keeps its term%s (someone else writes to this "
                    "cluster's Redis keys; logged at most once a minute, llmgw_cluster_lease_restored_total counts "
                    "each)", term.generation, self.origin, since,
                    extra=log_fields(term=term.generation, leader=self.origin))

    async def _release(self, term: Term) -> None:
        keys = self.keys
        try:
            released = await self.link.call("lease_release", lambda client: client.eval(
                RELEASE, keys=[keys.leader, keys.leader_released],
                args=[term.token, release_mark(term.token, self.signer), int(self.ttl * 1000)]))
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

    def __init__(self, link: RedisLink, keys: Keys, settings: "StateConfig", signer: Signer | None = None):
        self.link = link
        self.keys = keys
        self.signer = signer or Signer(None)
        self.every = settings.lease_renew
        self.ttl = settings.lease_ttl
        self.holder: dict[str, Any] | None = None
        self._read_at = 0.0  # when the holder's lease was last read

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        lease = self.keys.leader
        while True:
            sent = trio.current_time()
            try:
                raw = await self.link.call("lease_read", lambda client: client.getrange(lease, 0, MAX_HOLDER_BYTES))
            except Unavailable:
                self.holder = None  # while Redis is away there is no leader anyone can trust
            else:
                holder = parse_holder(raw or None, self.signer)
                if holder is not None:
                    self.holder, self._read_at = holder, sent
                elif sent - self._read_at >= self.ttl:
                    self.holder = None
                # else a lease gone or forged while the holder's could still stand: its holder puts its own back
                # at its next renewal, and leads meanwhile
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
        if not isinstance(answer, list) and await self.election.keep(self.term):
            # A lease no candidate wrote was in the term's place, and the term's is back: once more.
            answer = await self.link.call(operation, lambda client: client.eval(FENCED, keys=[lease], args=args),
                                          timeout=timeout)
        if not isinstance(answer, list):  # 0: the lease is not this term's
            self.metrics.fenced_writes.inc()
            self.election.end_term("fenced", self.term)
            raise Fenced(f"term {self.term.generation}'s lease is gone: {operation} refused")
        return answer
