"""An append-only journal of one process's usage in the state dir, so that a gateway killed (kill -9, OOM) loses
none of the usage it settled.

Every row the sink counts is appended as one short JSON line with a single ``os.write`` (no fsync: the page
cache outlives a killed process; a machine that loses power loses what the kernel had not written). Each process
writes segments of its own, ``<host>-<pid>-<random>-<n>.usage``, holding an exclusive ``flock`` on each until it
has shipped it: workers and gateways sharing a host never share one, and a segment whose lock can be taken
belongs to a process that is gone. The flusher ships the aggregate with the segment's byte offset as the store's
marker, starts a new segment past :data:`ROTATE_BYTES`, and deletes a segment once all of it is in the store. At
start a process replays every orphaned segment from the store's marker for it to its last whole line.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..lograte import RepeatLimitedLog
from .usage import FIELDS, HOUR, Counts, UsageRow, add_to

log = logging.getLogger(__name__)

SUFFIX = ".usage"
ROTATE_BYTES = 8 * 1024 * 1024  # a segment this long is closed at the next flush
MAX_LINE = 4096  # bytes of one line; a longer one is not a line the journal wrote (skipped on replay)
MAX_TEXT = 1024  # characters of a key id, key name, team or model in a line
MAX_COUNT = 2**53  # a counter in a line is below this
READ_BYTES = 1024 * 1024  # how much of a segment a replay reads at a time


MAX_PREFIXES = 10_000  # rows whose line start a journal keeps encoded


def row_prefix(row: UsageRow) -> str:
    """The start of a line of ``row``: ``["key id","key name","team","model",hour,`` (ASCII), then ``"class",``
    for a row of a priority class (a line without one, as written before classes, is a row of no class)."""
    identity: list[object] = [row.key_id, row.key_name, row.team, row.model, row.hour]
    if row.priority:
        identity.append(row.priority)
    return json.dumps(identity, separators=(",", ":"), ensure_ascii=True)[:-1] + ","


def encode(row: UsageRow, counts: Counts, prefix: str | None = None) -> bytes:
    """One line: the row and its counters as a JSON array."""
    return f"{prefix or row_prefix(row)}{','.join(map(str, counts))}]\n".encode("ascii")


def decode(line: bytes) -> tuple[UsageRow, Counts] | None:
    """A line's row and counters, or None when it is not a line :func:`encode` wrote."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, list) or len(value) not in (5 + len(FIELDS), 6 + len(FIELDS)):
        return None
    classed = len(value) == 6 + len(FIELDS)
    texts, hour, counts = value[:4], value[4], value[6:] if classed else value[5:]
    if classed:
        texts.append(value[5])
    if not all(isinstance(text, str) and len(text) <= MAX_TEXT for text in texts):
        return None
    numbers = [hour, *counts]
    if not all(type(number) is int and 0 <= number < MAX_COUNT for number in numbers) or hour % HOUR:
        return None
    return UsageRow(texts[0], texts[1], texts[2], texts[3], hour, texts[4] if classed else ""), counts


@dataclass(frozen=True, slots=True)
class Position:
    """Where a segment was cut: everything the sink counted before is in it, up to ``offset``."""

    name: str
    offset: int
    finished: bool  # the process writes to a newer segment now: delete this one once shipped


@dataclass(slots=True)
class Segment:
    path: Path
    fd: int  # open, with our flock on it
    written: int = 0

    @property
    def name(self) -> str:
        return self.path.name


class UsageJournal:
    """This process's journal segments in ``directory``."""

    def __init__(self, directory: Path, rotate_bytes: int = ROTATE_BYTES):
        self.directory = directory
        self.rotate_bytes = rotate_bytes
        self._prefix = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._number = 0
        self._segment: Segment | None = None
        self._finished: dict[str, Segment] = {}  # cut, not yet shipped
        self._prefixes: dict[UsageRow, str] = {}  # rows seen lately: their line's start, encoded once
        self.failed_lines = 0  # lines not written (a full disk): counted in memory only, lost if killed
        self._log = RepeatLimitedLog(log, 60.0)

    def open(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._segment = self._start()

    def _start(self) -> Segment:
        self._number += 1
        path = self.directory / f"{self._prefix}-{self._number:06d}{SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return Segment(path, fd)

    @property
    def path(self) -> Path:
        assert self._segment is not None
        return self._segment.path

    def append(self, row: UsageRow, counts: Counts) -> None:
        """Write one row's line; a failure (a full disk) is counted and logged, never raised."""
        segment = self._segment
        if segment is None:
            return
        prefix = self._prefixes.get(row)
        if prefix is None:
            if len(self._prefixes) >= MAX_PREFIXES:
                self._prefixes.clear()
            prefix = self._prefixes[row] = row_prefix(row)
        line = encode(row, counts, prefix)
        try:
            written = os.write(segment.fd, line)
        except OSError as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return
        segment.written += written
        if written < len(line):  # a full disk mid-line: end it, so that the next line stands alone
            self._failed("short write")
            try:
                segment.written += os.write(segment.fd, b"\n")
            except OSError:
                pass

    def _failed(self, why: str) -> None:
        self.failed_lines += 1
        self._log.log(logging.ERROR, "usage journal: cannot append to %s (%s): the usage stays in memory until it is "
                      "flushed, and a kill of this process before then would lose it; free space in %s",
                      self._segment.path if self._segment else self.directory, why, self.directory, kind="append")

    def cut(self) -> Position:
        """Where the current segment ends now; past :attr:`rotate_bytes` later lines go to a new segment."""
        segment = self._segment
        assert segment is not None
        if segment.written < self.rotate_bytes:
            return Position(segment.name, segment.written, False)
        try:
            self._segment = self._start()
        except OSError as exc:
            self._failed(f"cannot start a new segment: {exc}")
            return Position(segment.name, segment.written, False)
        self._finished[segment.name] = segment
        return Position(segment.name, segment.written, True)

    def shipped(self, position: Position) -> None:
        """Everything up to ``position`` is in the store: a finished segment is deleted."""
        segment = self._finished.pop(position.name, None) if position.finished else None
        if segment is not None:
            _remove(segment.path, segment.fd)

    def close(self) -> None:
        """Stop writing (the segments stay, for the next start to ship what the store lacks)."""
        for segment in [*self._finished.values(), *([self._segment] if self._segment else [])]:
            os.close(segment.fd)
        self._finished.clear()
        self._segment = None

    def orphans(self) -> Iterator[Segment]:
        """Segments in the directory no live process holds, each locked by this one as it is handed out."""
        try:
            paths = sorted(self.directory.glob(f"*{SUFFIX}"))
        except OSError:
            return
        for path in paths:
            if path.name.startswith(self._prefix):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)  # a live process writes it
                continue
            yield Segment(path, fd)

    def forget(self, segment: Segment) -> None:
        """An orphan whose usage is all in the store."""
        _remove(segment.path, segment.fd)


def _remove(path: Path, fd: int) -> None:
    try:
        path.unlink()
    except OSError as exc:
        log.warning("usage journal: cannot delete the shipped segment %s (%s)", path, exc)
    os.close(fd)


def read_rows(path: Path, start: int, end: int | None = None, max_rows: int | None = None
              ) -> tuple[dict[UsageRow, Counts], int, int]:
    """The rows of whole lines of ``path`` from byte ``start`` (to ``end``, or the last whole line), summed,
    stopping before a line that would make more than ``max_rows`` rows; with the offset read to and the number
    of lines skipped as not the journal's."""
    rows: dict[UsageRow, Counts] = {}
    skipped = 0
    offset = start
    with open(path, "rb") as file:
        file.seek(start)
        pending = b""
        while end is None or offset < end:
            chunk = file.read(READ_BYTES if end is None else min(READ_BYTES, end - offset - len(pending)))
            if not chunk:
                break
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            if len(pending) > MAX_LINE:  # no line of ours is this long: skip to the next newline
                skipped += 1
                offset += len(pending)
                pending = b""
            for line in lines:
                decoded = decode(line) if len(line) <= MAX_LINE else None
                if decoded is None:
                    skipped += 1
                else:
                    row, counts = decoded
                    if max_rows is not None and len(rows) >= max_rows and row not in rows:
                        return rows, offset, skipped
                    add_to(rows, row, counts)
                offset += len(line) + 1
    return rows, offset, skipped
