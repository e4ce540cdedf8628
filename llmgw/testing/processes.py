"""Child processes for tests and benchmarks: start one, wait until it is ready, read its output, stop it.

:func:`start_child` (or :func:`run_child` with ``nursery.start``) runs any argv
in its own session (so its pid is its process-group id) inside the caller's
nursery. It is ready once it printed a line matching ``ready`` (a regex whose
first group, if any, becomes ``child.url``, or a plain substring) and, with
``health_url``, once that URL answers 200; both within ``startup_timeout``
seconds, else :class:`ChildFailed` with its last lines. Its output (stdout and
stderr together) is collected in ``child.lines``, or written to a file with
``output_file=PATH``. Cancelling the nursery, or the test failing, stops the whole
group: SIGTERM, then SIGKILL after ``stop_grace`` seconds (at once with 0).
Every child has the test clusters' secret in ``CLUSTER_SECRET_ENV`` (a Redis-backed cluster needs one:
:func:`llmgw.testing.shared_state.state_section` names it) unless its ``env`` or this process's has another.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from ..procgroup import signal_group, terminate_group

log = logging.getLogger(__name__)
LISTENING = re.compile(r"listening on (https?://\S+)")
SERVE_READY = re.compile(r"llmgw listening on (https?://\S+) \(control: (https?://\S+)\)")
CLUSTER_SECRET_ENV = "LLMGW_TEST_CLUSTER_SECRET"
CLUSTER_SECRET = "the secret of the test and benchmark clusters"


class ChildFailed(RuntimeError):
    """A child exited before it was ready, or was not ready in time; the message has its last lines."""


@dataclass(eq=False)
class Child:
    """A running (or exited) child process and what it printed."""

    name: str
    argv: list[str]
    process: trio.Process
    lines: list[str] = field(default_factory=list)  # its output so far, line by line (the last ``keep_lines``)
    announced_url: str | None = None  # the ready line's first group (e.g. ``http://127.0.0.1:PORT``), if any
    announced_control_url: str | None = None  # an ``llmgw serve`` child's control listener (:func:`start_serve`)
    output_file: Path | None = None  # where its output goes instead of ``lines`` (see :func:`run_child`)
    exited: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope, repr=False)  # cancelled by :meth:`stop`

    @property
    def url(self) -> str:
        """The URL its ready line announced (an error if it announced none)."""
        if self.announced_url is None:
            raise RuntimeError(f"{self.name} announced no URL on its ready line")
        return self.announced_url

    @property
    def control_url(self) -> str:
        """An ``llmgw serve`` child's control listener (an error for any other child)."""
        if self.announced_control_url is None:
            raise RuntimeError(f"{self.name} announced no control URL")
        return self.announced_control_url

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child itself (not its group: a test that kills an agent keeps its engines)."""
        os.kill(self.pid, sig)

    async def stop(self, timeout: float = 30.0) -> int:
        """Stop it as its nursery's cancellation would (its group: SIGTERM, then SIGKILL); its exit code."""
        self.scope.cancel()
        with trio.fail_after(timeout):
            return await self.process.wait()

    async def wait_exit(self, timeout: float = 10.0) -> int:
        """Its exit code, once it exited (at most ``timeout`` seconds from now)."""
        with trio.fail_after(timeout):
            await self.exited.wait()
        code = self.process.returncode
        assert code is not None, "exited is set once the process was waited for"
        return code

    def output(self, last: int = 60) -> str:
        """Its last ``last`` lines as one text."""
        lines = self.lines
        if self.output_file is not None:
            try:
                lines = self.output_file.read_text(errors="replace").splitlines()
            except OSError:
                lines = []
        return "\n".join(lines[-last:])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child that must be told its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llmgw_command(*args: str) -> list[str]:
    """``python -m llmgw ARGS`` with this interpreter."""
    return [sys.executable, "-m", "llmgw", *args]


async def run_bench(tmp_path: Path, name: str, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    """``llmgw bench NAME ARGS --json`` run to its end within ``timeout`` (its cache under ``tmp_path``): the
    finished process (its exit status asserted 0, with its output's end) and the JSON report it wrote."""
    out = tmp_path / f"{name}.json"
    with trio.fail_after(timeout):
        done = await trio.run_process(llmgw_command("bench", name, *args, "--json", str(out)), capture_stdout=True,
                                      capture_stderr=True, check=False,
                                      env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-3000:]
    return done, json.loads(out.read_text())


def _matcher(ready: str | re.Pattern | None):
    """``line -> match`` for ``ready``: a truthy match object (or True) when the line says the child is ready."""
    if ready is None:
        return lambda line: False
    if isinstance(ready, str):
        return lambda line: ready in line
    if isinstance(ready.pattern, bytes):
        ready = re.compile(ready.pattern.decode(), ready.flags & ~re.UNICODE)
    return ready.search


async def run_child(argv: list[str], *, name: str, ready: str | re.Pattern | None = LISTENING,
                    health_url: str | None = None, env: dict[str, str] | None = None,
                    cwd: str | os.PathLike | None = None, startup_timeout: float = 30.0, stop_grace: float = 5.0,
                    keep_lines: int = 10_000, output_file: str | os.PathLike | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``argv`` until it exits or is cancelled; ``task_status.started(Child)`` once it is ready.

    ``ready``: a regex (str or bytes) or a substring of the line that says it is ready, or None for no line;
    ``env``: added to this process's environment; ``output_file``: a file for its output (nothing in ``lines``)."""
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env.setdefault(CLUSTER_SECRET_ENV, CLUSTER_SECRET)
    log_path = Path(output_file) if output_file is not None else None
    log_file = open(log_path, "wb") if log_path is not None else None
    output = log_file if log_file is not None else subprocess.PIPE
    try:
        process = await trio.lowlevel.open_process(argv, stdout=output, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, env=full_env, cwd=cwd,
                                                   start_new_session=True)
    finally:
        if log_file is not None:
            log_file.close()
    child = Child(name, list(argv), process, output_file=log_path)
    matches = _matcher(ready)
    is_ready = trio.Event()
    if ready is None:
        is_ready.set()
    failure: str | None = None
    try:
        with child.scope:
            failure = await _start_and_follow(child, matches, is_ready, keep_lines, startup_timeout, health_url,
                                              task_status)
        if failure is not None:
            raise ChildFailed(f"{failure}:\n{child.output(50)}")
        if child.returncode is not None:
            log.warning("%s (pid %d) exited with code %s", name, process.pid, process.returncode)
    finally:
        with trio.CancelScope(shield=True):
            await stop(process, stop_grace)


async def _start_and_follow(child: Child, matches, is_ready: trio.Event, keep_lines: int, startup_timeout: float,
                            health_url: str | None, task_status) -> str | None:
    """Follow the child's output until it exits; ``task_status.started(child)`` once it is ready. What kept it
    from getting ready, or None."""
    name, process = child.name, child.process
    failure = None
    async with trio.open_nursery() as inner:
        inner.start_soon(_follow, child, matches, is_ready, keep_lines)
        try:
            with trio.fail_after(startup_timeout):
                await is_ready.wait()
                if child.exited.is_set():
                    failure = f"{name} exited with code {process.returncode} before it was ready"
                elif health_url is not None and not await _healthy(child, health_url):
                    failure = f"{name} exited with code {process.returncode} before {health_url} answered"
        except trio.TooSlowError:
            failure = f"{name} was not ready within {startup_timeout:g} s"
        if failure is not None:
            inner.cancel_scope.cancel()
        else:
            task_status.started(child)
    return failure


async def start_child(nursery: trio.Nursery, argv: list[str], *, name: str, **options) -> Child:
    """:func:`run_child` in ``nursery``, once ready; ``options`` are those of :func:`run_child`."""
    return await nursery.start(partial(run_child, argv, name=name, **options))


async def _follow(child: Child, matches, is_ready: trio.Event, keep_lines: int) -> None:
    """Collect the child's lines (so it never blocks on a full pipe) until it exits; set ``is_ready`` on the
    ready line, or on exit."""
    try:
        if child.output_file is not None:
            await _follow_file(child, matches, is_ready)
        else:
            buffer = b""
            assert child.process.stdout is not None, "started with stdout=PIPE when there is no output file"
            async for data in child.process.stdout:
                buffer += data
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    line = raw.decode(errors="replace")
                    child.lines.append(line)
                    if not is_ready.is_set() and (match := matches(line)):
                        _ready(child, match)
                        is_ready.set()
                if len(child.lines) > keep_lines:
                    del child.lines[:-keep_lines]
        await child.process.wait()
    finally:
        child.exited.set()
        is_ready.set()


async def _follow_file(child: Child, matches, is_ready: trio.Event) -> None:
    """Until the ready line: re-read the log file as it grows (the child writes it itself)."""
    assert child.output_file is not None
    while not is_ready.is_set() and child.process.returncode is None:
        for line in child.output_file.read_text(errors="replace").splitlines():
            if match := matches(line):
                _ready(child, match)
                is_ready.set()
                return
        await trio.sleep(0.05)


def _ready(child: Child, match) -> None:
    if isinstance(match, re.Match) and match.re.groups >= 1:
        child.announced_url = match.group(1).rstrip("/")
        if match.re.groups >= 2:
            child.announced_control_url = match.group(2).rstrip("/")


async def _healthy(child: Child, url: str) -> bool:
    """Poll ``url`` until it answers 200 (True) or the child exits (False)."""
    import httpx

    async with httpx.AsyncClient(timeout=2, verify=False) as client:
        while not child.exited.is_set():
            try:
                if (await client.get(url)).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await trio.sleep(0.1)
    return False


async def stop(process: trio.Process, grace: float) -> None:
    """Stop the child's process group: SIGTERM, then SIGKILL if it still runs ``grace`` seconds later; then
    SIGKILL what is left of the group once the child has exited."""
    if grace <= 0:
        if process.returncode is None:
            signal_group(process.pid, signal.SIGKILL)
        await process.wait()
    else:
        await terminate_group(process.pid, wait=process.wait, running=lambda: process.returncode is None,
                              grace=grace)
    signal_group(process.pid, signal.SIGKILL)  # whatever the leader left behind in its group
    if process.stdout is not None:
        await process.stdout.aclose()


# ``python -m llmgw`` that first prints which ``llmgw`` package it imported (``MODULE_LINE`` and its file)
ANNOUNCING_LLMGW = ("import runpy, sys, llmgw; print('llmgw module:', llmgw.__file__, flush=True); "
                    "runpy.run_module('llmgw', run_name='__main__', alter_sys=True)")
MODULE_LINE = re.compile(r"^llmgw module: (.+)$")


def checkout_env(source: str | os.PathLike) -> dict[str, str]:
    """The environment (beside ``cwd=source``) that makes a child's ``python -m llmgw`` import the checkout in
    ``source``, whatever this process's PYTHONPATH (a compiled tree, say) and PYTHONSAFEPATH (which would drop
    the working directory from the path)."""
    return {"PYTHONPATH": str(source), "PYTHONSAFEPATH": ""}


def announced_module(child: Child) -> str | None:
    """The ``llmgw`` package file a child started with ``announce_module`` imported (from its first lines)."""
    for line in child.output(10_000).splitlines():
        if match := MODULE_LINE.match(line):
            return match.group(1)
    return None


async def start_serve(nursery: trio.Nursery, config_path: str | os.PathLike | None, *extra: str,
                      env: dict[str, str] | None = None, announce_module: bool = False, **options) -> Child:
    """``llmgw serve`` on ephemeral loopback ports, in ``nursery``; its ``url`` is the OpenAI endpoint and
    ``control_url`` the control listener (from its banner ``llmgw listening on URL (control: URL)``).
    ``announce_module``: it first prints the ``llmgw`` package it imported (:func:`announced_module`)."""
    argv = llmgw_command("serve", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0", *extra)
    if announce_module:
        argv[1:3] = ["-c", ANNOUNCING_LLMGW]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    return await start_child(nursery, argv, name="llmgw", ready=SERVE_READY, env=env, **options)
