"""Logging for the long-running commands (``serve``, ``agent``, ``sim``): validated levels, text or JSON lines.

``text`` is ``TIME LEVEL LOGGER: message``; ``json`` is one object per line
(``ts``, ``level``, ``logger``, ``message``, and ``exc`` with the traceback
when there is one) for log shippers, plus the fields a call site passed with
``extra=log_fields(...)`` (:mod:`llmgw.logfields`: ``node``, ``shard``,
``pid``, ``port``, ``replica``, ``leader``, ``term``...) as keys of their own. Both go to stderr. A worker of
``llmgw serve --workers`` says which it is: ``TIME LEVEL [worker 1] LOGGER: message``,
``"worker": 1``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from llmgw.logfields import FIELDS_ATTRIBUTE

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def level_name(text: str) -> str:
    """argparse ``type``: level names in any case (``INFO`` as vLLM spells it), checked against :data:`LEVELS`."""
    return text.lower()


def add_logging_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                          default_level: str | None = "info", default_format: str | None = "text",
                          source: str = "") -> None:
    """``--log-level`` and ``--log-format``; ``source`` names where the default comes from when it is None."""
    parser.add_argument("--log-level", type=level_name, choices=LEVELS, default=default_level,
                        help=f"{', '.join(LEVELS)} (default: {source or default_level})")
    parser.add_argument("--log-format", choices=FORMATS, default=default_format,
                        help=f"text, or json: one object per line (default: {source or default_format})")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message``
    (and ``worker``, the index of a worker of ``llmgw serve --workers``), and a record's fields
    (:mod:`llmgw.logfields`, e.g. the access log's) as keys of their own, never replacing those."""

    def __init__(self, worker: int | None = None):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry: dict[str, object] = {"ts": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                                    "logger": record.name, "message": record.getMessage()}
        if self.worker is not None:
            entry["worker"] = self.worker
        for key, value in getattr(record, FIELDS_ATTRIBUTE, {}).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text", worker: int | None = None) -> None:
    """Configure the root logger once for this process (a second call replaces the handler); ``worker``: this
    process is that worker of ``llmgw serve --workers``, and its lines say so."""
    handler = logging.StreamHandler(sys.stderr)
    text_format = TEXT_FORMAT if worker is None else TEXT_FORMAT.replace("%(name)s", f"[worker {worker}] %(name)s")
    handler.setFormatter(JsonFormatter(worker) if fmt == "json" else logging.Formatter(text_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # The Redis client narrates every reconnect attempt at INFO, and a failed handshake (a frozen Redis, one
    # restarting, a connection reset) at ERROR with its traceback, once per attempt of every caller; the
    # llmgw.cluster.link says once per transition what an operator needs (one WARNING when Redis goes away, one
    # INFO when it is back) and counts each failed call (llmgw_cluster_redis_errors_total). Its own lines stay
    # visible at debug.
    coredis = logging.getLogger("coredis")
    debug = level.lower() == "debug"
    coredis.setLevel(logging.DEBUG if debug else logging.WARNING)
    for old_filter in [f for f in coredis.filters if isinstance(f, RedisReconnectNoise)]:
        coredis.removeFilter(old_filter)
    if not debug:
        coredis.addFilter(RedisReconnectNoise())


class RedisReconnectNoise(logging.Filter):
    """Drops the Redis client's (coredis's) lines about one connection attempt that failed or one connection
    lost: each caller's next call tries again, and llmgw.cluster.link logs the outage once."""

    MESSAGES = frozenset({"Connection attempt failed unexpectedly!", "Connection closed unexpectedly!"})

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.MESSAGES
