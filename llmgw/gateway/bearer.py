"""Bearer-token checks shared by the data plane (``api_keys``) and the control port (``admin_tokens``).

A presented token is compared with every configured one in constant time and
without an early exit, so the time taken says nothing about which token (or
how much of one) matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable


class BearerTokens:
    """The accepted tokens of one listener; ``accepts(authorization_header)`` is the check."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: Iterable[str]):
        self._tokens = [token.encode() for token in tokens]

    def __bool__(self) -> bool:
        """True when any token is configured (no tokens: the caller decides whether that means open)."""
        return bool(self._tokens)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization: Bearer <token>`` header value carries one of the tokens."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        presented = token.strip().encode("utf-8", "surrogateescape")
        matched = False
        for key in self._tokens:  # no early exit: the time taken does not depend on which token matched
            matched |= hmac.compare_digest(presented, key)
        return matched
