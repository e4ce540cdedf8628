"""A client's JSON request body, parsed within bounds on nesting depth and on the number of values.

``json.loads`` runs in C and holds the GIL: however it is scheduled (a worker
thread included: measured in ``docs/benchmarks.md``, the event loop then
stalls exactly as long as the parse), the loop waits until it returns, and
its cost grows with the number of values and escapes, not with the bytes
(15 MiB of small arrays took 2 s, 15 MiB of plain text 23 ms). So the cost
is bounded before parsing: an upper bound of the values is counted at C
speed, ``,`` ``[`` ``{`` and ``\\`` (every value but the first of a container
follows a comma; an escape costs about what a small value does), and a body
above ``max_values`` is refused unparsed. The count of a big body is done in
slices with a checkpoint between them (:func:`read_json_body`), and the parse
runs with the cyclic garbage collector paused, which otherwise re-scans the
young containers again and again (six times the parse itself for millions of
small lists).

Depth is checked after the parse only when the body has more brackets than
``max_depth`` (a common small request has a handful), by an iterative walk
over the containers that the value bound keeps short; nesting deep enough to
exhaust the parser's recursion limit is caught as such.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import trio

DEFAULT_MAX_DEPTH = 100
DEFAULT_MAX_VALUES = 500_000
SLICE_BYTES = 1 << 20  # a big body is counted this much at a time (about 3 ms), with a checkpoint between


class BodyError(ValueError):
    """The body cannot be taken: ``status`` (400 or 413) and ``code`` for the OpenAI error, ``reason`` for the
    metric (``not_json``, ``too_deep``, ``too_many_values``)."""

    def __init__(self, status: int, code: str, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.reason = reason


class Counts:
    """What :func:`count` found in a body: ``brackets`` (``[`` and ``{``), and ``values``, an upper bound of the
    JSON values and escapes (brackets, ``,`` and ``\\``)."""

    __slots__ = ("brackets", "values")

    def __init__(self) -> None:
        self.brackets = self.values = 0

    def add(self, body: bytes, start: int = 0, end: int | None = None) -> "Counts":
        end = len(body) if end is None else end
        brackets = body.count(b"[", start, end) + body.count(b"{", start, end)
        self.brackets += brackets
        self.values += brackets + body.count(b",", start, end) + body.count(b"\\", start, end)
        return self


async def read_json_body(body: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH,
                         max_values: int = DEFAULT_MAX_VALUES) -> Any:
    """:func:`parse_json_body`, counting a body above :data:`SLICE_BYTES` a slice at a time between checkpoints."""
    if len(body) <= SLICE_BYTES:
        return parse_json_body(body, max_depth=max_depth, max_values=max_values)
    counts = Counts()
    for start in range(0, len(body), SLICE_BYTES):
        await trio.lowlevel.checkpoint()
        if counts.add(body, start, start + SLICE_BYTES).values > max_values:
            raise _too_many(max_values)
    return parse_json_body(body, max_depth=max_depth, max_values=max_values, counts=counts)


def parse_json_body(body: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH, max_values: int = DEFAULT_MAX_VALUES,
                    counts: Counts | None = None) -> Any:
    """The JSON value of ``body``; :class:`BodyError` when it is not JSON or is beyond a bound.

    ``counts`` are the body's :class:`Counts` when the caller counted already.
    """
    counts = counts or Counts().add(body)
    if counts.values > max_values:
        raise _too_many(max_values)
    collecting = gc.isenabled()
    gc.disable()
    try:
        value = json.loads(body)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(400, "invalid_json", "not_json", f"the request body is not valid JSON: {exc}") from None
    finally:
        if collecting:
            gc.enable()
    if counts.brackets > max_depth and _deeper_than(value, max_depth):
        raise _too_deep(max_depth)
    return value


def _too_many(max_values: int) -> BodyError:
    return BodyError(413, "request_too_complex", "too_many_values",
                     f"the request body has more than {max_values} JSON values and escapes (the limit)")


def _too_deep(max_depth: int) -> BodyError:
    return BodyError(400, "invalid_json", "too_deep",
                     f"the request body nests JSON deeper than {max_depth} levels (the limit)")


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
