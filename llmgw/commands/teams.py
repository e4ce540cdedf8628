"""``llmgw teams``: teams of a running gateway, over its control API (the same command as ``llmgw keys``)."""

from __future__ import annotations

import argparse

from . import keys


def build_parser() -> argparse.ArgumentParser:
    return keys.build_parser("teams")


def main(argv: list[str]) -> int:
    return keys.run("teams", argv)
