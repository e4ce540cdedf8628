"""Who may use the control port: admin tokens on ``/admin/*``, and which addresses may serve it without them.

``/admin/*`` (and ``/metrics`` with ``metrics.require_auth``) needs
``Authorization: Bearer <one of admin_tokens>`` when tokens are configured;
``/health`` stays open, and so does ``/ui`` (the status page holds no data: its
scripts send the token to ``/admin/*``); ``/agent`` is authenticated by the
agents' join token, not here. Tokens are read from the gateway's current config at each
request, so ``POST /admin/reload`` (or SIGHUP) rotates them. Without tokens the
port may only listen on loopback, unless ``allow_unauthenticated_admin``.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Callable

from .bearer import BearerTokens

if TYPE_CHECKING:
    from ..config import Config

ADMIN_PREFIX = "/admin"


def is_loopback(host: str) -> bool:
    """Whether a listen host only accepts connections from this machine (a name other than localhost: no)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(control_host: str, config: "Config") -> str | None:
    """Why serving the control port on ``control_host`` with ``config`` would leave ``/admin`` open to the
    network, or None when it is fine."""
    if config.admin_tokens or config.allow_unauthenticated_admin or is_loopback(control_host):
        return None
    return (f"{control_host} is not a loopback address and admin_tokens is empty: anyone who can "
            f"reach it could reload the config and read the cluster; add admin_tokens, listen on 127.0.0.1, or "
            f"set allow_unauthenticated_admin: true")


class AdminGuard:
    """The check run before every HTTP request on the control port."""

    def __init__(self, current_config: Callable[[], "Config"], on_refused: Callable[[str], None]):
        self._current_config = current_config
        self._on_refused = on_refused  # called with the reason: "missing" or "invalid"
        self._config: "Config | None" = None
        self._tokens = BearerTokens(())

    def tokens(self) -> BearerTokens:
        config = self._current_config()
        if config is not self._config:  # a reload put a new config in place: its tokens from now on
            self._config, self._tokens = config, BearerTokens(
                (t.name or f"token-{n}", t.token) for n, t in enumerate(config.admin_tokens, 1))
        return self._tokens

    def needs_token(self, path: str) -> bool:
        if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
            return True
        return path == "/metrics" and self._current_config().metrics.require_auth

    def refusal(self, path: str, authorization: str | None) -> str | None:
        """None when the request may go on, else the message of the 401 to answer."""
        if not self.needs_token(path):
            return None
        tokens = self.tokens()
        if not tokens or tokens.accepts(authorization):
            return None
        reason = "missing" if not authorization else "invalid"
        self._on_refused(reason)
        if reason == "missing":
            return "this endpoint needs an admin token: send 'Authorization: Bearer <token>'"
        return "the admin token is not valid"
