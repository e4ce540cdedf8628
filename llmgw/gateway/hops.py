"""Loop detection between gateways: the ``llmgw-hop`` request header.

Every request the data plane forwards to an engine carries ``llmgw-hop: ID``,
this gateway's instance id, after the hop headers it arrived with (each
gateway on the way adds its own and passes the others on). A request that
arrives with this gateway's id has been here before: a replica URL that leads
back to the gateway (its own data port, or a chain of gateways that ends
here) would otherwise send it round until connections or file descriptors run
out. It is answered ``508 Loop Detected``, as is one that arrives with
:data:`MAX_HOPS` hop headers or more (a chain of gateways is never that long),
and counted in ``llmgw_loops_detected_total``.

The id is random per gateway; the workers of ``llmgw serve --workers`` share
their supervisor's (:data:`INSTANCE_ENV` in their environment), as they share
a data port. The header is built once: forwarding adds one list entry.
"""

from __future__ import annotations

import os

from ..http.messages import Response, error_response

HOP_HEADER = b"llmgw-hop"
MAX_HOPS = 8
INSTANCE_ENV = "LLMGW_INSTANCE_ID"


def new_instance_id() -> str:
    return os.urandom(8).hex()


class HopGuard:
    """This gateway's hop header, and the test of an arriving request's hop headers."""

    def __init__(self, instance_id: str | None = None):
        instance_id = instance_id or os.environ.get(INSTANCE_ENV) or new_instance_id()
        self.header = (HOP_HEADER, instance_id.encode("ascii", "replace"))

    def looped(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request with these headers went through this gateway before, or through too many."""
        own = self.header[1]
        hops = 0
        for name, value in headers:
            if name == HOP_HEADER:
                hops += 1
                if value == own or hops >= MAX_HOPS:
                    return True
        return False

    @staticmethod
    def refusal() -> Response:
        return error_response(508, "the request came back to this gateway (a replica URL leads back to it, or "
                                   f"through more than {MAX_HOPS - 1} gateways): refused",
                              code="loop_detected")
