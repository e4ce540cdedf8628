"""``llmgw teams``: teams of a running gateway, over its control API (the same command as ``llmgw keys``)."""

from __future__ import annotations

from .keys import run


def main(argv: list[str]) -> int:
    return run("teams", argv)
