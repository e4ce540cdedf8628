"""Bearer-token checks of the control port (``admin_tokens``; the data plane's API keys: llmgw.tenancy.directory).

A presented token is compared with every configured one in constant time and
without an early exit, so the time taken says nothing about which token (or
how much of one) matched. Each token has a name (who holds it: safe to log);
:meth:`BearerTokens.holder` says whose token a request carries.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from ..http.messages import bearer_token


class BearerTokens:
    """The accepted tokens of one listener, each with its holder's name; ``holder(authorization_header)`` is the
    check. Immutable: a reload builds a new one and swaps it in whole."""

    __slots__ = ("_tokens",)

    def __init__(self, named_tokens: Iterable[tuple[str, str]]):
        """``named_tokens``: ``(name, token)`` pairs."""
        self._tokens = tuple((name, token.encode()) for name, token in named_tokens)

    def __bool__(self) -> bool:
        """True when any token is configured (no tokens: the caller decides whether that means open)."""
        return bool(self._tokens)

    def holder(self, authorization: str | None) -> str | None:
        """The name of the token an ``Authorization: Bearer <token>`` header value carries, or None."""
        token = bearer_token(authorization)
        if token is None:
            return None
        presented = token.encode("utf-8", "surrogateescape")
        matched = None
        for name, key in self._tokens:  # no early exit: the time taken does not depend on which token matched
            if hmac.compare_digest(presented, key):
                matched = name
        return matched

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization: Bearer <token>`` header value carries one of the tokens."""
        return self.holder(authorization) is not None
