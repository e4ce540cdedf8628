"""A client's JSON request body, parsed within bounds on nesting depth, values and containers.

``json.loads`` runs in C and holds the GIL: however it is scheduled (a worker
thread included: measured in ``docs/benchmarks/hostile-input.md``, the event loop then
stalls exactly as long as the parse), the loop waits until it returns, and
its cost grows with the number of values, escapes and above all containers
(each one is also scanned by the cyclic garbage collector while it lives),
not with the bytes: 15 MiB of small arrays took 2 s, 15 MiB of plain text
23 ms. So the cost is bounded before parsing, by upper bounds counted at C
speed: containers (``[`` and ``{``) and values and escapes (those, ``,`` and
``\\``: every value but the first of a container follows a comma; an escape
costs about what a small value does). A body above ``max_containers`` or
``max_values`` is refused unparsed. The parse runs with the cyclic garbage
collector paused, which otherwise re-scans the young containers again and
again (six times the parse itself for millions of small lists); it then scans
them once.

Depth is checked after the parse only when the body has more containers than
``max_depth`` (a common small request has a handful), level by level over the
containers, which their bound keeps few; nesting deep enough to exhaust the
parser's recursion limit is caught as such.

The work is one generator of steps (:func:`_parse`): :func:`parse_json_body`
runs it through, :func:`read_json_body` lets the event loop run between the
steps of a big body (each 1 MiB counted, the UTF-8 decoding, the parse, each
20,000 containers walked, and after the parse, so that what the caller does
next with the value starts in a step of its own), so that only ``json.loads``
itself holds the loop for long (about 11 ms for 15 MiB of plain text).

``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259), though Python's parser takes them: a body
with one is a 400 (``non_finite_number``), never forwarded (an engine would sample with ``temperature``
NaN). The check costs nothing on other bodies: ``json.loads`` calls ``parse_constant`` only for those words.
Nor is a number whose magnitude overflows a double (``1e400``: Python reads it as ``inf``), however it is
written: every number with a fraction or an exponent is read by :func:`_finite_float` (about 0.1 µs more per
such number; integers are not affected).
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import dataclass
from typing import Any, Generator, Iterator

import trio

DEFAULT_MAX_DEPTH = 100
DEFAULT_MAX_VALUES = 500_000
DEFAULT_MAX_CONTAINERS = 100_000
SLICE_BYTES = 1 << 20  # a big body is counted this much at a time (about 3 ms), with a checkpoint between
WALK_STEP = 20_000  # containers and items looked at for depth between checkpoints (about 3 ms)


@dataclass(frozen=True)
class JsonLimits:
    """The bounds on a body (``limits.max_json_depth``, ``max_json_values``, ``max_json_containers``)."""

    max_depth: int = DEFAULT_MAX_DEPTH
    max_values: int = DEFAULT_MAX_VALUES
    max_containers: int = DEFAULT_MAX_CONTAINERS


class BodyError(ValueError):
    """The body cannot be taken: ``status`` (400 or 413) and ``code`` for the OpenAI error, ``reason`` for the
    metric (``not_json``, ``non_finite_number``, ``too_deep``, ``too_many_values``, ``too_many_containers``)."""

    def __init__(self, status: int, code: str, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.reason = reason


class Counts:
    """Upper bounds found at C speed in a body: ``containers`` (its ``[`` and ``{``) and ``values`` (values and
    escapes: its ``[``, ``{``, ``,`` and ``\\``)."""

    __slots__ = ("containers", "values")

    def __init__(self) -> None:
        self.containers = self.values = 0

    def add(self, body: bytes, start: int = 0, end: int | None = None) -> "Counts":
        end = len(body) if end is None else end
        containers = body.count(b"[", start, end) + body.count(b"{", start, end)
        self.containers += containers
        self.values += containers + body.count(b",", start, end) + body.count(b"\\", start, end)
        return self

    def check(self, limits: JsonLimits) -> None:
        if self.values > limits.max_values:
            raise BodyError(413, "request_too_complex", "too_many_values", "the request body has more than "
                            f"{limits.max_values} JSON values and escapes (the limit)")
        if self.containers > limits.max_containers:
            raise BodyError(413, "request_too_complex", "too_many_containers", "the request body has more than "
                            f"{limits.max_containers} JSON arrays and objects (the limit)")


async def read_json_body(body: bytes, limits: JsonLimits = JsonLimits()) -> Any:
    """:func:`parse_json_body`, letting the event loop run between the steps of a body above
    :data:`SLICE_BYTES`: each 1 MiB counted, and each :data:`WALK_STEP` containers walked for depth."""
    if len(body) <= SLICE_BYTES:
        return parse_json_body(body, limits)
    for step in _parse(body, limits):
        if step is not _PAUSE:
            return step
        await trio.lowlevel.checkpoint()


def parse_json_body(body: bytes, limits: JsonLimits = JsonLimits()) -> Any:
    """The JSON value of ``body``; :class:`BodyError` when it is not JSON or is beyond a bound."""
    *_, value = _parse(body, limits)
    return value


_PAUSE = object()


def _parse(body: bytes, limits: JsonLimits) -> Iterator[Any]:
    """The parse as steps: :data:`_PAUSE` where a caller may let other work run, then the value."""
    counts = Counts()
    for start in range(0, len(body), SLICE_BYTES):
        counts.add(body, start, start + SLICE_BYTES).check(limits)
        yield _PAUSE
    try:  # as json.loads(bytes) decodes, as a step of its own: about a third of a big plain body's parse
        text = body.decode(json.detect_encoding(body), "surrogatepass")
    except UnicodeDecodeError as undecodable:
        raise BodyError(400, "invalid_json", "not_json", f"the request body is not valid JSON: {undecodable}") from None
    yield _PAUSE
    collecting = gc.isenabled()
    gc.disable()
    try:
        if text.startswith("\ufeff"):  # what json.loads refuses before it decodes
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        value = _DECODER.decode(text)
    except RecursionError:
        raise _too_deep(limits.max_depth) from None
    except BodyError:  # a NaN or Infinity (_refuse_constant), a ValueError too
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(400, "invalid_json", "not_json", f"the request body is not valid JSON: {exc}") from None
    finally:
        if collecting:
            gc.enable()
    yield _PAUSE  # the caller's next work on a big body (routing it) starts in a step of its own
    if counts.containers > limits.max_depth and (yield from _deeper_than(value, limits.max_depth)):
        raise _too_deep(limits.max_depth)
    yield value


def _refuse_constant(word: str) -> Any:
    """``parse_constant`` of the parse: raised through ``json.loads`` for ``NaN``, ``Infinity``, ``-Infinity``."""
    raise BodyError(400, "invalid_json", "non_finite_number",
                    f"the request body is not valid JSON: {word} is not a JSON number (RFC 8259 has no NaN or "
                    "Infinity); send a finite number")


def _finite_float(text: str) -> float:
    """``parse_float`` of the parse: a number with a fraction or an exponent, refused when it overflows."""
    value = float(text)
    if math.isinf(value):
        raise BodyError(400, "invalid_json", "non_finite_number",
                        f"the request body holds the number {text[:40]}, beyond what a double holds (it would be "
                        "infinity); send a finite number")
    return value


# Built once: json.loads with parse_constant or parse_float builds a decoder (and its scanner) per call, a few µs
# of every request's CPU. The decoder keeps no state between calls.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _too_deep(max_depth: int) -> BodyError:
    return BodyError(400, "invalid_json", "too_deep",
                     f"the request body nests JSON deeper than {max_depth} levels (the limit)")


def _deeper_than(value: Any, max_depth: int) -> Generator[object, None, bool]:
    """Whether ``value`` has containers nested more than ``max_depth`` deep: level by level, without recursion,
    yielding after every :data:`WALK_STEP` containers and items looked at."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        below: list[Any] = []
        seen = 0
        for node in level:
            items = node if isinstance(node, list) else list(node.values())
            for start in range(0, max(len(items), 1), WALK_STEP):  # an empty node is one (empty) chunk
                chunk = items[start:start + WALK_STEP]
                below += [item for item in chunk if type(item) is list or type(item) is dict]
                seen += 1 + len(chunk)
                if seen >= WALK_STEP:
                    seen = 0
                    yield _PAUSE
        level = below
    return False
