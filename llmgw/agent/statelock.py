"""One agent per state dir: an advisory lock held for the agent's lifetime, naming its holder.

Two agents over one state dir would both adopt the same engines and overwrite
each other's ledger. The lock is ``fcntl.flock`` on ``STATE_DIR/agent.lock``:
the kernel drops it when the holder exits, however it exits, so a stale file
never blocks anyone. The holder writes its pid and command (``llmgw agent``) into the file
so that the refusal can say who has the dir. The descriptor is close-on-exec:
the engines the agent starts (which outlive it) never inherit the lock.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

from ..usererrors import UserError

LOCK_FILE = "agent.lock"
MAX_HOLDER_BYTES = 4096
MAX_COMMAND_CHARS = 200  # the file is anyone's to write on this machine: what is quoted from it stays short


class StateDirBusy(UserError):
    """``state dir DIR is in use by pid N (COMMAND)``."""

    def __init__(self, state_dir: Path, holder: str):
        super().__init__(f"state dir {state_dir} is in use by {holder}; stop that process first, or give this "
                         f"one another state dir")
        self.state_dir = state_dir
        self.holder = holder


class StateDirLock:
    """``with StateDirLock(dir):`` holds the dir's lock, or raises :class:`StateDirBusy` at once. ``lock_file``:
    the lock's name in the dir (the supervisor of ``llmgw serve --workers`` holds ``workers.lock`` in its own)."""

    def __init__(self, state_dir: Path | str, lock_file: str = LOCK_FILE):
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / lock_file
        self._fd: int | None = None

    def acquire(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StateDirBusy(self.state_dir, holder) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{_command()}\n".encode(errors="replace"), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock. The file stays: removing it would let two processes lock two different files."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "StateDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _command() -> str:
    """``llmgw agent``, ``llmgw serve``: which command holds the dir (never its arguments: they may hold a token)."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if program == "__main__.py":
        program = "llmgw"
    subcommand = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ""
    return f"{program} {subcommand}".strip()


def _holder(fd: int) -> str:
    """``pid 1234 (llmgw agent --join ...)`` from what the holder wrote, or a plain note when it wrote nothing yet."""
    text = os.pread(fd, MAX_HOLDER_BYTES, 0).decode(errors="replace")
    pid, _, command = text.partition("\n")
    if not pid.strip().isdigit() or len(pid.strip()) > 10:
        return "another process"
    command = "".join(c for c in command.split("\n", 1)[0] if c.isprintable()).strip()[:MAX_COMMAND_CHARS]
    return f"pid {pid.strip()}" + (f" ({command})" if command else "")
