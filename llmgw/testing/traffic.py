"""Steady traffic through one gateway, every answer recorded: what a fault cost the clients of that gateway.

:class:`TrafficRecorder` sends one request every ``every`` seconds (each in a task of its own, so a request that
hangs does not delay the next: a frozen gateway or a stalled replica shows as late or failed answers, not as fewer
requests) and keeps each :class:`Answer`: when it was sent, how long it took, its status and the error code of a
failure (``no_healthy_replica``, ``state_not_loaded``..., or the exception of a request that got no answer).
Fault tests and the chaos benchmark run one per gateway during a fault and count what failed.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import httpx
import trio

from .cluster import CHAT


@dataclass(frozen=True)
class Answer:
    sent: float  # trio.current_time() when it was sent
    seconds: float
    status: int  # 0: no answer (a timeout, a refused connection)
    error: str  # "" for a 200; else the error code of the body, or the exception's name

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass(eq=False)
class TrafficRecorder:
    """Chats to ``url`` (a gateway's OpenAI endpoint) every ``every`` seconds until cancelled, each answer kept."""

    http: httpx.AsyncClient
    url: str
    name: str = ""
    every: float = 0.1
    timeout: float = 10.0  # a request with no answer by then counts as failed (status 0)
    body: dict = field(default_factory=lambda: dict(CHAT))
    answers: list[Answer] = field(default_factory=list)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as requests:
            task_status.started()
            next_at = trio.current_time()
            while True:
                requests.start_soon(self._one)
                next_at += self.every
                await trio.sleep_until(next_at)

    async def _one(self) -> None:
        sent = trio.current_time()
        status, error = 0, ""
        try:
            with trio.fail_after(self.timeout):
                response = await self.http.post(self.url + "/v1/chat/completions", json=self.body,
                                                timeout=self.timeout)
            status = response.status_code
            if status != 200:
                error = error_code(response.text)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            error = type(exc).__name__
        self.answers.append(Answer(sent, trio.current_time() - sent, status, error))

    def failed(self, since: float = float("-inf"), until: float = float("inf")) -> list[Answer]:
        """The answers that were not 200, of the requests sent in ``[since, until)``."""
        return [a for a in self.answers if not a.ok and since <= a.sent < until]

    def sent(self, since: float = float("-inf"), until: float = float("inf")) -> int:
        return sum(since <= a.sent < until for a in self.answers)

    def summary(self, since: float = float("-inf"), until: float = float("inf")) -> dict[str, int]:
        """``{"200": n, "503 no_healthy_replica": n, "0 ReadTimeout": n, ...}`` of the requests sent in the span."""
        return dict(Counter(f"{a.status} {a.error}".strip() for a in self.answers if since <= a.sent < until))

    def first_failure(self, since: float = float("-inf")) -> float | None:
        failed = self.failed(since)
        return min(a.sent for a in failed) if failed else None


def error_code(text: str) -> str:
    """The error code of an OpenAI-style error body (``{"error": {"code": ...}}``), else its first 60 characters."""
    try:
        error = json.loads(text).get("error")
        code = error.get("code") or error.get("type") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        code = None
    return str(code) if code else text[:60]
