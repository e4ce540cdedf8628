"""The key store of a cluster (``state.backend: redis``, and ``llmgw serve --workers``): API keys and teams in
the cluster's Redis, each record signed with the cluster secret.

Under ``<prefix>tenancy:``: ``keys`` (a hash: key id -> record), ``teams`` (team name -> record), ``key_names``
(key name -> the key id that claimed it) and ``version`` (a counter). Every write is one script that changes a
hash and increments the version together, and claims a new name in the same step: a key's name is taken when
another key that still exists claimed it, a new team's when the team exists (:class:`~.keys.NameTaken`). Every
gateway asks the version every :data:`~.keys.POLL_SECONDS` and reads both hashes again, in one script, when it
changed.

A record is ``msgpack([body, HMAC(secret, kind, field, body, revision), revision])``, ``body`` the JSON of
:mod:`.codec`: the signature binds it to its hash and field, so a record cannot be moved to another key id
either, and to its revision (``revision``: a counter that only grows, taken before each write; a write whose
revision is not above the field's last is refused by the script, and made again with a new one). A deletion
leaves a tombstone, ``msgpack([revision, HMAC(secret, "revoked", kind, field, revision)])`` in ``revoked`` (the
newest ``max_keys + max_teams`` are kept), so an older record put back is refused (:mod:`.revisions`). What anyone who
can write to Redis might do is bounded where it is read: the read script returns at most ``max_keys`` keys and
``max_teams`` teams and skips any value longer than :data:`~.codec.MAX_RECORD_BYTES` (it says how many it
skipped); a record not signed with the secret, or malformed, or replayed, is refused, counted
(``llmgw_tenant_refused_records_total``) and never admitted. A record written before records carried a
revision is read as revision 0. A writer that deletes a tombstone too, and puts the old record back, is refused
by every gateway that saw the tombstone or a newer record, not by one that starts after: docs/security.md says
why Redis's ACLs must keep writers out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..cluster import records
from ..cluster.link import Unavailable
from . import codec
from .directory import KeyEntry, TeamEntry
from .keys import NameTaken, Stored, StoreUnavailable
from .revisions import LEGACY, Revisions

if TYPE_CHECKING:
    from ..cluster.link import RedisLink

T = TypeVar("T")
KEY, TEAM = b"key", b"team"
SCAN_COUNT = 512
WRITE_ATTEMPTS = 3  # a field written by another gateway between this one's revision and its write: again
MAX_REVISION = 1 << 62

# The version, as at most 32 bytes: a writer's longer value reads as a short one that changes with it.
# KEYS: version.
VERSION = """
local version = redis.call('GET', KEYS[1])
if version and #version > 32 then version = string.sub(version, 1, 24) .. '~' .. #version end
return version
"""
# KEYS: version, keys, teams, revoked; ARGV: max keys, max teams, max record bytes, scan count.
# -> {version ('' for none, shortened as VERSION does), key fields and values..., skipped keys, team fields and
# values..., skipped teams, tombstones' fields and values..., skipped tombstones}; a field longer than a key id or
# team name (and its kind) is skipped as a long value is, and a hash is scanned no further than its bound and 1,000
# skipped entries (a hash a writer filled never stalls Redis long).
READ = """
local function bounded(hash, most, longest, count, widest)
  local out, skipped, cursor, scanned = {}, 0, '0', 0
  repeat
    local page = redis.call('HSCAN', hash, cursor, 'COUNT', count)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      scanned = scanned + 1
      if #out < 2 * most and #page[2][i] <= widest and #page[2][i + 1] <= longest then
        out[#out + 1] = page[2][i]
        out[#out + 1] = page[2][i + 1]
      else
        skipped = skipped + 1
      end
    end
  until cursor == '0' or #out >= 2 * most or scanned >= most + 1000
  return out, skipped
end
local keys, skipped_keys = bounded(KEYS[2], tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4]), 64)
local teams, skipped_teams = bounded(KEYS[3], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), 64)
local revoked, skipped_revoked = bounded(KEYS[4], tonumber(ARGV[1]) + tonumber(ARGV[2]), 256, tonumber(ARGV[4]),
  69)
local version = redis.call('GET', KEYS[1]) or ''
if #version > 32 then version = string.sub(version, 1, 24) .. '~' .. #version end
return {version, keys, skipped_keys, teams, skipped_teams, revoked, skipped_revoked}
"""
# KEYS: revision; ARGV: the least it may answer (what the writer saw, plus one) -> the next revision.
REVISION = """
local floor = tonumber(ARGV[1])
local revision = redis.pcall('INCR', KEYS[1])
if type(revision) ~= 'number' or revision < floor then
  redis.call('SET', KEYS[1], ARGV[1])
  revision = floor
end
return revision
"""
# KEYS: version, hash, names, revisions (kind:field -> revision of each field written), revoked (kind:field ->
# tombstone), revoked_at (kind:field by revision); ARGV: field, value ('' and delete: HDEL), name claimed for
# field ('': none), name given up ('': none), '1' when the field is new, revision, tombstone ('' unless deleting),
# kind:field, tombstones kept at most, the value the field must hold ('': any; a re-signing writes only over
# the record it read).
# -> the new version (a version that is no counter, as a writer may leave it, starts again at 1: it differs from
# what every gateway read, so they read again); {'stale', last revision} when the field was written at this
# revision or later; {'taken', owner} when the claimed name is another existing key's, or the new field exists
# (nothing written in either case).
WRITE = """
local function fit(key, kind)
  if redis.call('TYPE', key)['ok'] ~= kind then redis.call('DEL', key) end
end
fit(KEYS[3], 'hash')
fit(KEYS[4], 'hash')
fit(KEYS[5], 'hash')
fit(KEYS[6], 'zset')
local revision, field = tonumber(ARGV[6]), ARGV[8]
local last = math.max(tonumber(redis.call('HGET', KEYS[4], field)) or 0,
  tonumber(redis.call('ZSCORE', KEYS[6], field)) or 0)
if last >= revision then return {'stale', string.format('%d', last)} end
if ARGV[10] ~= '' and redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[10] then
  return {'stale', string.format('%d', last)}
end
if ARGV[5] == '1' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'taken', ARGV[1]} end
if ARGV[3] ~= '' then
  local owner = redis.call('HGET', KEYS[3], ARGV[3])
  if owner and owner ~= ARGV[1] and redis.call('HEXISTS', KEYS[2], owner) == 1 then return {'taken', owner} end
end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[4], field)
  redis.call('HSET', KEYS[5], field, ARGV[7])
  redis.call('ZADD', KEYS[6], revision, field)
  local over = redis.call('ZCARD', KEYS[6]) - tonumber(ARGV[9])
  if over > 0 then
    for _, gone in ipairs(redis.call('ZRANGE', KEYS[6], 0, over - 1)) do redis.call('HDEL', KEYS[5], gone) end
    redis.call('ZREMRANGEBYRANK', KEYS[6], 0, over - 1)
  end
else
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('HSET', KEYS[4], field, ARGV[6])
end
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
        self.revision_key = prefix + "tenancy:revision"
        self.revisions_key = prefix + "tenancy:revisions"
        self.revoked_key = prefix + "tenancy:revoked"
        self.revoked_at_key = prefix + "tenancy:revoked_at"
        self.revisions = Revisions(2 * (max_keys + max_teams))

    async def version(self) -> object:
        keys = [self.version_key]
        return await self._call("tenancy_version", lambda client: client.eval(VERSION, keys=keys))

    async def read(self) -> Stored:
        keys = [self.version_key, self.keys_key, self.teams_key, self.revoked_key]
        args = [self.max_keys, self.max_teams, codec.MAX_RECORD_BYTES + 128, SCAN_COUNT]
        answer = await self._call("tenancy_read", lambda client: client.eval(READ, keys=keys, args=args))
        if not isinstance(answer, list) or len(answer) != 7:
            raise StoreUnavailable(f"the read script answered {str(answer)[:200]}")
        version, key_fields, skipped_keys, team_fields, skipped_teams, revoked_fields, _ = answer
        refused = {"key": int(skipped_keys), "team": int(skipped_teams), "replayed_key": 0, "replayed_team": 0}
        tombstones = self._tombstones(revoked_fields)
        resign: list[Any] = []
        found_keys = self._decoded(KEY, key_fields, codec.decode_key, lambda entry: entry.key_id, refused,
                                   tombstones, resign)
        found_teams = self._decoded(TEAM, team_fields, codec.decode_team, lambda entry: entry.name, refused,
                                    tombstones, resign)
        # what a version read alone answers: bytes, or None for no version yet
        return Stored(version or None, found_keys, found_teams, {kind: n for kind, n in refused.items() if n},
                      resign)

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

    def seal(self, kind: bytes, field: str, body: bytes, revision: int) -> bytes:
        """The record stored for ``body`` in ``field`` at ``revision``: the body, its signature, the revision."""
        return records.pack([body, self.signer.sign(b"llmgw tenancy", kind, field.encode(), body, b"%d" % revision),
                             revision])

    def tombstone(self, kind: bytes, field: str, revision: int) -> bytes:
        """What a deletion of ``field`` at ``revision`` leaves: no record of it at that revision or before."""
        return records.pack([revision, self.signer.sign(b"llmgw tenancy revoked", kind, field.encode(),
                                                        b"%d" % revision)])

    async def resign(self, records_read: list[Any]) -> int:
        """Write each record of ``records_read`` (:attr:`Stored.resign`: signed with the previous secret alone)
        again, signed with the current one, unless it changed since it was read; how many were written."""
        written = 0
        for kind, field, body, raw in records_read:
            hash_key = self.keys_key if kind == KEY else self.teams_key
            if await self._write(hash_key, kind, field, body, over=raw, attempts=1):
                written += 1
        return written

    async def _write(self, hash_key: str, kind: bytes, field: str, body: bytes | None, *, new: bool = False,
                     claim: str = "", release: str = "", over: bytes = b"", attempts: int = WRITE_ATTEMPTS) -> bool:
        """Write ``field`` (``body``, or its deletion); with ``over``, only if the field still holds that record
        (False when it does not: someone wrote it since)."""
        keys = [self.version_key, hash_key, self.names_key, self.revisions_key, self.revoked_key,
                self.revoked_at_key]
        revised = f"{kind.decode()}:{field}"
        for _ in range(attempts):
            floor = self.revisions.highest + 1
            revision = int(await self._call("tenancy_revision", lambda client: client.eval(
                REVISION, keys=[self.revision_key], args=[floor])))
            value = b"" if body is None else self.seal(kind, field, body, revision)
            tombstone = self.tombstone(kind, field, revision) if body is None else b""
            args = [field, value, claim, release, "1" if new else "", revision, tombstone, revised,
                    self.max_keys + self.max_teams, over]
            answer = await self._call("tenancy_write", lambda client: client.eval(WRITE, keys=keys, args=args))
            if not (isinstance(answer, list) and len(answer) == 2):
                self.revisions.note(revised, revision)
                return True
            what, detail = answer[0], answer[1].decode("utf-8", "replace") if isinstance(answer[1], bytes) \
                else str(answer[1])
            if what == b"taken":
                raise NameTaken(kind.decode(), detail)
            self.revisions.note(revised, int(detail) if detail.isdigit() else revision)  # stale: written since
            if over:
                return False
        raise StoreUnavailable(f"{revised} was written by others at every one of {WRITE_ATTEMPTS} attempts")

    async def _call(self, operation: str, command: Callable[[Any], Any]) -> Any:
        try:
            return await self.link.call(operation, command)
        except Unavailable as exc:
            raise StoreUnavailable(str(exc)) from None

    def _tombstones(self, fields: object) -> dict[str, int]:
        """The revision of each deletion signed with the secret (others are ignored: a tombstone only refuses)."""
        found: dict[str, int] = {}
        if not isinstance(fields, list):
            return found
        for i in range(0, len(fields) - 1, 2):
            try:
                revised = fields[i].decode("utf-8")
                kind, _, field = revised.partition(":")
                revision, signature = records.unpack(fields[i + 1], 256, 2)
                if type(revision) is int and 0 < revision < MAX_REVISION and self.signer.valid(
                        signature, b"llmgw tenancy revoked", kind.encode(), field.encode(), b"%d" % revision):
                    found[revised] = revision
                    self.revisions.note(revised, revision)
            except (records.RecordError, UnicodeDecodeError, AttributeError, ValueError, TypeError):
                continue
        return found

    def _decoded(self, kind: bytes, fields: object, decode: Callable[[bytes], T], field_of: Callable[[T], str],
                 refused: dict[str, int], tombstones: dict[str, int], resign: list[Any] | None = None) -> list[T]:
        """The entries of a hash's ``fields`` signed and current; those only the previous secret signed are also
        added to ``resign`` as ``(kind, field, body, record)``."""
        label = kind.decode()
        entries: list[T] = []
        if not isinstance(fields, list):
            return entries
        for i in range(0, len(fields) - 1, 2):
            field, raw = fields[i], fields[i + 1]
            try:
                name = field.decode("utf-8") if isinstance(field, bytes) else str(field)
                body, revision, signed = self._unsealed(kind, name, raw)
                entry = decode(body)
                if field_of(entry) != name:
                    raise codec.RecordError("stored under another name")
            except (records.RecordError, codec.RecordError, UnicodeDecodeError, ValueError, TypeError):
                refused[label] += 1
                continue
            revised = f"{label}:{name}"
            if self.revisions.current(revised, revision, tombstones.get(revised)):
                entries.append(entry)
                if signed is records.Signed.PREVIOUS and resign is not None:
                    resign.append((kind, name, body, raw))
            else:
                refused["replayed_" + label] += 1
        return entries

    def _unsealed(self, kind: bytes, field: str, raw: object) -> tuple[bytes, int, records.Signed]:
        """The body and revision of a record signed with the secret (one written before revisions: 0), and which
        secret signed it."""
        sealed = records.unpack(raw, codec.MAX_RECORD_BYTES + 128, 3)
        if not isinstance(sealed, list) or len(sealed) not in (2, 3) or not isinstance(sealed[0], bytes):
            raise codec.RecordError("not a record")
        body, signature = sealed[0], sealed[1]
        if len(sealed) == 2:
            revision, signed = LEGACY, self.signer.verify(signature, b"llmgw tenancy", kind, field.encode(), body)
        else:
            revision = sealed[2]
            if type(revision) is not int or not 0 < revision < MAX_REVISION:
                raise codec.RecordError("its revision is not valid")
            signed = self.signer.verify(signature, b"llmgw tenancy", kind, field.encode(), body, b"%d" % revision)
        if signed is records.Signed.NOT:
            raise codec.RecordError("not signed with the cluster secret")
        return body, revision, signed
