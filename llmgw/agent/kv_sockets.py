"""Where an agent's engines publish KV events: unix sockets in a directory only the agent's user can open.

A KV event tells the router which replica holds a prompt's blocks, so whoever
can publish one steers routing, and whoever can reach the engine's replay
socket learns the sequence number a forged batch needs. Loopback TCP is open
to every local user; a unix socket is reached through its path, and a path in
a directory of mode 0700 only by that directory's owner (and root). So every
deployed engine gets ``ipc://DIR/<tag>.ev`` for its events and
``ipc://DIR/<tag>.rp`` for replay, and vLLM's rule (an ``ipc://`` endpoint is
*bound* by the engine, the replay socket always is) makes the engine create
both sockets there; the agent's SUB and DEALER connect to them.

``DIR`` is ``STATE_DIR/kv`` when its sockets' paths fit a unix socket address
(:data:`SOCKET_PATH_MAX` bytes), else a directory of ``mkdtemp`` under
``/tmp`` (0700 too), whose path is kept in ``STATE_DIR/kv-socket-dir`` so the
next agent on that state dir uses it again. A directory that exists already
is used only if it is a real directory (not a link) owned by the agent's
user; its mode is set to 0700. The paths are recorded in the ledger, so an agent that adopts an engine
connects to the sockets that engine bound; when the shard ends (stopped, or
failed for good) the agent removes them (an engine killed with SIGKILL leaves
them behind, and libzmq replaces a leftover file when it binds again).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import wire
from ..private_file import write_private

log = logging.getLogger(__name__)

KV_SOCKET_DIR = "kv"  # under the state dir
SOCKET_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux: libzmq refuses a longer ipc:// path
SHORT_TMP = "/tmp"  # the fallback's parent: short, and not $TMPDIR, which may be long too
TAG_CHARS = 16
EVENTS_SUFFIX = ".ev"
REPLAY_SUFFIX = ".rp"
IPC = "ipc://"


class UnsafeDirectory(Exception):
    """A socket directory that another user could open or replace."""


@dataclass(frozen=True)
class KvEndpoints:
    """The engine's KV-event endpoints: it binds both, the agent connects."""

    events: str
    replay: str

    def paths(self) -> list[Path]:
        return [Path(endpoint[len(IPC):]) for endpoint in (self.events, self.replay) if endpoint.startswith(IPC)]


def private_directory(path: Path) -> Path:
    """``path`` as a directory only this user can open: created with mode 0700, or checked and set to 0700.

    Raises :class:`UnsafeDirectory` for a link, a non-directory, or one owned by another user (who could
    open it, or put sockets of their own in it)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a link or a file)")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(f"{path} belongs to uid {info.st_uid}, not to this agent's uid {os.geteuid()}")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def fits(directory: Path) -> bool:
    """Whether a socket in ``directory`` has a path short enough for a unix socket address."""
    return len(os.fsencode(directory)) + 1 + TAG_CHARS + len(EVENTS_SUFFIX) <= SOCKET_PATH_MAX


class KvSocketDir:
    """The agent's private socket directory (chosen on first use) and the endpoints of each shard in it."""

    def __init__(self, preferred: Path):
        self.preferred = Path(preferred).absolute()
        self.pointer = self.preferred.with_name(self.preferred.name + "-socket-dir")  # where a fallback is noted
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = self._choose()
        return self._path

    def _choose(self) -> Path:
        why = f"{self.preferred}'s socket paths would be longer than {SOCKET_PATH_MAX} bytes"
        if fits(self.preferred):
            try:
                return private_directory(self.preferred)
            except (UnsafeDirectory, OSError) as exc:
                why = str(exc)
        fallback = self._noted_fallback()
        if fallback is None:
            fallback = Path(tempfile.mkdtemp(prefix="llmgw-kv-", dir=SHORT_TMP))  # created 0700
            write_private(self.pointer, os.fsencode(fallback))
        log.info("KV-event sockets go to %s (%s)", fallback, why)
        return fallback

    def _noted_fallback(self) -> Path | None:
        """The fallback directory a previous agent on this state dir made, if it is still private and short."""
        try:
            noted = Path(os.fsdecode(self.pointer.read_bytes().strip()))
        except OSError:
            return None
        if not (noted.is_absolute() and fits(noted) and noted.name.startswith("llmgw-kv-")):
            return None
        try:
            info = os.lstat(noted)
        except OSError:
            return None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) != 0o700:
            return None
        return noted

    def endpoints(self, spec: wire.StartShard) -> KvEndpoints:
        """A shard's endpoints: named by a digest of its id and generation (ids may be long or hold any
        character; a new generation's engine must not find its predecessor's sockets)."""
        tag = hashlib.sha256(f"{spec.shard_id}\0{spec.generation}".encode()).hexdigest()[:TAG_CHARS]
        base = self.path / tag
        return KvEndpoints(f"{IPC}{base}{EVENTS_SUFFIX}", f"{IPC}{base}{REPLAY_SUFFIX}")

    @staticmethod
    def remove(endpoints: KvEndpoints) -> None:
        """Remove a stopped engine's sockets (the directory stays: other engines may be about to bind in it)."""
        for path in endpoints.paths():
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove the KV-event socket %s: %s", path, exc)
