"""What a worker of ``llmgw serve --workers`` does that a lone ``llmgw serve`` does not (flags: :mod:`.plan`).

- :func:`with_private_state`: its config's ``state`` points at the supervisor's private Redis;
- :func:`watch_lifeline`: its stdin is the supervisor's end of a pipe; when that ends (the supervisor died,
  even by SIGKILL) the worker drains and exits instead of serving on, orphaned, on the shared port, and worker 0
  then stops the private redis-server (:func:`stop_private_redis`), which nothing else would stop;
- :func:`wait_until_following`: a follower prints its banner once it holds the control process's state, so
  the supervisor's banner means that every worker routes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import trio

from ..config.addresses import parse_redis_url
from .plan import PRIVATE_CLUSTER, SECRET_ENV

if TYPE_CHECKING:
    from ..config import Config
    from ..gateway.app import Gateway

log = logging.getLogger("llmgw.workers")
FOLLOW_TIMEOUT = 30.0  # the most a follower waits for the first snapshot before it prints its banner anyway


def with_private_state(config: "Config", url: str) -> "Config":
    """``config`` with ``state`` on the Redis at ``url`` (a ``ValueError`` for a URL that is not one), cluster
    ``workers``, no credentials, signed with the secret the supervisor put in ``SECRET_ENV``; its other ``state``
    settings (intervals, timeouts) as the file says."""
    state = dataclasses.replace(config.state, backend="redis", url=parse_redis_url(url), cluster=PRIVATE_CLUSTER,
                                username=None, password_env=None, secret_env=SECRET_ENV)
    return dataclasses.replace(config, state=state)


async def watch_lifeline(fd: int = 0) -> None:
    """Return once ``fd`` (stdin: a pipe only the supervisor writes to, and never does) reaches its end."""
    async with trio.lowlevel.FdStream(os.dup(fd)) as lifeline:
        while await lifeline.receive_some(4096):
            pass


async def stop_private_redis(url: str, timeout: float = 2.0) -> None:
    """Ask the redis-server at ``url`` (``unix:///PATH``: the supervisor's private one) to exit: ``SHUTDOWN
    NOSAVE``, in RESP over a plain socket (it needs no client). Nothing happens when none answers."""
    path = url.removeprefix("unix://").split("?", 1)[0]
    with trio.move_on_after(timeout):
        try:
            async with await trio.open_unix_socket(path) as stream:
                await stream.send_all(b"SHUTDOWN NOSAVE\r\n")
                while await stream.receive_some():  # until the server closes the connection as it exits
                    pass
        except (OSError, trio.BrokenResourceError):
            pass
    log.warning("asked the private redis-server at %s to stop", url)


async def wait_until_following(gateway: "Gateway", timeout: float = FOLLOW_TIMEOUT) -> None:
    """A follower (``--role gateway``): until it applied the leader's first snapshot (at most ``timeout``
    seconds). A candidate (worker 0) does not wait: it is elected, or follows once there is a leader."""
    shared = gateway.shared
    if shared is None or shared.election is not None:
        return
    follower = shared.follower
    if not await follower.wait_loaded(timeout):
        log.warning("no snapshot of the control process's state within %g s: serving on what comes later", timeout)
