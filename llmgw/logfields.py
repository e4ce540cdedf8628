"""Log lines made of fields: ``key=value`` text whose values cannot forge another field, and the same fields as
JSON keys under ``--log-format json``.

A value that is empty or holds anything but visible ASCII other than ``"`` and ``=`` (a space, a control
character, a non-ASCII character) is written as a JSON string, so ``request_id=a b=c`` can never appear for
one field: it reads ``request_id="a b=c"``. Pass the fields as ``extra=fields_extra(fields)`` next to
``logfmt(fields)`` as the message; :class:`llmgw.logsetup.JsonFormatter` then writes each as its own key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

FIELDS_ATTRIBUTE = "llmgw_fields"

_PLAIN = re.compile(r"[!#-<>-~]+\Z")  # visible ASCII without '"' (0x22) and '=' (0x3d)

FieldValue = str | int | float | None


def logfmt_value(value: FieldValue) -> str:
    """``value`` as it stands after ``key=``: None is ``-``; text that could be read as more than one value is
    quoted as a JSON string."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else str(value)
    return text if _PLAIN.match(text) else json.dumps(text)


def logfmt(fields: Mapping[str, FieldValue]) -> str:
    """``key=value key=value ...`` (keys are the caller's own names, written as they are)."""
    return " ".join(f"{key}={logfmt_value(value)}" for key, value in fields.items())


def fields_extra(fields: Mapping[str, FieldValue]) -> dict[str, Mapping[str, FieldValue]]:
    """The ``extra=`` of a logging call whose fields a JSON formatter should write as keys."""
    return {FIELDS_ATTRIBUTE: fields}


def log_fields(**fields: FieldValue) -> dict[str, Mapping[str, FieldValue]]:
    """``extra=log_fields(shard=..., pid=...)``: what a line is about (``node``, ``shard``, ``pid``, ``port``,
    ``replica``, ``leader``, ``term``...), as keys of their own under ``--log-format json``; the text format
    shows only the message, which names them already."""
    return fields_extra(fields)
