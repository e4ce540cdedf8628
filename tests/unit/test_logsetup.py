"""Log lines for machines: the JSON format."""

from __future__ import annotations

import json
import logging
import sys

from llmgw.logsetup import JsonFormatter


def test_json_log_lines_carry_the_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("llmgw.x", logging.ERROR, __file__, 1, "failed: %s", ("it",),
                                   exc_info=sys.exc_info())
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "error" and entry["logger"] == "llmgw.x" and entry["message"] == "failed: it"
    assert entry["ts"].endswith("Z") and "ValueError: boom" in entry["exc"]
