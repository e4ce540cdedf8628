"""HTTP ports for engines: free ones from a range, never the same one twice while it is reserved.

A port is free when a listening socket can bind it right now (with
``SO_REUSEADDR``, as the engines' servers bind). The range sits below Linux's
ephemeral range (32768-60999) so outgoing connections do not take our ports.
Ports are handed out round-robin from a cursor: a port released a moment ago
is the last one reused, so a router that still dials an old endpoint does not
reach a different engine there. The cursor starts at a random place, so that
two agents on one machine (tests, a serve with an embedded agent next to a
remote agent) rarely test the same port at the same time: between the test
and the engine's own bind, only this allocator knows the port is taken.

``llmgw agent --engine-ports LOW-HIGH`` moves the range (a firewall or a
container's published ports may allow only some): :func:`llmgw.config.addresses.parse_port_range`
reads and checks it, :func:`ephemeral_overlap` says when it overlaps the
kernel's ephemeral range.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

DEFAULT_ENGINE_PORTS = (20000, 32000)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class NoFreePort(Exception):
    """Every port of the range is reserved or in use."""


def ephemeral_overlap(low: int, high: int, range_file: Path | None = None) -> tuple[int, int] | None:
    """The kernel's ephemeral port range (``range_file``, default :data:`EPHEMERAL_RANGE_FILE`) when ``low-high``
    overlaps it (outgoing connections may then take an engine's port for a while), else None; None too when the
    kernel does not say (not Linux)."""
    try:
        first, last = (int(part) for part in (range_file or EPHEMERAL_RANGE_FILE).read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return (first, last) if low <= last and first <= high else None


class PortAllocator:
    def __init__(self, host: str = "127.0.0.1", start: int = DEFAULT_ENGINE_PORTS[0],
                 end: int = DEFAULT_ENGINE_PORTS[1]):
        if not 0 < start <= end < 65536:
            raise ValueError(f"bad port range {start}-{end}")
        self.host = host
        self.start = start
        self.end = end
        self._reserved: set[int] = set()
        self._cursor = start + random.randrange(end - start + 1)

    def allocate(self) -> int:
        """A port that is free now and not reserved; it stays reserved until :meth:`release`."""
        size = self.end - self.start + 1
        for _ in range(size):
            port = self._cursor
            self._cursor = self.start + (port - self.start + 1) % size
            if port not in self._reserved and self.is_free(port):
                self._reserved.add(port)
                return port
        raise NoFreePort(f"no free port in {self.start}-{self.end} on {self.host}")

    def reserve(self, port: int) -> None:
        """Mark a port chosen elsewhere (a fixed ``http_port``, an adopted engine's) as taken."""
        self._reserved.add(port)

    def release(self, port: int) -> None:
        self._reserved.discard(port)

    def reserved(self, port: int) -> bool:
        return port in self._reserved

    def is_free(self, port: int) -> bool:
        """Whether a server could bind ``port`` on our host right now."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.host, port))
            except OSError:
                return False
        return True
