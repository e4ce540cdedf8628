"""The key store of a cluster (``state.backend: redis``, and ``llmgw serve --workers``): API keys and teams in
the cluster's Redis, each record signed with the cluster secret.

Under ``<prefix>tenancy:``: ``keys`` (a hash: key id -> record), ``teams`` (team name -> record), ``key_names``
(key name -> the key id that claimed it) and ``version`` (a counter). Every write is one script that changes a
hash and increments the version together, and claims a new name in the same step: a key's name is taken when
another key that still exists claimed it, a new team's when the team exists (:class:`~.keys.NameTaken`). Every
gateway asks the version every :data:`~.keys.POLL_SECONDS` and reads both hashes again, in one script, when it
changed.

A record is ``msgpack([body, HMAC(secret, kind, field, body)])``, ``body`` the JSON of :mod:`.codec`: the
signature binds it to its hash and field, so a record cannot be moved to another key id either. What anyone who
can write to Redis might do is bounded where it is read: the read script returns at most ``max_keys`` keys and
``max_teams`` teams and skips any value longer than :data:`~.codec.MAX_RECORD_BYTES` (it says how many it
skipped); a record not signed with the secret, or malformed, is refused, counted
(``llmgw_tenant_refused_records_total``) and never admitted. A record once valid can be written back after it
was deleted (a revoked key replayed): docs/security.md says why Redis's ACLs must keep writers out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..cluster import records
from ..cluster.link import Unavailable
from . import codec
from .directory import KeyEntry, TeamEntry
from .keys import NameTaken, Stored, StoreUnavailable

if TYPE_CHECKING:
    from ..cluster.link import RedisLink

T = TypeVar("T")
KEY, TEAM = b"key", b"team"
SCAN_COUNT = 512

# The version, as at most 32 bytes: a writer's longer value reads as a short one that changes with it.
# KEYS: version.
VERSION = """
local version = redis.call('GET', KEYS[1])
if version and #version > 32 then version = string.sub(version, 1, 24) .. '~' .. #version end
return version
"""
# KEYS: version, keys, teams; ARGV: max keys, max teams, max record bytes, scan count.
# -> {version ('' for none, shortened as VERSION does), key fields and values..., skipped keys, team fields and
# values..., skipped teams}; a field longer than a key id or team name is skipped as a long value is, and a hash
# is scanned no further than its bound and 1,000 skipped entries (a hash a writer filled never stalls Redis long).
READ = """
local function bounded(hash, most, longest, count)
  local out, skipped, cursor, scanned = {}, 0, '0', 0
  repeat
    local page = redis.call('HSCAN', hash, cursor, 'COUNT', count)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      scanned = scanned + 1
      if #out < 2 * most and #page[2][i] <= 64 and #page[2][i + 1] <= longest then
        out[#out + 1] = page[2][i]
        out[#out + 1] = page[2][i + 1]
      else
        skipped = skipped + 1
      end
    end
  until cursor == '0' or #out >= 2 * most or scanned >= most + 1000
  return out, skipped
end
local keys, skipped_keys = bounded(KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4]))
local teams, skipped_teams = bounded(KEYS[3], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]))
local version = redis.call('GET', KEYS[1]) or ''
if #version > 32 then version = string.sub(version, 1, 24) .. '~' .. #version end
return {version, keys, skipped_keys, teams, skipped_teams}
"""
# KEYS: version, hash, names; ARGV: field, value ('' and delete: HDEL), name claimed for field ('': none), name
# given up ('': none), '1' when the field is new -> the new version (a version that is no counter, as a writer may
# leave it, starts again at 1: it differs from what every gateway read, so they read again), or {'taken', owner}
# and nothing written when the claimed name is another existing key's, or the new field exists.
WRITE = """
if redis.call('TYPE', KEYS[3])['ok'] ~= 'hash' then redis.call('DEL', KEYS[3]) end
if ARGV[5] == '1' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'taken', ARGV[1]} end
if ARGV[3] ~= '' then
  local owner = redis.call('HGET', KEYS[3], ARGV[3])
  if owner and owner ~= ARGV[1] and redis.call('HEXISTS', KEYS[2], owner) == 1 then return {'taken', owner} end
end
if ARGV[2] == '' then redis.call('HDEL', KEYS[2], ARGV[1]) else redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[3], ARGV[4]) == ARGV[1] then redis.call('HDEL', KEYS[3], ARGV[4]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[3], ARGV[3], ARGV[1]) end
local version = redis.pcall('INCR', KEYS[1])
if type(version) == 'table' and version.err then
  redis.call('SET', KEYS[1], 1)
  return 1
end
return version
"""


class RedisKeyStore:
    def __init__(self, link: "RedisLink", prefix: str, signer: records.Signer, *, max_keys: int, max_teams: int):
        """``prefix``: the cluster's key prefix (``records.Keys(cluster).prefix``)."""
        self.link = link
        self.signer = signer
        self.max_keys = max_keys
        self.max_teams = max_teams
        self.version_key = prefix + "tenancy:version"
        self.keys_key = prefix + "tenancy:keys"
        self.teams_key = prefix + "tenancy:teams"
        self.names_key = prefix + "tenancy:key_names"

    async def version(self) -> object:
        keys = [self.version_key]
        return await self._call("tenancy_version", lambda client: client.eval(VERSION, keys=keys))

    async def read(self) -> Stored:
        keys = [self.version_key, self.keys_key, self.teams_key]
        args = [self.max_keys, self.max_teams, codec.MAX_RECORD_BYTES + 128, SCAN_COUNT]
        answer = await self._call("tenancy_read", lambda client: client.eval(READ, keys=keys, args=args))
        if not isinstance(answer, list) or len(answer) != 5:
            raise StoreUnavailable(f"the read script answered {str(answer)[:200]}")
        version, key_fields, skipped_keys, team_fields, skipped_teams = answer
        refused = {"key": int(skipped_keys), "team": int(skipped_teams)}
        found_keys = self._decoded(KEY, key_fields, codec.decode_key, lambda entry: entry.key_id, refused, "key")
        found_teams = self._decoded(TEAM, team_fields, codec.decode_team, lambda entry: entry.name, refused, "team")
        # what a version read alone answers: bytes, or None for no version yet
        return Stored(version or None, found_keys, found_teams, {kind: n for kind, n in refused.items() if n})

    async def put_key(self, entry: KeyEntry, *, new: bool = False, renamed_from: str | None = None) -> None:
        claim = entry.name if new or renamed_from is not None else ""
        await self._write(self.keys_key, KEY, entry.key_id, codec.encode_key(entry), new=new, claim=claim,
                          release=renamed_from or "")

    async def delete_key(self, key_id: str, name: str | None = None) -> None:
        await self._write(self.keys_key, KEY, key_id, None, release=name or "")

    async def put_team(self, entry: TeamEntry, *, new: bool = False) -> None:
        await self._write(self.teams_key, TEAM, entry.name, codec.encode_team(entry), new=new)

    async def delete_team(self, name: str) -> None:
        await self._write(self.teams_key, TEAM, name, None)

    def seal(self, kind: bytes, field: str, body: bytes) -> bytes:
        """The record stored for ``body`` in ``field``: the body and its signature."""
        return records.pack([body, self.signer.sign(b"llmgw tenancy", kind, field.encode(), body)])

    async def _write(self, hash_key: str, kind: bytes, field: str, body: bytes | None, *, new: bool = False,
                     claim: str = "", release: str = "") -> None:
        value = b"" if body is None else self.seal(kind, field, body)
        keys = [self.version_key, hash_key, self.names_key]
        args = [field, value, claim, release, "1" if new else ""]
        answer = await self._call("tenancy_write", lambda client: client.eval(WRITE, keys=keys, args=args))
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == b"taken":
            owner = answer[1].decode("utf-8", "replace") if isinstance(answer[1], bytes) else str(answer[1])
            raise NameTaken(kind.decode(), owner)

    async def _call(self, operation: str, command: Callable[[Any], Any]) -> Any:
        try:
            return await self.link.call(operation, command)
        except Unavailable as exc:
            raise StoreUnavailable(str(exc)) from None

    def _decoded(self, kind: bytes, fields: object, decode: Callable[[bytes], T], field_of: Callable[[T], str],
                 refused: dict[str, int], label: str) -> list[T]:
        entries: list[T] = []
        if not isinstance(fields, list):
            return entries
        for i in range(0, len(fields) - 1, 2):
            field, raw = fields[i], fields[i + 1]
            try:
                name = field.decode("utf-8") if isinstance(field, bytes) else str(field)
                body, signature = records.unpack(raw, codec.MAX_RECORD_BYTES + 128, 2)
                if not isinstance(body, bytes) or not self.signer.valid(signature, b"llmgw tenancy", kind,
                                                                        name.encode(), body):
                    raise codec.RecordError("not signed with the cluster secret")
                entry = decode(body)
                if field_of(entry) != name:
                    raise codec.RecordError("stored under another name")
                entries.append(entry)
            except (records.RecordError, codec.RecordError, UnicodeDecodeError, ValueError, TypeError):
                refused[label] += 1
        return entries
