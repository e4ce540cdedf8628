"""Network addresses in the config: listeners (``HOST:PORT``), replica URLs, ZMQ endpoints."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

_PORT = re.compile(r"\d{1,5}")
_HOSTPORT_HELP = "expected HOST:PORT, e.g. 127.0.0.1:8000 or \"[::1]:8000\""
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class HostPort:
    """A host (name, IPv4 or IPv6 address) and a TCP port; port 0 asks for an ephemeral port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: object) -> "HostPort":
        """Parse ``host:port`` or ``[ipv6]:port``; ``ValueError`` with a helpful message otherwise."""
        if not isinstance(text, str):
            raise ValueError(_HOSTPORT_HELP)
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host:
            raise ValueError(_HOSTPORT_HELP)
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            if not host:
                raise ValueError(_HOSTPORT_HELP)
        elif ":" in host:
            raise ValueError("write an IPv6 address in brackets: \"[::1]:8000\"")
        return cls(host, _parse_port(port, allow_zero=True))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _parse_port(text: str, *, allow_zero: bool) -> int:
    lowest = 0 if allow_zero else 1
    if not _PORT.fullmatch(text) or not lowest <= int(text) <= 65535:
        raise ValueError(f"the port must be a number from {lowest} to 65535")
    return int(text)


def _url_port(parts: SplitResult) -> int | None:
    """A URL's port (None when it names none); ``ValueError`` unless from 1 to 65535."""
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the URL's port must be a number from 1 to 65535") from None
    if port == 0:
        raise ValueError("the URL's port must be a number from 1 to 65535")
    return port


def parse_http_url(value: object) -> str:
    """A replica base URL, normalised: lower-case scheme and host, no trailing slash.

    The URL is never quoted back in errors: it might carry credentials.
    """
    if not isinstance(value, str):
        raise ValueError("expected a URL such as http://127.0.0.1:9001")
    parts = urlsplit(value.strip())
    if parts.scheme.lower() not in DEFAULT_PORTS:
        raise ValueError("the URL must start with http:// or https://")
    if parts.username is not None or parts.password is not None:
        raise ValueError("put credentials in api_key, not in the URL")
    if not parts.hostname:
        raise ValueError("the URL has no host")
    if parts.query or parts.fragment:
        raise ValueError("the URL must not have a query or a fragment")
    port = _url_port(parts)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        raise ValueError("leave /v1 out of the URL: llmgw appends the request path (/v1/chat/completions...)")
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return f"{parts.scheme.lower()}://{netloc}{path}"


REDIS_SCHEMES = ("redis", "rediss", "unix")


def parse_redis_url(value: object) -> str:
    """A Redis URL: ``redis://HOST[:PORT][/DB]``, ``rediss://`` (TLS) or ``unix:///PATH[?db=N]``.

    Credentials are refused in the URL (they would be in the file): the password comes from the environment
    (``state.password_env``). The URL is never quoted back in errors.
    """
    if not isinstance(value, str):
        raise ValueError("expected a URL such as redis://127.0.0.1:6379/0")
    parts = urlsplit(value.strip())
    scheme = parts.scheme.lower()
    if scheme not in REDIS_SCHEMES:
        raise ValueError("the URL must start with redis://, rediss:// or unix://")
    if parts.password is not None:
        raise ValueError("put the password in the environment (state.password_env), not in the URL")
    if parts.username is not None:
        raise ValueError("put the user name in state.username, not in the URL")
    if parts.fragment:
        raise ValueError("the URL must not have a fragment")
    if scheme == "unix":
        if parts.netloc or not parts.path.startswith("/"):
            raise ValueError("write a Unix socket as unix:///absolute/path/to/redis.sock")
        return f"unix://{parts.path}" + (f"?{parts.query}" if parts.query else "")
    if not parts.hostname:
        raise ValueError("the URL has no host")
    port = _url_port(parts)
    database = parts.path.strip("/")
    if database and not (database.isdigit() and int(database) < 16384):
        raise ValueError("the URL's path is the database number, e.g. redis://127.0.0.1:6379/0")
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    return f"{scheme}://{netloc}:{port or 6379}/{int(database or 0)}"


def url_host_port(url: str) -> HostPort:
    """The host and port (explicit or the scheme's default) of a normalised URL."""
    parts = urlsplit(url)
    return HostPort(parts.hostname or "", parts.port or DEFAULT_PORTS[parts.scheme])


IPC_PATH_MAX = 107  # bytes of a unix socket path on Linux (sun_path less its NUL)


def parse_zmq_endpoint(value: object) -> str:
    """A ZMQ endpoint to connect to: ``tcp://HOST:PORT`` with a concrete host and a non-zero port, or
    ``ipc:///ABSOLUTE/PATH`` (a unix socket, best in a directory only llmgw's user can open)."""
    help_ = "expected a ZMQ endpoint such as tcp://127.0.0.1:5557 or ipc:///run/llmgw/engine.ev"
    if isinstance(value, str) and value.startswith("ipc://"):
        path = value[len("ipc://"):]
        if not path.startswith("/"):
            raise ValueError(f"{help_} (an ipc:// path must be absolute)")
        if not path.isprintable():
            raise ValueError(f"{help_} (the ipc:// path has a control character)")
        if len(path.encode("utf-8", "surrogatepass")) > IPC_PATH_MAX:
            raise ValueError(f"{help_} (an ipc:// path is at most {IPC_PATH_MAX} bytes)")
        return value
    if not isinstance(value, str) or not value.startswith("tcp://"):
        raise ValueError(help_)
    try:
        address = HostPort.parse(value[len("tcp://"):])
    except ValueError:
        raise ValueError(help_) from None
    if address.host == "*" or address.port == 0:
        raise ValueError(f"{help_} (llmgw connects to it, so the host cannot be '*' and the port not 0)")
    return f"tcp://{address}"


_PORT_RANGE = re.compile(r"(\d{1,5})-(\d{1,5})")


def parse_port_range(text: object) -> tuple[int, int]:
    """``LOW-HIGH`` (``21000-21099``; one port is ``N-N``) as ``(LOW, HIGH)``, or a ValueError saying what is wrong."""
    match = _PORT_RANGE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError("not a port range LOW-HIGH, e.g. 21000-21999")
    low, high = int(match[1]), int(match[2])
    if not 1 <= low <= 65535 or not 1 <= high <= 65535:
        raise ValueError("ports are 1 to 65535")
    if low > high:
        raise ValueError("the low port is above the high one")
    return low, high
