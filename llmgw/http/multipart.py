"""The ``model`` field of a ``multipart/form-data`` body, found without parsing the rest (audio uploads).

OpenAI's ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` take a
form: a file part and small text parts, one of them ``model``. The router only
needs that one value; the body is relayed unchanged. :func:`form_field` scans
part heads for ``Content-Disposition: form-data; name="model"`` and returns the
part's value, reading at most ``max_parts`` heads and ``max_value_bytes`` of
value, so a hostile body costs one bounded pass over its bytes.
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(r'(?i)boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))')
_NAME = re.compile(rb'(?i)\bname="([^"]*)"')


class FormError(ValueError):
    """The body is not the multipart form its ``Content-Type`` announced."""


def boundary_of(content_type: str) -> str:
    """The boundary of a ``multipart/form-data`` content type (RFC 2046: 1 to 70 characters)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise FormError("the content type is not multipart/form-data")
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise FormError("multipart/form-data without a boundary")
    return match.group(1) or match.group(2)


def form_field(body: bytes, content_type: str, name: str, *, max_parts: int = 64,
               max_value_bytes: int = 1024) -> str | None:
    """The text value of form field ``name``, or None when the form has no such field; ``FormError`` when the
    body is not a well-formed form up to that field, or the value is not short UTF-8 text."""
    delimiter = b"--" + boundary_of(content_type).encode("latin-1")
    wanted = name.encode()
    at = body.find(delimiter)
    if at < 0:
        raise FormError("the body does not contain the form's boundary")
    for _ in range(max_parts):
        at += len(delimiter)
        if body.startswith(b"--", at):
            return None  # the closing delimiter: no such field
        head_end = body.find(b"\r\n\r\n", at)
        if head_end < 0:
            raise FormError("a form part has no end of its headers")
        head = body[at:head_end]
        next_part = body.find(b"\r\n" + delimiter, head_end + 4)
        if next_part < 0:
            raise FormError("a form part is not closed by the boundary")
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-disposition:"):
                match = _NAME.search(line)
                if match is not None and match.group(1) == wanted:
                    value = body[head_end + 4:next_part]
                    if len(value) > max_value_bytes:
                        raise FormError(f"the form field {name!r} is longer than {max_value_bytes} bytes")
                    try:
                        return value.decode("utf-8")
                    except UnicodeDecodeError:
                        raise FormError(f"the form field {name!r} is not UTF-8 text") from None
        at = next_part + 2
    raise FormError(f"the form has more than {max_parts} parts before {name!r}")
