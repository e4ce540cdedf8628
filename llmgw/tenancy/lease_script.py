"""The one Lua script through which every process takes, renews and gives back its shares of the limits in Redis.

A call carries a batch of operations, one per pool (of any keys and teams): Redis runs them atomically, at its
own time (``TIME``), so the processes' clocks do not matter. Each operation says what the process gives back
(``give``: a share not used), what it owes (``charge``: answers that used more than their reservation), the
least it needs now (``need``: what waiting requests lack; 0 when refilling ahead) and the most it would take
(``want``). It is granted ``want`` or what is left when that is less but at least ``need``, else nothing
(a partial grant no waiter can use would only be held from the others).

- ``b`` a token bucket (rpm, tpm): a hash ``{l: level, t: ms}``; missing means full. The level refills at
  capacity per window; it may go below zero (a charge), never above the capacity.
- ``s`` concurrency slots: a hash ``holder -> slots held`` and a sorted set ``holder -> expiry (ms)``. The
  process says how many it holds now (``have``, absolute: a lost reply or a Redis restart cannot make the count
  drift); holders not renewed before their expiry, or whose expiry is further than 10 TTLs away (nobody writes
  that), are dropped (and counted in the answer), so a process killed with ``kill -9`` frees its slots within the TTL.
- ``g`` a budget: two counters of the period, each expiring a day after it ends: what is *committed* (used,
  plus every process's leases and the reservations in flight on them), which leases are granted from, and what
  was *used* (``:used``: each process reports what its settled answers consumed, ``consumed``, at its next
  call). The committed counter is never below the used one. Their difference is what leases and requests in
  flight hold: a request refused while it is there is told to retry shortly, not that the budget is spent. What
  each process holds of it is kept per holder, as the slots are (``:held``, a hash, and ``:holders``, a sorted set
  of expiries): the process says what it holds now (``have``, absolute: its lease and its reservations in
  flight, after what it gives back and owes), which replaces its record in the committed counter (what it held
  and reports used, ``consumed``, stays there: it moved to the used counter); a holder not
  renewed before its expiry (or whose expiry is further than 10 TTLs away) is dropped by the next call, its
  holding taken off the committed counter, so the share of a process killed with ``kill -9`` goes back to the
  budget within the TTL (at most 64 such holders per call: a writer's flood is worked off over calls).

Every call carries an id, new for each call of a holder (a retry of a call whose answer was lost carries the same
one): the script keeps the answers of the holder's last :data:`REMEMBERED` calls (``calls:HOLDER``, a hash that
expires :data:`CALL_MEMORY_MS` after the holder's last call) and answers a repeated id with the first answer
without applying the call again, so a reply lost after Redis ran the script never counts consumption twice
(a remembered answer that is not JSON, as only a writer leaves it, is no answer: the call is applied).

Whatever Redis holds is clamped before use (someone else may write there): a key of another type is
dropped, a level clamped to ``[-1e15, capacity]``, a time to ``[0, now]``, a holder's slots to ``[0, capacity]``,
a budget's counters to ``[0, 2^53]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BUCKET, SLOTS, BUDGET = "b", "s", "g"
MAX_SPEND = 1 << 53  # Lua's numbers are doubles: exact integers up to here (9 million USD in nano-dollars)
REMEMBERED = 4  # answers of a holder's last calls kept for a repeat (it only ever repeats its last: a few for safety)
CALL_MEMORY_MS = 600_000  # ... for this long after its last call (a retry after that is given up: redis_limiter)

LEASE = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function num(v, lo, hi)
  v = tonumber(v)
  if v == nil or v ~= v then return lo end
  if v < lo then return lo end
  if v > hi then return hi end
  return v
end
local function fit(key, kind)
  local found = redis.call('TYPE', key)['ok']
  if found ~= 'none' and found ~= kind then redis.call('DEL', key) end
end
local function grant_of(avail, need, want)
  if want <= 0 or avail < need or avail <= 0 then return 0 end
  return math.min(want, avail)
end
fit(KEYS[2], 'hash')
local first = redis.call('HGET', KEYS[2], ARGV[3])
if first then
  local ok, answer = pcall(cjson.decode, first)
  if ok then return answer end
end
if ARGV[2] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then
  return 'unseeded'
end
local out = {}
local k, a = 3, 4
for i = 1, tonumber(ARGV[1]) do
  local kind = ARGV[a]
  local cap = tonumber(ARGV[a + 1])
  if kind == 'b' then
    local key, window = KEYS[k], tonumber(ARGV[a + 2])
    local need, want, give, charge = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]),
      tonumber(ARGV[a + 6])
    k, a = k + 1, a + 7
    fit(key, 'hash')
    local state = redis.call('HMGET', key, 'l', 't')
    local level = cap
    if state[1] then
      level = num(state[1], -1e15, cap)
      local at = num(state[2], 0, now)
      level = math.min(cap, level + (now - at) * cap / window)
    end
    level = math.min(cap, level + give) - charge
    local grant = grant_of(math.floor(level), need, want)
    level = level - grant
    if level >= cap then
      redis.call('DEL', key)
    else
      redis.call('HSET', key, 'l', string.format('%.6f', level), 't', now)
      redis.call('PEXPIRE', key, math.ceil(window * 2 + (cap - level) * window / math.max(cap, 1)))
    end
    out[i] = {string.format('%d', grant), string.format('%.6f', level)}
  elseif kind == 's' then
    local hkey, zkey = KEYS[k], KEYS[k + 1]
    local holder, have, need, want, ttl = ARGV[a + 2], tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]),
      tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
    k, a = k + 2, a + 7
    fit(hkey, 'hash')
    fit(zkey, 'zset')
    local all = redis.call('HGETALL', hkey)
    local others, dropped = 0, 0
    for j = 1, #all, 2 do
      if all[j] ~= holder then
        local expiry = tonumber(redis.call('ZSCORE', zkey, all[j]))
        if expiry == nil or expiry <= now or expiry > now + 10 * ttl then
          redis.call('HDEL', hkey, all[j])
          redis.call('ZREM', zkey, all[j])
          dropped = dropped + 1
        else
          others = others + num(all[j + 1], 0, cap)
        end
      end
    end
    local free = cap - others - have
    local grant = grant_of(free, need, want)
    local mine = have + grant
    if mine > 0 then
      redis.call('HSET', hkey, holder, mine)
      redis.call('ZADD', zkey, now + ttl, holder)
    else
      redis.call('HDEL', hkey, holder)
      redis.call('ZREM', zkey, holder)
    end
    redis.call('PEXPIRE', hkey, 20 * ttl)
    redis.call('PEXPIRE', zkey, 20 * ttl)
    out[i] = {string.format('%d', grant), string.format('%d', math.max(0, free - grant)),
      string.format('%d', dropped)}
  else
    local key, ukey, hkey, zkey = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
    local need, want, have, expire_at, consumed, holder, ttl = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
      num(ARGV[a + 4], 0, 9007199254740992), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]), ARGV[a + 7],
      tonumber(ARGV[a + 8])
    k, a = k + 4, a + 9
    fit(key, 'string')
    fit(ukey, 'string')
    fit(hkey, 'hash')
    fit(zkey, 'zset')
    local spent = num(redis.call('GET', key), 0, 9007199254740992)
    local used = math.min(num(redis.call('GET', ukey), 0, 9007199254740992) + consumed, 9007199254740992)
    local lapsed = redis.call('ZRANGEBYSCORE', zkey, '-inf', now, 'LIMIT', 0, 64)
    local forged = redis.call('ZRANGEBYSCORE', zkey, '(' .. (now + 10 * ttl), '+inf', 'LIMIT', 0, 64)
    local dropped = 0
    for _, gone in ipairs({lapsed, forged}) do
      for _, other in ipairs(gone) do
        if other ~= holder then
          spent = spent - num(redis.call('HGET', hkey, other), 0, 9007199254740992)
          redis.call('HDEL', hkey, other)
          redis.call('ZREM', zkey, other)
          dropped = dropped + 1
        end
      end
    end
    local before = num(redis.call('HGET', hkey, holder), 0, 9007199254740992)
    spent = math.max(used, math.max(0, spent - before) + have + consumed)  -- what was held and is now used stays
    local grant = grant_of(cap - spent, need, want)
    spent = spent + grant
    if have + grant > 0 then
      redis.call('HSET', hkey, holder, string.format('%d', have + grant))
      redis.call('ZADD', zkey, now + ttl, holder)
    else
      redis.call('HDEL', hkey, holder)
      redis.call('ZREM', zkey, holder)
    end
    redis.call('SET', key, string.format('%d', spent))
    redis.call('SET', ukey, string.format('%d', used))
    if expire_at > 0 then
      for _, counter in ipairs({key, ukey, hkey, zkey}) do redis.call('PEXPIREAT', counter, expire_at) end
    end
    out[i] = {string.format('%d', grant), string.format('%d', math.max(0, cap - spent)),
      string.format('%d', math.max(0, cap - used)), string.format('%d', dropped)}
  end
end
redis.call('HSET', KEYS[2], ARGV[3], cjson.encode(out))
redis.call('HDEL', KEYS[2], tostring(tonumber(ARGV[3]) - REMEMBERED_CALLS))
redis.call('PEXPIRE', KEYS[2], CALL_MEMORY_MS)
return out
""".replace("REMEMBERED_CALLS", str(REMEMBERED)).replace("CALL_MEMORY_MS", str(CALL_MEMORY_MS))


# Raise each budget counter (committed and used) to at least what the usage store says was spent in its period (a
# Redis that restarted without persistence forgot it), and set the marker (KEYS[1]) saying it was done; idempotent,
# so every process of a cluster may seed the same rows. A process that seeds asks LEASE to lease nothing while the
# marker is missing (``unseeded``: Redis lost its data since): it seeds again first, then asks again.
SEED = r"""
redis.call('SET', KEYS[1], '1')
for i = 2, #KEYS do
  local key = KEYS[i]
  local floor, expire_at = tonumber(ARGV[2 * i - 3]), tonumber(ARGV[2 * i - 2])
  local found = redis.call('TYPE', key)['ok']
  if found ~= 'none' and found ~= 'string' then redis.call('DEL', key) end
  local spent = tonumber(redis.call('GET', key))
  if spent == nil or spent ~= spent or spent < floor then
    redis.call('SET', key, string.format('%d', floor))
  end
  if expire_at > 0 then redis.call('PEXPIREAT', key, expire_at) end
end
return #KEYS - 1
"""


@dataclass(frozen=True, slots=True)
class Operation:
    """One pool's part of a lease call. ``extra`` is the bucket's window (ms), the slots' holder, or the budget's
    expiry (Unix ms, 0: none); ``have`` is what this process holds after ``give`` (slots; a budget's lease and
    reservations in flight), renewed for ``ttl_ms``."""

    kind: str
    keys: tuple[str, ...]
    capacity: int
    need: int
    want: int
    give: int = 0
    charge: int = 0
    extra: int | str = 0
    have: int = 0
    ttl_ms: int = 0
    consumed: int = 0  # a budget: what settled answers used since the last call (moved from leased to used)


UNSEEDED = b"unseeded"
FIELDS = {BUCKET: 2, SLOTS: 3, BUDGET: 4}  # of an operation's answer


def calls_key(prefix: str, holder: str) -> str:
    """Where the answers of a holder's last calls are remembered (see the module's doc)."""
    return f"{prefix}calls:{holder}"


def encode(operations: list[Operation], marker: str, seeded: bool, holder: str, calls: str,
           call_id: int) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one call of :data:`LEASE` by ``holder``, its ``call_id`` remembered in ``calls``;
    ``seeded``: lease nothing unless the ``marker`` key of :data:`SEED` is there."""
    keys: list[str] = [marker, calls]
    args: list[Any] = [len(operations), 1 if seeded else 0, call_id]
    for op in operations:
        keys += op.keys
        if op.kind == BUCKET:
            args += [BUCKET, op.capacity, op.extra, op.need, op.want, op.give, op.charge]
        elif op.kind == SLOTS:
            args += [SLOTS, op.capacity, op.extra, op.have, op.need, op.want, op.ttl_ms]
        else:
            args += [BUDGET, op.capacity, op.need, op.want, op.have, op.extra, op.consumed, holder, op.ttl_ms]
    return keys, args


class Unseeded(Exception):
    """Redis has no marker of the budgets' seeds (it restarted empty): seed, then ask again."""


@dataclass(frozen=True, slots=True)
class Answer:
    granted: int  # what the process now holds more
    left: float  # what is left in Redis after the grant (a bucket's level, free slots, a budget's remainder)
    unused: float = 0.0  # a budget: what its use so far leaves (``left`` plus what leases and requests hold)
    dropped: int = 0  # slots, a budget: holders this call dropped, not renewed within their TTL


def decode(reply: Any, operations: list[Operation]) -> list[Answer]:
    """The script's reply, one :class:`Answer` per operation, clamped to what was asked; :class:`Unseeded` if
    Redis lost the budgets' seeds, ``ValueError`` if it is not the script's shape."""
    if reply == UNSEEDED:
        raise Unseeded()
    if not isinstance(reply, list) or len(reply) != len(operations):
        raise ValueError(f"the lease script answered {reply!r:.200}")
    answers = []
    for item, op in zip(reply, operations):
        if not isinstance(item, list) or len(item) != FIELDS[op.kind]:
            raise ValueError(f"the lease script answered {item!r:.200}")
        try:
            granted, left = int(item[0]), _bounded(item[1], op.capacity)
            unused = _bounded(item[2], op.capacity) if op.kind == BUDGET else left
            dropped = max(0, min(int(item[-1]), 1000)) if op.kind != BUCKET else 0
        except OverflowError:  # an infinite number
            raise ValueError(f"the lease script answered {item!r:.200}") from None
        answers.append(Answer(max(0, min(granted, op.want)), left, max(left, unused), dropped))
    return answers


def _bounded(value: Any, capacity: int) -> float:
    number = float(value)
    if number != number:  # NaN
        return 0.0
    return max(-1e15, min(number, float(capacity)))
