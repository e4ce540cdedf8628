"""Request ids: this process's own, and which ids a client may choose.

Every relayed request carries ``x-request-id`` to the engine, in the answer and in the access log. A
client's id is kept only when it is 1 to :data:`MAX_CLIENT_ID_LENGTH` visible ASCII characters (no space,
no control or non-ASCII byte): anything else could forge log fields, smuggle C1 controls into a terminal,
or cost a 60 kB header on every hop. Such an id is replaced by one of ours, and not logged.
"""

from __future__ import annotations

import itertools
import os
import re

MAX_CLIENT_ID_LENGTH = 128

_ACCEPTED = re.compile(rb"[!-~]{1,%d}\Z" % MAX_CLIENT_ID_LENGTH)


def accepted_client_id(value: bytes) -> str | None:
    """``value`` as the request's id when a client may choose it, else None (replace it)."""
    return value.decode("ascii") if _ACCEPTED.match(value) else None


class RequestIds:
    """32 hex digits like a UUID4's: a random per-process prefix and a counter (uuid4() costs microseconds)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count(int.from_bytes(os.urandom(4), "big"))

    def next(self) -> str:
        return "%s%016x" % (self._prefix, next(self._count))
