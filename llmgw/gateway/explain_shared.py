"""``/admin/explain`` across gateways: each gateway keeps what overload control did with a request (those that
waited or were shed) in the shared state's Redis for a while, so that a gateway asked about a request id it does
not know finds it at the gateway that handled it.

- Written off the hot path: :meth:`SharedOutcomes.note` appends to a bounded buffer, a request never waits on
  Redis; a task writes what gathered every :data:`INTERVAL` seconds, at most :data:`BATCH` records a call (one Lua
  script setting each key with its TTL). Beyond :data:`MAX_PENDING` waiting to be written (Redis slow or away) the
  oldest are dropped, counted.
- One key per request, ``<prefix>flow:explain:<request id>`` (ids are at most 128 visible ASCII characters),
  expiring after :data:`TTL` seconds: what Redis holds is bounded by what the gateways decide in that time, each
  record by :data:`MAX_RECORD` bytes.
- Signed with the cluster secret over the request id and the record, as the rest of the shared state: whoever can
  write to Redis without the secret cannot make a gateway tell a story about a request (a record made up, or moved
  to another id, is refused, counted and logged). Without a secret nothing is checked, as everywhere else.
- Read only by ``GET /admin/explain?request_id=`` for an id this process does not know: one GET within the link's
  timeout.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, Counter

from ..cluster.link import Unavailable
from ..lograte import RepeatLimitedLog

if TYPE_CHECKING:
    from ..cluster.link import RedisLink
    from ..cluster.records import Keys, Signer
    from .flow_gate import FlowOutcome

log = logging.getLogger(__name__)

TTL = 600  # seconds a record is kept
# Seconds between two writes. Every 0.5 s, the two-gateway admission test (tests/integration/test_overload.py)
# saw one gateway over the shared capacity by 2 or 3 in 2 runs of 3 (3 of 3 within it with the writes skipped, and
# at 2 s): the load reports' timing is sensitive to more Redis calls; explaining a request a few seconds late is
# worth none of that.
INTERVAL = 2.0
BATCH = 256  # records a write sets at most
MAX_PENDING = 4096  # records waiting to be written at most; the oldest are dropped beyond
MAX_RECORD = 4096  # bytes of one record read at most (one is about 400)
CONTEXT = b"llmgw flow explain"  # what the signature is of, besides the id and the record

# KEYS: the records' keys; ARGV[1]: the TTL in seconds, ARGV[2..]: the records, in the keys' order.
_SET_ALL = """
for i, key in ipairs(KEYS) do
  redis.call('SET', key, ARGV[i + 1], 'EX', ARGV[1])
end
return #KEYS
"""


class SharedOutcomes:
    """This gateway's overload decisions, put in Redis for the others' ``/admin/explain``, and theirs read back."""

    def __init__(self, link: RedisLink, keys: Keys, signer: Signer, origin: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.link, self.keys, self.signer, self.origin = link, keys, signer, origin
        self._pending: deque[tuple[str, bytes]] = deque()
        self._wake = trio.Event()
        self._errors = RepeatLimitedLog(log)
        self.written = Counter(
            "llmgw_flow_explain_shared", "Overload decisions (requests that waited or were shed) this gateway put in "
            "the shared state for the other gateways' /admin/explain, by result: written, dropped (more waited "
            "than the buffer holds while Redis was slow or away), failed (Redis did not take them).", ["result"],
            registry=registry)
        self.lookups = Counter(
            "llmgw_flow_explain_lookups", "/admin/explain's lookups in the shared state of a request this gateway "
            "did not handle, by result: found, missing, refused (not signed with the cluster secret, or not a "
            "record), unavailable (Redis did not answer).", ["result"], registry=registry)

    def key(self, request_id: str) -> str:
        return f"{self.keys.prefix}flow:explain:{request_id}"

    def note(self, outcome: FlowOutcome) -> None:
        """Queue ``outcome`` to be written (no await, no Redis)."""
        record = json.dumps({**outcome.to_json(), "gateway": self.origin}, separators=(",", ":")).encode()
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self.written.labels("dropped").inc()
        self._pending.append((outcome.request_id, record))
        self._wake.set()

    def _signed(self, request_id: str, record: bytes) -> bytes:
        return json.dumps({"r": record.decode(), "s": self.signer.sign(CONTEXT, request_id.encode(), record).hex()},
                          separators=(",", ":")).encode()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write what gathered, every :data:`INTERVAL` seconds while there is any, until cancelled."""
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(BATCH, len(self._pending)))]
                await self._write(batch)
            await trio.sleep(INTERVAL)

    async def _write(self, batch: list[tuple[str, bytes]]) -> None:
        keys = [self.key(request_id) for request_id, _ in batch]
        args: list[Any] = [TTL, *(self._signed(request_id, record) for request_id, record in batch)]
        try:
            await self.link.call("flow_explain_put", lambda client: client.eval(_SET_ALL, keys=keys, args=args))
        except Unavailable as exc:
            self.written.labels("failed").inc(len(batch))
            self._errors.warning("flow: %d overload decisions not put in the shared state for the other gateways' "
                                 "/admin/explain (%s); they explain only here", len(batch), exc)
            return
        self.written.labels("written").inc(len(batch))

    async def find(self, request_id: str) -> dict[str, Any] | None:
        """What another gateway did with ``request_id`` (its :meth:`FlowOutcome.to_json` and ``gateway``), or None
        (none kept, or not to be believed); :class:`~llmgw.cluster.link.Unavailable` when Redis did not answer."""
        try:
            raw = await self.link.call("flow_explain_get", lambda client: client.getrange(self.key(request_id), 0,
                                                                                          MAX_RECORD - 1))
        except Unavailable:
            self.lookups.labels("unavailable").inc()
            raise
        if not raw:
            self.lookups.labels("missing").inc()
            return None
        found = self._verified(request_id, raw)
        self.lookups.labels("found" if found is not None else "refused").inc()
        return found

    def _verified(self, request_id: str, raw: bytes) -> dict[str, Any] | None:
        try:
            wrapped = json.loads(raw)
            record, signature = wrapped["r"].encode(), bytes.fromhex(wrapped["s"])
            found = json.loads(record)
        except (ValueError, TypeError, KeyError, AttributeError):
            found = None
        else:
            if not self.signer.valid(signature, CONTEXT, request_id.encode(), record):
                found = None
        if not isinstance(found, dict) or found.get("request_id") != request_id:
            self._errors.warning("flow: the shared state's record of request %r is not one a gateway of this "
                                 "cluster signed (written by something without the cluster secret, or cut); "
                                 "ignored", request_id[:128])
            return None
        return found
