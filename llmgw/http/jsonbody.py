"""A client's JSON request body, parsed within bounds on nesting depth and on the number of values.

``json.loads`` runs in C and holds the GIL: however it is scheduled (a worker
thread included), the event loop waits until it returns, and its cost grows
with the number of values, not only with the bytes (15 MiB of small arrays
takes seconds, 15 MiB of one string a few milliseconds; see the big-body
benchmark in ``docs/benchmarks.md``). So before parsing, an upper bound of the
values is counted at C speed (``bytes.count`` of ``,``, ``[`` and ``{``: every
value but the first of a container follows a comma), and a body above
``max_values`` is refused without being parsed. Depth is checked after the
parse only when the body has more brackets than ``max_depth`` (the common
small request has a handful), by an iterative walk over the containers, which
the value bound keeps short; nesting deep enough to exhaust the parser's
recursion limit is caught as such.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_DEPTH = 100
DEFAULT_MAX_VALUES = 200_000


class BodyError(ValueError):
    """The body cannot be taken: ``status`` (400 or 413) and ``code`` for the OpenAI error, ``reason`` for the
    metric (``not_json``, ``too_deep``, ``too_many_values``)."""

    def __init__(self, status: int, code: str, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.reason = reason


def parse_json_body(body: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH,
                    max_values: int = DEFAULT_MAX_VALUES) -> Any:
    """The JSON value of ``body``; :class:`BodyError` when it is not JSON or is beyond a bound."""
    brackets = body.count(b"[") + body.count(b"{")
    if brackets + body.count(b",") > max_values:
        raise BodyError(413, "request_too_complex", "too_many_values",
                        f"the request body has more than {max_values} JSON values (the limit)")
    try:
        value = json.loads(body)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(400, "invalid_json", "not_json", f"the request body is not valid JSON: {exc}") from None
    if brackets > max_depth and _deeper_than(value, max_depth):
        raise _too_deep(max_depth)
    return value


def _too_deep(max_depth: int) -> BodyError:
    return BodyError(400, "invalid_json", "too_deep", f"the request body nests JSON deeper than {max_depth} levels (the limit)")


def _deeper_than(value: Any, max_depth: int) -> bool:
    """Whether ``value`` has containers nested more than ``max_depth`` deep, without recursion."""
    if not isinstance(value, (dict, list)):
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False
