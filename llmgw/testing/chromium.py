"""A headless Chromium for tests, driven over the DevTools protocol on a websocket (trio-websocket).

:func:`start_chromium` runs Debian's ``chromium`` (``./dev test`` installs it when missing) in the caller's
nursery on a loopback DevTools port; :func:`open_page` opens a new tab (with a ``sessionStorage`` of its own)
in which a test navigates, evaluates JavaScript, waits for the DOM and takes screenshots. Every console error,
uncaught exception, error log entry (failed loads, Content-Security-Policy refusals) and
``securitypolicyviolation`` event of the tab is collected in :attr:`Page.errors`.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio
import trio_websocket

from .processes import Child, start_child

DEVTOOLS_READY = re.compile(r"DevTools listening on (ws://\S+)")
COMMAND_TIMEOUT = 30.0  # seconds for one DevTools command's answer
MAX_MESSAGE = 64 << 20  # a screenshot comes back in one message
# Reports the page's CSP violations as console errors: injected before any of the page's own script runs.
_REPORT_VIOLATIONS = ("document.addEventListener('securitypolicyviolation', (e) => console.error("
                      "'CSP violation: ' + e.violatedDirective + ' ' + (e.blockedURI || 'inline')));")


class DevToolsError(RuntimeError):
    """A DevTools command answered with an error, or no answer came in time."""


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no chromium on PATH: install Debian's package (apt-get install -y chromium; "
                            "./dev test does it when it is missing)")


async def start_chromium(nursery: trio.Nursery, profile_dir: str | os.PathLike) -> Child:
    """Headless Chromium on an ephemeral loopback DevTools port; ``child.url`` is its browser websocket."""
    argv = [chromium_binary(), "--headless=new", "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0", f"--user-data-dir={profile_dir}", "--no-first-run",
            "--no-default-browser-check", "--disable-gpu", "--disable-extensions", "--disable-sync",
            "--disable-background-networking", "--disable-dev-shm-usage", "--window-size=1400,1000"]
    if os.geteuid() == 0:
        argv.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    return await start_child(nursery, [*argv, "about:blank"], name="chromium", ready=DEVTOOLS_READY,
                             startup_timeout=60)


class DevTools:
    """One DevTools websocket: ``await send(method, **params)`` -> its result; events go to ``on_event``."""

    def __init__(self, ws: trio_websocket.WebSocketConnection, on_event=None):
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel] = {}
        self._on_event = on_event or (lambda method, params: None)

    async def receive(self) -> None:
        """Route answers to their senders and events to ``on_event`` until the connection closes."""
        try:
            while True:
                message = json.loads(await self._ws.get_message())
                if "id" in message:
                    channel = self._waiting.pop(message["id"], None)
                    if channel is not None:
                        channel.send_nowait(message)
                else:
                    self._on_event(message.get("method"), message.get("params", {}))
        except trio_websocket.ConnectionClosed:
            return

    async def send(self, method: str, **params: Any) -> dict:
        number = next(self._ids)
        send, receive = trio.open_memory_channel[dict](1)
        self._waiting[number] = send
        await self._ws.send_message(json.dumps({"id": number, "method": method, "params": params}))
        with trio.move_on_after(COMMAND_TIMEOUT):
            answer = await receive.receive()
            if "error" in answer:
                raise DevToolsError(f"{method}: {answer['error']}")
            return answer.get("result", {})
        self._waiting.pop(number, None)
        raise DevToolsError(f"{method}: no answer within {COMMAND_TIMEOUT:g} s")


class Page:
    """A browser tab: navigate, evaluate, wait for a condition, screenshot; its errors in :attr:`errors`."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.devtools: DevTools | None = None
        self._loaded = trio.Event()

    def on_event(self, method: str, params: dict) -> None:
        if method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", "")))
                                                      for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + details.get("exception", {}).get("description", details.get("text")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())

    async def send(self, method: str, **params: Any) -> dict:
        assert self.devtools is not None, "the page is open"
        return await self.devtools.send(method, **params)

    async def navigate(self, url: str, timeout: float = 30.0) -> None:
        """Open ``url`` in the tab and wait for its load event."""
        self._loaded = trio.Event()
        await self.send("Page.navigate", url=url)
        with trio.fail_after(timeout):
            await self._loaded.wait()

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (a promise is awaited)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise DevToolsError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, what: str, expression: str, timeout: float = 30.0) -> Any:
        """The first truthy value of ``expression``, polled every 100 ms; a clear failure after ``timeout``."""
        value = None
        with trio.move_on_after(timeout):
            while not (value := await self.evaluate(expression)):
                await trio.sleep(0.1)
            return value
        raise AssertionError(f"the page did not show {what} within {timeout:g} s (last: {value!r}; "
                             f"errors: {self.errors})")

    async def screenshot(self, path: str | os.PathLike) -> None:
        data = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        Path(path).write_bytes(base64.b64decode(data["data"]))


@asynccontextmanager
async def open_page(browser: Child) -> AsyncIterator[Page]:
    """A new tab of ``browser`` (a :func:`start_chromium` child), closed on exit."""
    page = Page()
    async with trio.open_nursery() as nursery:
        async with trio_websocket.open_websocket_url(browser.url, max_message_size=MAX_MESSAGE) as browser_ws:
            root = DevTools(browser_ws)
            nursery.start_soon(root.receive)
            target = (await root.send("Target.createTarget", url="about:blank"))["targetId"]
            page_url = browser.url.split("/devtools/")[0] + f"/devtools/page/{target}"
            try:
                async with trio_websocket.open_websocket_url(page_url, max_message_size=MAX_MESSAGE) as page_ws:
                    page.devtools = DevTools(page_ws, page.on_event)
                    nursery.start_soon(page.devtools.receive)
                    for domain in ("Page", "Runtime", "Log"):
                        await page.send(f"{domain}.enable")
                    await page.send("Page.addScriptToEvaluateOnNewDocument", source=_REPORT_VIOLATIONS)
                    yield page
            finally:
                with trio.move_on_after(5, shield=True):
                    await root.send("Target.closeTarget", targetId=target)
        nursery.cancel_scope.cancel()
