"""The one gate for what a node says about itself: every address, port, name and size in its Register and shard
reports is checked here before anything is built from it.

A node's agent is trusted to run engines, not to steer the gateway: what it
reports is used to build a replica the router dials (its endpoint), to adopt a
shard (its ids, ranks, GPUs) and to show the cluster (its reason and log tail).
:class:`ReportCheck` refuses a report with:

- an endpoint that is not ``http://HOST:PORT`` with HOST the node's own
  address as it registered it, and PORT from 1 to 65535; or that is one of
  this gateway's own listeners (the data or control port on a loopback, wildcard
  or local address: a replica there would send the gateway's requests back to
  itself);
- a served model name, replica id or shard id that breaks the name rule of
  :mod:`llmgw.config.names` (an engine takes them on its command line);
- a number (pid, rank, GPU index, generation...) or a text (reason, log tail)
  out of its bounds.

A Register is refused when its address is not a host name or an IP address
(engines on the node are dialled there; a node without one has no endpoint
taken), or its labels or GPUs exceed their
bounds. The caller refuses what fails (logged, counted in
``llmgw_agent_refused_total{reason="invalid_report"}``, the node told why);
nothing here raises.
"""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from .. import wire
from ..config.addresses import parse_http_url
from ..config.names import name_problem

REFUSE_INVALID = "invalid_report"
MAX_HOST = 253  # a DNS name's length
MAX_PID = 1 << 22  # Linux's highest pid_max
MAX_RANK = 1024  # a replica's nodes (the config's bound of `nodes`)
MAX_GPUS = 1024  # GPUs of one node, and their indices
MAX_COUNT = (1 << 63) - 1  # generations (milliseconds), restarts, bytes
MAX_TIME = 1e11  # seconds since 1970 (a started_at)
MAX_REASON = 8192  # characters
MAX_LOG_LINES = 200
MAX_LOG_BYTES = 64 * 1024  # all of a log tail's lines
MAX_TOKEN_TEXT = 256  # a fingerprint, a placement proof
MAX_LABELS = 256
MAX_LABEL_TEXT = 1024
_LABEL = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,62}"  # one label of a DNS name
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def host_problem(host: object) -> str | None:
    """Why ``host`` is not a host name or an IP address (unbracketed), or None."""
    if not isinstance(host, str) or not host or len(host) > MAX_HOST:
        return f"must be a host name or an IP address of at most {MAX_HOST} characters"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if _HOST_NAME.fullmatch(host) is None or host.replace(".", "").isdigit():
        return "must be a host name or an IP address"
    return None


def is_own_host(host: str) -> bool:
    """Whether ``host`` (a normalised URL host) is this machine: a loopback or wildcard address, ``localhost``, or
    an address one of its interfaces holds (it can be bound). A DNS name other than ``localhost`` is not resolved
    here (no lookup on the control plane's loop): the data plane's hop header stops a loop through one."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.is_loopback or address.is_unspecified:
        return True
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return is_own_host(str(address.ipv4_mapped))
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))  # only an address of this machine's interfaces can be bound
        return True
    except OSError:
        return False


def same_host(url_host: str, address: str) -> bool:
    """Whether a URL's host and a node's registered address name the same host (IP addresses compared as such)."""
    address = address.lower().strip("[]")
    try:
        return ipaddress.ip_address(url_host) == ipaddress.ip_address(address)
    except ValueError:
        return url_host.rstrip(".") == address.rstrip(".")


def _time_problem(value: float) -> str | None:
    return None if isinstance(value, float) and math.isfinite(value) and 0 <= value <= MAX_TIME \
        or isinstance(value, int) and 0 <= value <= MAX_TIME else "started_at must be a time since 1970 in seconds"


def _int_problem(name: str, value: int, lowest: int, highest: int) -> str | None:
    return None if lowest <= value <= highest else f"{name} must be from {lowest} to {highest}"


def _text_problem(name: str, value: str, most: int) -> str | None:
    return None if len(value) <= most else f"{name} must be at most {most} characters"


def _first(problems: Iterable[str | None]) -> str | None:
    return next((problem for problem in problems if problem is not None), None)


class ReportCheck:
    """Checks a node's Register and shard reports; knows the gateway's own listening ports to refuse them."""

    def __init__(self, own_ports: Iterable[int] = ()):
        self.own_ports = frozenset(port for port in own_ports if port)

    def listening(self, addresses: Iterable[tuple[str, int]]) -> None:
        """The gateway's listeners are bound at these (host, port): endpoints on their ports are refused."""
        self.own_ports = frozenset(port for _, port in addresses if port)

    def register_problem(self, register: wire.Register) -> str | None:
        """Why a Register cannot be taken (its address, labels, GPUs), or None."""
        problem = host_problem(register.address) if register.address else None  # none: no endpoint is taken
        if problem is not None:
            return f"address {register.address[:MAX_HOST]!r} {problem}"
        if len(register.labels) > MAX_LABELS or any(len(key) > MAX_LABEL_TEXT or len(value) > MAX_LABEL_TEXT
                                                    for key, value in register.labels.items()):
            return f"labels: at most {MAX_LABELS}, each key and value at most {MAX_LABEL_TEXT} characters"
        if len(register.gpus) > MAX_GPUS:
            return f"gpus: at most {MAX_GPUS}"
        return _first(_int_problem("a GPU's index", gpu.index, 0, MAX_GPUS - 1) for gpu in register.gpus)

    def shard_problem(self, report: wire.ShardReport, node_address: str) -> str | None:
        """Why a shard report of the node registered at ``node_address`` cannot be taken, or None."""
        return _first((
            self._name_problem("shard_id", report.shard_id),
            self._name_problem("replica_id", report.replica_id),
            None if not report.model else self._name_problem("model", report.model),
            _int_problem("rank", report.rank, 0, MAX_RANK - 1),
            _int_problem("node_count", report.node_count, 1, MAX_RANK),
            _int_problem("pid", report.pid, 0, MAX_PID),
            _int_problem("http_port", report.http_port, 0, 65535),
            _int_problem("generation", report.generation, 0, MAX_COUNT),
            _int_problem("restarts", report.restarts, 0, MAX_COUNT),
            _time_problem(report.started_at),
            None if len(report.gpu_indices) <= MAX_GPUS else f"gpu_indices: at most {MAX_GPUS}",
            _first(_int_problem("a GPU index", i, 0, MAX_GPUS - 1) for i in report.gpu_indices),
            _text_problem("reason", report.reason, MAX_REASON),
            _text_problem("fingerprint", report.fingerprint, MAX_TOKEN_TEXT),
            _text_problem("placement_proof", report.placement_proof, MAX_TOKEN_TEXT),
            None if len(report.log_tail) <= MAX_LOG_LINES and sum(map(len, report.log_tail)) <= MAX_LOG_BYTES
            else f"log_tail: at most {MAX_LOG_LINES} lines and {MAX_LOG_BYTES} characters",
            self.endpoint_problem(report.endpoint, node_address) if report.endpoint else None,
        ))

    def endpoint_problem(self, endpoint: str, node_address: str) -> str | None:
        """Why ``endpoint`` cannot be the replica URL of a shard on the node registered at ``node_address``."""
        shown = repr(endpoint[:MAX_HOST])
        try:
            normal = parse_http_url(endpoint)
        except ValueError as exc:
            return f"endpoint {shown}: {exc}"
        parts = urlsplit(normal)
        if parts.scheme != "http" or parts.path or parts.port is None:
            return f"endpoint {shown} must be http://HOST:PORT (the engine's own port, no path)"
        host = parts.hostname or ""
        if not same_host(host, node_address):
            return f"endpoint {shown} is not on the node's own address {node_address[:MAX_HOST]!r}"
        if parts.port in self.own_ports and is_own_host(host):
            return f"endpoint {shown} is one of this gateway's own listeners"
        return None

    @staticmethod
    def _name_problem(field_name: str, value: str) -> str | None:
        problem = name_problem(value)
        return None if problem is None else f"{field_name} {value[:MAX_HOST]!r} {problem}"
