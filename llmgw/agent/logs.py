"""Per-shard log files that the engine process writes itself, rotated by copy-truncate.

The engine's stdout and stderr are the file ``STATE_DIR/logs/<shard_id>.log``,
opened ``O_APPEND`` and handed to the child, never a pipe through the agent:
an engine outlives the agent, and a pipe would hand it SIGPIPE (or a full
pipe would stall it) once the agent is gone. Restarts append to the same file
after a header line, so the previous run's last words stay next to the new
run's first.

Rotation is copy-truncate, because the engine keeps its file descriptor: when
the file is larger than ``max_bytes``, ``.log.1`` ... ``.log.N`` shift by one,
the file is copied to ``.log.1`` and truncated to zero. With ``O_APPEND`` the
engine's next write lands at the new end. Lines written between the copy and
the truncate are lost; that is the price of not restarting the engine.

Engines print prompts, paths and errors, so the logs are private: the folder
is 0700 and every file in it 0600 (created so, and :func:`secure_log_folder`
tightens what an older agent left readable, at the agent's start).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from pathlib import Path

from .kv_sockets import UnsafeDirectory, private_directory

log = logging.getLogger(__name__)

LOG_FOLDER = "logs"  # under the state dir
FILE_MODE = 0o600
TAIL_READ_BYTES = 64 * 1024
SECRET_FLAGS = ("--api-key",)


def secure_log_folder(state_dir: Path) -> int:
    """Make ``STATE_DIR/logs`` 0700 and each file in it 0600 (what an older agent made 0644); how many files
    were tightened. A folder that is a link or another user's is left alone and logged."""
    folder = Path(state_dir) / LOG_FOLDER
    try:
        private_directory(folder)
        tightened = 0
        for entry in os.scandir(folder):
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
                os.chmod(entry.path, stat.S_IMODE(info.st_mode) & ~0o077 | FILE_MODE)
                tightened += 1
    except (UnsafeDirectory, OSError) as exc:
        log.error("engine logs: cannot make %s private (0700, files 0600): %s", folder, exc)
        return 0
    if tightened:
        log.warning("engine logs: %d files under %s were readable by others; now 0600", tightened, folder)
    return tightened


class ShardLog:
    def __init__(self, state_dir: Path, shard_id: str, *, max_bytes: int = 10 * 1024 * 1024, keep: int = 3):
        self.directory = Path(state_dir) / LOG_FOLDER
        self.path = self.directory / f"{_safe_name(shard_id)}.log"
        self.max_bytes = max_bytes
        self.keep = keep

    def open_for_child(self) -> int:
        """A new append-only descriptor on the log, for the child's stdout and stderr (the caller closes it)."""
        return self._open_append()

    def write_header(self, text: str) -> None:
        """One line from the agent (a start, an adoption) between the engine's own lines."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with open(self._open_append(), "a", encoding="utf-8") as f:
            f.write(f"==== llmgw {stamp} {text} ====\n")

    def rotate_if_needed(self) -> bool:
        """Copy-truncate the log when it is larger than ``max_bytes``; True when it rotated. Blocking file I/O."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return False
        if size <= self.max_bytes:
            return False
        if self.keep <= 0:
            os.truncate(self.path, 0)
            return True
        for index in range(self.keep - 1, 0, -1):
            older = self._rotated(index)
            if older.exists():
                older.replace(self._rotated(index + 1))
        with open(self.path, "rb") as source, open(_create_private(self._rotated(1)), "wb") as copy:
            shutil.copyfileobj(source, copy)
        os.truncate(self.path, 0)
        return True

    def _open_append(self) -> int:
        """An append-only descriptor on the log, in its private folder (``OSError`` when the folder is unsafe)."""
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            private_directory(self.directory)
        except UnsafeDirectory as exc:
            raise PermissionError(f"engine log folder: {exc}") from exc
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, FILE_MODE)

    def tail(self, lines: int = 20) -> list[str]:
        """The last ``lines`` lines (from the rotated file too when the current one was just truncated)."""
        found: list[str] = []
        for path in (self.path, self._rotated(1)):
            found = _last_lines(path, lines - len(found)) + found
            if len(found) >= lines:
                break
        return found[-lines:] if lines > 0 else []

    def _rotated(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the values of secret flags (``--api-key``) masked, for logs."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
        elif arg in SECRET_FLAGS:
            out.append(arg)
            hide_next = True
        elif arg.split("=", 1)[0] in SECRET_FLAGS and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return out


def _create_private(path: Path) -> int:
    """``path`` truncated (or created) for writing, mode 0600 whatever it had."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def _last_lines(path: Path, count: int) -> list[str]:
    if count <= 0:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_READ_BYTES))
            data = f.read()
    except FileNotFoundError:
        return []
    text = data.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if size > TAIL_READ_BYTES and lines:
        lines = lines[1:]  # the first line read is probably cut
    return lines[-count:]


def _safe_name(shard_id: str) -> str:
    """A file name for a shard id (ids are the control plane's; keep them from escaping the log folder)."""
    cleaned = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in shard_id).lstrip(".")
    return cleaned or "shard"
