"""The agent's calls to an engine's sleep mode (llmgw/agent/sleep.py) against a real socket serving hostile answers:
each within its deadline, an answer read only so far, every failure a sentence; the /is_sleeping parser under
hypothesis."""

from __future__ import annotations

import functools

import pytest
import trio
from hypothesis import given, strategies as st

from llmgw.agent import sleep
from llmgw.http.client import UpstreamPool


class Engine:
    """Answers every request with ``answer`` (raw HTTP bytes; None: never answers); records the request lines."""

    def __init__(self):
        self.answer: bytes | None = b""
        self.requests: list[bytes] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            piece = await stream.receive_some(65536)
            if not piece:
                return
            head += piece
        self.requests.append(head.split(b"\r\n", 1)[0])
        if self.answer is None:
            await trio.sleep_forever()
        await stream.send_all(self.answer)
        await stream.aclose()


def answer(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)


@pytest.fixture
async def engine(nursery):
    served = Engine()
    listeners = await nursery.start(functools.partial(trio.serve_tcp, served.handle, 0, host="127.0.0.1"))
    pool = UpstreamPool("127.0.0.1", listeners[0].socket.getsockname()[1], connect_timeout=1.0)
    yield served, pool
    await pool.aclose()


async def test_sleep_and_wake_up_post_to_vllms_paths_and_say_why_not(engine):
    served, pool = engine
    served.answer = answer(b"")
    assert await sleep.sleep(pool, 1, 2.0) is None
    assert await sleep.wake_up(pool, 2.0) is None
    assert served.requests == [b"POST /sleep?level=1 HTTP/1.1", b"POST /wake_up HTTP/1.1"]
    served.answer = answer(b"Not Found", 404)  # an engine started without VLLM_SERVER_DEV_MODE
    assert await sleep.sleep(pool, 1, 2.0) == "POST /sleep?level=1: HTTP 404"


async def test_is_sleeping_reads_the_engines_answer(engine):
    served, pool = engine
    served.answer = answer(b'{"is_sleeping": true}')
    assert await sleep.is_sleeping(pool, 2.0) is True
    served.answer = answer(b'{"is_sleeping": false}')
    assert await sleep.is_sleeping(pool, 2.0) is False
    served.answer = answer(b'{"is_sleeping": "yes"}')
    assert await sleep.is_sleeping(pool, 2.0) == 'GET /is_sleeping: not {"is_sleeping": true|false}'


async def test_an_endless_answer_is_cut_at_its_bound(engine):
    served, pool = engine
    served.answer = answer(b"[" * (1 << 20))
    assert await sleep.is_sleeping(pool, 2.0) == f"GET /is_sleeping: an answer over {sleep.MAX_ANSWER_BYTES} bytes"


async def test_an_engine_that_never_answers_fails_at_the_deadline(engine):
    served, pool = engine
    served.answer = None
    with trio.fail_after(5):  # only a hung test fails here: the call's own deadline is 0.3 s
        assert await sleep.wake_up(pool, 0.3) == "POST /wake_up: no answer within 0.3s"


@given(st.integers(100, 599), st.binary(max_size=sleep.MAX_ANSWER_BYTES))
def test_any_answer_parses_to_a_bool_or_a_reason(status, body):
    parsed = sleep.parse_is_sleeping(status, body)
    assert isinstance(parsed, (bool, str))
    assert parsed is not True or (status == 200 and b"true" in body)


def test_a_deeply_nested_answer_is_a_reason_not_a_crash():
    assert isinstance(sleep.parse_is_sleeping(200, b"[" * sleep.MAX_ANSWER_BYTES), str)
