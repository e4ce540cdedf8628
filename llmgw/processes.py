"""Start llmgw's own subprocesses (simulator engines, agents) and learn the address they bound.

A child started here lives in the caller's nursery: cancelling the nursery
terminates it (SIGTERM, then SIGKILL after a grace period). Children announce
their address with a line ``... listening on http://HOST:PORT`` on stdout.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field

import trio

from .procgroup import terminate_group

log = logging.getLogger(__name__)
LISTENING = re.compile(rb"listening on (https?://\S+)")


@dataclass
class Child:
    process: trio.Process
    url: str
    output: list[str] = field(default_factory=list)  # the last lines the child printed
    control_url: str = ""  # an ``llmgw serve`` child's control listener (:func:`start_serve`)

    @property
    def pid(self) -> int:
        return self.process.pid


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child that must be told its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llmgw_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmgw", *args]


async def run_child(argv: list[str], *, name: str, env: dict[str, str] | None = None, startup_timeout: float = 30.0,
                    stop_grace: float = 5.0, keep_lines: int = 50, ready: re.Pattern[bytes] = LISTENING,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``argv`` until cancelled; ``task_status.started(Child)`` once it printed a line matching ``ready``
    (whose first group is the child's URL)."""
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    process = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               env=full_env, start_new_session=True)
    stdout = process.stdout
    assert stdout is not None  # opened with stdout=PIPE
    child: Child | None = None
    lines: list[str] = []
    try:
        buffer = b""
        with trio.fail_after(startup_timeout):
            while child is None:
                data = await stdout.receive_some(65536)
                if not data:
                    await process.wait()
                    raise RuntimeError(f"{name} exited with code {process.returncode} before it was ready:\n"
                                       + "\n".join(lines[-keep_lines:]))
                buffer += data
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    lines.append(raw.decode(errors="replace"))
                    match = ready.search(raw)
                    if match and child is None:
                        child = Child(process, match.group(1).decode().rstrip("/"), lines)
        task_status.started(child)
        while True:  # keep draining its output so it never blocks on a full pipe
            data = await stdout.receive_some(65536)
            if not data:
                break
            buffer += data
            *complete, buffer = buffer.split(b"\n")
            lines.extend(raw.decode(errors="replace") for raw in complete)
            del lines[:-keep_lines]
        code = await process.wait()
        log.warning("%s (pid %d) exited with code %s", name, process.pid, code)
    finally:
        with trio.CancelScope(shield=True):
            await terminate(process, stop_grace)


async def start_serve(nursery: trio.Nursery, config_path: str | os.PathLike | None, *extra: str,
                      env: dict[str, str] | None = None) -> Child:
    """``llmgw serve`` on ephemeral loopback ports, in ``nursery``; its ``url`` is the OpenAI endpoint and
    ``control_url`` the control listener (from its banner ``... listening on URL (control: URL)``)."""
    argv = llmgw_command("serve", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0", *extra)
    if config_path is not None:
        argv += ["--config", str(config_path)]
    child = await nursery.start(lambda task_status: run_child(argv, name="llmgw", env=env, task_status=task_status))
    banner = next(line for line in child.output if "(control: " in line)
    child.control_url = banner.split("(control: ")[1].rstrip(")")
    return child


async def terminate(process: trio.Process, grace: float) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not exited within ``grace`` seconds."""
    await terminate_group(process.pid, wait=process.wait, running=lambda: process.returncode is None, grace=grace)
    if process.stdout is not None:
        await process.stdout.aclose()
