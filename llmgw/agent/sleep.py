"""vLLM's sleep mode over HTTP: put an engine to sleep, wake it up, ask whether it sleeps.

The engine is started with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``
(:func:`llmgw.agent.engine.sleep_mode_env`), which make it serve ``POST
/sleep?level=N``, ``POST /wake_up`` and ``GET /is_sleeping`` (``{"is_sleeping":
bool}``); ``llmgw sim --enable-sleep-mode`` serves the same. Every call has one
deadline for the whole exchange, and an answer is read up to
:data:`MAX_ANSWER_BYTES` only (an engine's answer is not trusted to be small).
Each call returns ``None`` when it worked, else why not, as a sentence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import trio

from ..http.client import UpstreamError, UpstreamPool

MAX_ANSWER_BYTES = 4096  # /is_sleeping answers ~25 bytes; /sleep and /wake_up nothing


async def _call(pool: UpstreamPool, method: str, path: str, timeout: float,
                headers: Sequence[tuple[bytes, bytes]]) -> tuple[int, bytes] | str:
    """``method path`` and at most :data:`MAX_ANSWER_BYTES` of its answer within ``timeout``: (status, body), or
    why it failed."""
    try:
        with trio.fail_after(timeout):
            response = await pool.request(method, path, list(headers), b"", first_byte_timeout=timeout,
                                          idle_timeout=timeout)
            body = b""
            try:
                while piece := await response.receive_piece():
                    body += piece
                    if len(body) > MAX_ANSWER_BYTES:
                        return f"{method} {path}: an answer over {MAX_ANSWER_BYTES} bytes"
            finally:
                await response.aclose()
    except trio.TooSlowError:
        return f"{method} {path}: no answer within {timeout:g}s"
    except UpstreamError as exc:
        return f"{method} {path}: {exc}"
    return response.status, body


async def _expect_ok(pool: UpstreamPool, method: str, path: str, timeout: float,
                     headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    answer = await _call(pool, method, path, timeout, headers)
    if isinstance(answer, str):
        return answer
    status, _ = answer
    return None if status == 200 else f"{method} {path}: HTTP {status}"


async def sleep(pool: UpstreamPool, level: int, timeout: float,
                headers: Sequence[tuple[bytes, bytes]] = ()) -> str | None:
    """``POST /sleep?level=N``: level 1 offloads the weights to CPU memory and drops the KV cache."""
    return await _expect_ok(pool, "POST", f"/sleep?level={int(level)}", timeout, headers)


async def wake_up(pool: UpstreamPool, timeout: float, headers: Sequence[tuple[bytes, bytes]] = ()) -> str | None:
    """``POST /wake_up``: vLLM answers once the weights are back and the KV cache is allocated again."""
    return await _expect_ok(pool, "POST", "/wake_up", timeout, headers)


async def is_sleeping(pool: UpstreamPool, timeout: float,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> bool | str:
    """``GET /is_sleeping``: True or False, or why it cannot be told (an answer that is not its JSON)."""
    answer = await _call(pool, "GET", "/is_sleeping", timeout, headers)
    return answer if isinstance(answer, str) else parse_is_sleeping(*answer)


def parse_is_sleeping(status: int, body: bytes) -> bool | str:
    """``GET /is_sleeping``'s answer: True or False, or why it is not ``{"is_sleeping": true|false}``."""
    if status != 200:
        return f"GET /is_sleeping: HTTP {status}"
    try:
        value = json.loads(body).get("is_sleeping")
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, nested past the stack
        value = None
    if not isinstance(value, bool):
        return 'GET /is_sleeping: not {"is_sleeping": true|false}'
    return value
