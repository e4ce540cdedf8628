"""Failures a command reports as one line a user can act on (``llmgw serve: ...``), never as a traceback.

Long-running commands fail inside nurseries, so the error arrives wrapped in
exception groups; :func:`find` digs the first :class:`UserError` out and
:func:`run_reporting` turns it into the line and the exit code.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


class UserError(Exception):
    """A problem with what the user asked for (an address, a folder), reported as one line."""

    exit_code = 2


def find(exc: BaseException) -> UserError | None:
    """The first :class:`UserError` in ``exc`` or in the exception groups around it."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = find(inner)
            if found is not None:
                return found
    return None


def run_reporting(command: str, run: Callable[[], Any]) -> int:
    """Call ``run``; 0, or the exit code of the :class:`UserError` it raised after printing ``command: error``."""
    try:
        run()
    except BaseException as exc:
        failure = find(exc)
        if failure is None:
            raise
        print(f"{command}: {failure}", file=sys.stderr)
        return failure.exit_code
    return 0
