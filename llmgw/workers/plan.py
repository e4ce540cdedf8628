"""What the ``--workers`` supervisor runs: the flags of ``llmgw serve`` it adds, each worker's command line, and
where its private Redis lives.

Public flags: ``--workers N`` and ``--state-dir DIR``. Internal flags (hidden from ``--help``; the supervisor
passes them, a person never needs to):

- ``--worker INDEX``: this ``llmgw serve`` is worker INDEX of a supervisor: its data listener binds with
  ``SO_REUSEPORT``, its stdin is its lifeline (the supervisor's end of a pipe: at its end the worker drains
  and exits), its log lines say ``[worker INDEX]``, and a follower prints its banner once it follows the
  shared state;
- ``--worker-state URL``: the supervisor's private Redis (``unix:///DIR/redis.sock``): the worker's config
  gets ``state: {backend: redis, url: URL, cluster: workers, secret_env: LLMGW_WORKERS_SECRET}``, at start and
  at each reload. Nothing is written to it: the config file stays the user's.

The private cluster's records are signed like any other's: the supervisor keeps a secret in its state dir
(:func:`private_secret`, ``cluster.secret``, mode 0600) and hands it to its workers in their environment
(``LLMGW_WORKERS_SECRET``), never on a command line (``ps`` shows those to every user).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from ..cluster.state import CONTROL, GATEWAY
from ..config import HostPort
from ..private_file import write_private
from ..redis_server import SOCKET_PATH_MAX
from ..usererrors import UserError

WORKER_FLAG = "--worker"
STATE_FLAG = "--worker-state"
PRIVATE_CLUSTER = "workers"  # the cluster name in a private Redis (no other cluster shares it)
SOCKET_NAME = "redis.sock"
LOCK_NAME = "workers.lock"
SECRET_NAME = "cluster.secret"  # the private cluster's secret, in the state dir
SECRET_ENV = "LLMGW_WORKERS_SECRET"  # ...as the workers get it
FOLLOWER_CONTROL = HostPort("127.0.0.1", 0)  # workers 1..N-1: their own /metrics and /admin, on loopback


def worker_count(text: str) -> int:
    """argparse ``type`` of ``--workers``: a whole number, at least 1."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {count}); 1 runs a single process")
    return count


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=worker_count, default=1, metavar="N",
                        help="run N gateway processes sharing the data port (SO_REUSEPORT) and routing as one, "
                             "under a small supervisor that restarts them (default 1: this process serves). Needs "
                             "--config (the demo runs as one process). Without state.backend redis in the config, "
                             "the supervisor runs a private redis-server for them (docs/scaling.md)")
    parser.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="with --workers N > 1: the supervisor's folder, locked while it runs, and without a "
                             "Redis in the config its private redis-server's (the socket DIR/redis.sock must stay "
                             "under 108 bytes; default $XDG_STATE_HOME/llmgw/workers/PORT)")
    parser.add_argument(WORKER_FLAG, type=int, metavar="INDEX", help=argparse.SUPPRESS)  # internal: see above
    parser.add_argument(STATE_FLAG, metavar="URL", help=argparse.SUPPRESS)  # internal: see above


@dataclass(frozen=True)
class Plan:
    """The supervisor's decisions, from which each worker's command line follows."""

    count: int
    config_path: str  # absolute
    listen: HostPort  # the data address, with the concrete port every worker shares
    control_listen: HostPort | None  # worker 0's control address (None: the config's)
    role: str  # worker 0's; the others are always followers
    redis_url: str | None  # the private Redis, or None when the config names one
    stop_engines: bool = False
    log_level: str | None = None
    log_format: str | None = None

    def role_of(self, index: int) -> str:
        return self.role if index == 0 else GATEWAY

    def argv(self, index: int) -> list[str]:
        """Worker ``index``'s command line: ``llmgw serve`` with this interpreter, the same config and flags."""
        control = self.control_listen if index == 0 else FOLLOWER_CONTROL
        argv = [sys.executable, "-m", "llmgw", "serve", "--config", self.config_path, "--listen", str(self.listen),
                "--role", self.role_of(index), WORKER_FLAG, str(index)]
        if control is not None:
            argv += ["--control-listen", str(control)]
        if self.redis_url is not None:
            argv += [STATE_FLAG, self.redis_url]
        if self.stop_engines:
            argv.append("--stop-engines")
        if self.log_level:
            argv += ["--log-level", self.log_level]
        if self.log_format:
            argv += ["--log-format", self.log_format]
        return argv


def default_state_dir(port: int) -> Path:
    """``$XDG_STATE_HOME/llmgw/workers/PORT``: one per data port (two supervisors cannot share a port's dir)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "llmgw" / "workers" / str(port)


def redis_socket(state_dir: Path) -> Path:
    """The private redis-server's Unix socket in ``state_dir``; a :class:`UserError` when its path is too long."""
    path = state_dir.absolute() / SOCKET_NAME
    size = len(os.fsencode(path))
    if size > SOCKET_PATH_MAX:
        raise UserError(f"the private Redis socket {path} is {size} bytes long, over the {SOCKET_PATH_MAX} a Unix "
                        f"socket path may have: give --state-dir a shorter folder")
    return path


def check_roles(role: str, shared: bool) -> None:
    """``--role gateway --workers N`` follows a cluster's control process elsewhere: only through its Redis."""
    if role != CONTROL and not shared:
        raise UserError("--role gateway with --workers follows the control process of a cluster through its Redis: "
                        "set state.backend: redis in the config (without it, worker 0 is the control process)")


def private_secret(state_dir: Path) -> str:
    """The private cluster's secret: the one in ``state_dir`` (a restart keeps it: what the private Redis kept
    stays valid), else a new one written there (mode 0600)."""
    path = state_dir / SECRET_NAME
    try:
        kept = path.read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        kept = ""
    if len(kept) >= 32 and path.stat().st_mode & 0o077 == 0:
        return kept
    secret = secrets.token_hex(32)
    write_private(path, secret.encode())
    return secret
