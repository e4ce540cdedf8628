"""Items one process shares with the others of its cluster, sent as signed batches: one stream entry each.

The owner keeps its own bounded buffer (filling it never waits: the routing
path may be the one filling it) and calls :meth:`Outbox.ready` when there is
something; :meth:`Outbox.run` takes what accumulated and sends it as one entry
(``o`` the origin, ``e`` the msgpack batch, ``s`` its signature) as soon as the
previous send is done, so a batch grows while a send is in flight. A batch
that cannot be sent is dropped and counted: what these streams carry is
short-lived, and the next one is newer.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import trio

from . import records
from .link import RedisLink, Unavailable

T = TypeVar("T")


class Outbox:
    def __init__(self, link: RedisLink, key: str, operation: str, length: int, origin: str, signer: records.Signer,
                 take: Callable[[], list[Any]], sent: Callable[[int], None], dropped: Callable[[int], None]):
        """``take()``: the owner's items, its buffer emptied; ``sent(n)`` / ``dropped(n)``: count them."""
        self.link = link
        self.key = key
        self.operation = operation
        self.length = length
        self.origin = origin.encode()
        self.signer = signer
        self.take = take
        self.sent = sent
        self.dropped = dropped
        self._wake = trio.Event()

    def ready(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            items = self.take()
            if not items:
                continue
            batch = records.pack(items)
            fields = {b"o": self.origin, b"e": batch, b"s": self.signer.sign(self.origin, batch)}
            try:
                await self.link.add_to_stream(self.operation, self.key, fields, self.length)
            except Unavailable:
                self.dropped(len(items))
                failures += 1
                await self.link.backoff(failures)  # what comes meanwhile waits (or expires) in the owner's buffer
                continue
            failures = 0
            self.sent(len(items))


def received_batch(fields: dict[str, Any], origin: str, signer: records.Signer,
                   max_bytes: int = records.MAX_RECORD_BYTES) -> bytes | None:
    """An outbox entry read back: its batch when another process sent it, None when this one did;
    :class:`~.records.RecordError` when it is not an outbox entry, larger than ``max_bytes`` (refused before
    its signature is even computed) or not signed with the cluster secret."""
    try:
        sender, batch = fields["o"], fields["e"]
        if sender.decode() == origin:
            return None
    except (KeyError, AttributeError, UnicodeDecodeError):
        raise records.RecordError("not an entry of a cluster's outbox") from None
    if not isinstance(batch, bytes) or len(batch) > max_bytes:
        raise records.RecordError(f"an outbox batch is at most {max_bytes} bytes")
    if not signer.valid(fields.get("s"), sender, batch):
        raise records.RecordError("not signed with the cluster secret")
    return batch


def opened(fields: dict[str, Any], origin: str, signer: records.Signer, decode: Callable[[bytes], T],
           bad: Callable[[], None], max_bytes: int = records.MAX_RECORD_BYTES) -> T | None:
    """Another process's outbox entry, decoded with ``decode``; None for this process's own entries and for
    anything that is not a signed, well-formed entry of at most ``max_bytes`` (then ``bad()`` counts it)."""
    try:
        batch = received_batch(fields, origin, signer, max_bytes)
        return None if batch is None else decode(batch)
    except (KeyError, ValueError, AttributeError, records.RecordError):
        bad()
        return None
