"""Private files written atomically: the agent's ledger and node secret, the control plane's node identities.

:func:`write_private` writes a temporary file (mode 0600) in the same folder,
fsyncs it, renames it over the target and fsyncs the folder: a crash leaves
the old content or the new one, never half of one, and nobody but the owner
can read it (these files hold engine API keys and node secrets).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path | str, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
