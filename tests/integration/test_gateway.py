"""The gateway end to end: `llmgw serve` and fake OpenAI upstreams as real processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest
import trio

from helpers import assert_openai_error, replicas, stats, wait_for
from llmgw.testing.metrics import scrape_value
from llmgw.testing.processes import free_port

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


def two_replica_config(a_url: str, b_url: str, extra: str = "") -> str:
    return f"""
models:
  - name: tiny
    routing: round_robin
    replicas:
      - url: {a_url}
        name: a
      - url: {b_url}
        name: b
        api_key: engine-secret
api_keys:
  - key: {KEY}
health:
  interval: 0.2s
  failures_to_down: 1
{extra}
"""


async def test_openai_client_through_llmgw(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))

    def drive():
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        served = []
        for _ in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
            served.append((raw.headers["x-llmgw-replica"], raw.parse().choices[0].message.content))
        completion = client.completions.create(model="tiny", prompt="hello")
        models = [m.id for m in client.models.list()]
        return served, completion, models

    served, completion, models = await trio.to_thread.run_sync(drive)
    assert [name for name, _ in served] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    assert all(text == f"hello from {name}" for name, text in served)  # the named replica really answered
    assert completion.choices[0].text.startswith("hello from ")
    assert models == ["tiny"]

    # Streaming: the first chunk arrives while the upstream is still producing the stream. The stream lasts 2 s so
    # that the peek (two HTTP round trips from a thread) lands inside it on a loaded machine too; a gateway that
    # buffered the stream would hand over the first chunk only after all 2 s.
    def stream_and_peek():
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_body={"x_chunks": 40, "x_chunk_delay_ms": 50})
        chunks = iter(stream)
        first = next(chunks)
        peeks = [httpx.get(u.url + "/stats").json() for u in (a, b)]
        rest = list(chunks)
        return first, peeks, rest

    first, peeks, rest = await trio.to_thread.run_sync(stream_and_peek)
    assert first.choices[0].delta.content == "tok0 "
    assert sum(p["active_streams"] for p in peeks) == 1
    assert sum(p["completed_streams"] for p in peeks) == 0
    assert [c.choices[0].delta.content for c in rest] == [f"tok{i} " for i in range(1, 40)]


async def test_killed_upstream_is_retried_marked_down_and_rejoins(start_fake_upstream, start_llmgw):
    port = free_port()
    a = await start_fake_upstream("a", port=port)
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        for i in range(20):
            if i == 5:
                a.process.kill()
                await a.process.wait()
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        assert (await wait_for(lambda: _state(gw, "a", "down")))
        assert await scrape_value(gw.control_url, "llmgw_replica_up", 'replica="a"') == 0.0
        assert await scrape_value(gw.control_url, "llmgw_replica_up", 'replica="b"') == 1.0

        await start_fake_upstream("a", port=port)
        await wait_for(lambda: _state(gw, "a", "up"))
        assert await scrape_value(gw.control_url, "llmgw_replica_up", 'replica="a"') == 1.0
        served = {(await client.post("/v1/chat/completions", json=body)).headers["x-llmgw-replica"] for _ in range(4)}
        assert served == {"a", "b"}


async def _state(gw, name: str, state: str) -> bool:
    return (await replicas(gw))[name]["state"] == state


async def test_a_503_is_retried_on_another_replica_before_the_first_byte(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a", status=503)
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        for _ in range(4):
            response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert response.status_code == 200
            assert response.headers["x-llmgw-replica"] == "b"
    assert (await stats(a))["by_path"].get("/v1/completions", 0) >= 1
    assert await scrape_value(gw.control_url, "llmgw_upstream_errors_total", 'replica="a",kind="status_5xx"') >= 1


async def test_a_stream_broken_after_its_first_byte_is_not_retried(start_fake_upstream, start_llmgw):
    """It ends with an error event (tests/integration/test_stream_errors.py), not with another replica's answer."""
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        async with client.stream("POST", "/v1/chat/completions",
                                 json={"model": "tiny", "stream": True, "x_break_after": 3}) as response:
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line]
    assert len(events) == 5 and '"error"' in events[3] and events[4] == "data: [DONE]", events
    posts = [(await stats(u))["by_path"].get("/v1/chat/completions", 0) for u in (a, b)]
    assert sorted(posts) == [0, 1]


async def test_a_streams_head_is_relayed_when_it_comes_not_with_the_first_event(start_fake_upstream, start_llmgw):
    """vLLM sends a stream's head at once and its first token after the prefill: so does the gateway."""
    a = await start_fake_upstream("a")
    gw = await start_llmgw(f"models:\n  - name: tiny\n    replicas:\n      - url: {a.url}\n")
    async with httpx.AsyncClient(base_url=gw.url) as client:
        started = time.monotonic()
        body = {"model": "tiny", "stream": True, "x_chunks": 1, "x_chunk_delay_ms": 1500}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            head = time.monotonic() - started
            lines = [line async for line in response.aiter_lines() if line]
            first_event = time.monotonic() - started
    assert lines[-1] == "data: [DONE]" and first_event >= 1.5
    assert head < first_event - 0.75, (head, first_event)


async def test_a_client_closing_after_done_is_a_finished_request_not_a_disconnect(start_fake_upstream, start_llmgw):
    """An OpenAI SDK closes the stream when it reads ``data: [DONE]``; vLLM's chunked terminator comes in a write
    of its own, after it. The request still finished (status 200, usage kept), it was no client disconnect."""
    a = await start_fake_upstream("a")
    gw = await start_llmgw(f"access_log: true\nmodels:\n  - name: tiny\n    replicas:\n      - url: {a.url}\n")
    statuses = {}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for end_delay in (0, 500):
            body = {"model": "tiny", "stream": True, "x_chunks": 3, "x_end_delay_ms": end_delay}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        break
            statuses[response.headers["x-request-id"]] = "status=200"
        # A client leaving before [DONE] is a disconnect.
        async with client.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "stream": True, "x_chunks": 50, "x_chunk_delay_ms": 20}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break
        statuses[response.headers["x-request-id"]] = "status=499"

    def logged() -> dict[str, str]:
        return {request_id: line for line in gw.lines if "llmgw.access" in line
                for request_id in statuses if f"request_id={request_id} " in line}

    with trio.fail_after(10):
        while len(access := logged()) < 3:
            await trio.sleep(0.05)
    assert all(status in access[request_id] for request_id, status in statuses.items()), access
    assert await scrape_value(gw.control_url, "llmgw_client_disconnects_total", 'model="tiny"') == 1


async def test_error_cases_answer_in_openai_shape(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    dead = f"http://127.0.0.1:{free_port()}"
    config = f"""
models:
  - name: tiny
    replicas:
      - url: {a.url}
  - name: orphan
    replicas:
      - url: {dead}
        name: orphan-0
api_keys:
  - key: {KEY}
limits:
  max_body_bytes: 1KiB
  first_byte_timeout: 300ms
health:
  interval: 0.2s
  failures_to_down: 1
"""
    gw = await start_llmgw(config)
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        post = client.post
        assert_openai_error(await post("/v1/chat/completions", json={"model": "nope", "messages": []}), 404,
                            "model_not_found")
        assert_openai_error(await post("/v1/chat/completions", content=b'{"model": "tiny",'), 400, "invalid_json")
        assert_openai_error(await post("/v1/chat/completions", json={"messages": []}), 400)
        assert_openai_error(await post("/v1/chat/completions", json={"model": "tiny", "p": "x" * 4096}), 413)
        assert_openai_error(await post("/v1/chat/completions", json={"model": "tiny"}, headers={"Authorization": ""}),
                            401, "invalid_api_key")
        assert_openai_error(await post("/v1/chat/completions", json={"model": "tiny"},
                                       headers={"Authorization": "Bearer sk-wrong"}), 401, "invalid_api_key")
        await wait_for(lambda: _state(gw, "orphan-0", "down"))
        unavailable = await post("/v1/chat/completions", json={"model": "orphan", "messages": []})
        assert_openai_error(unavailable, 503, "no_healthy_replica")
        assert int(unavailable.headers["retry-after"]) >= 1
        slow = await post("/v1/chat/completions", json={"model": "tiny", "messages": [], "x_delay_ms": 3000})
        assert_openai_error(slow, 504, "upstream_timeout")
        assert_openai_error(await client.get("/v1/chat/completions"), 405)
        assert_openai_error(await client.get("/v1/nothing-here"), 404)
    assert await scrape_value(gw.control_url, "llmgw_requests_total", 'code="404"') >= 1
    assert await scrape_value(gw.control_url, "llmgw_requests_total", 'code="504"') == 1


async def test_request_id_is_propagated_or_generated(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        given = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                                  headers={"x-request-id": "req-42"})
        assert given.headers["x-request-id"] == "req-42"
        generated = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert len(generated.headers["x-request-id"]) == 32
        assert generated.headers["x-request-id"] != "req-42"


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_a_hostile_request_id_is_replaced_and_forges_no_access_log_field(start_fake_upstream, start_llmgw,
                                                                                log_format):
    """Ids with spaces and ``key=value``, C1 controls, non-ASCII or 8,000 bytes are not kept: the request gets
    an id of the gateway's own, the original is never logged, and every access-log field is the real one."""
    a = await start_fake_upstream("a")
    gw = await start_llmgw(f"access_log: true\nmodels:\n  - name: tiny\n    replicas:\n      - url: {a.url}\n"
                           "        name: a\n", "--log-format", log_format)
    hostile = [b"FAKE model=secret replica=evil status=200", b"id\x85\x9b31m", b"\xe9t\xe9", b"L" * 8000]
    given_ids = []
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for value in hostile:
            response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                                         headers=[(b"x-request-id", value)])
            assert response.status_code == 200
            given_ids.append(response.headers["x-request-id"])
        kept = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"},
                                 headers={"x-request-id": "trace-7/ok:1"})
        assert kept.headers["x-request-id"] == "trace-7/ok:1"
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in given_ids), given_ids

    def access_lines() -> list[str]:
        return [line for line in gw.lines if "llmgw.access" in line]

    async def all_logged() -> bool:
        return len(access_lines()) >= len(hostile) + 1

    await wait_for(all_logged)
    for line in access_lines():
        if log_format == "json":
            entry = json.loads(line)
            assert (entry["model"], entry["replica"], entry["status"]) == ("tiny", "a", 200), entry
            assert entry["request_id"] in given_ids + ["trace-7/ok:1"]
        else:
            message = line.split("llmgw.access: ", 1)[1]
            fields = [part.split("=", 1)[0] for part in message.split(" ")]
            assert len(fields) == len(set(fields)), line  # no field appears twice
            assert " model=tiny " in message and " replica=a " in message and " status=200 " in message
    logged = "\n".join(gw.lines)
    for value in (b"FAKE", b"secret", b"evil", b"\x85", b"L" * 100):
        assert value.decode("latin-1") not in logged
    assert await scrape_value(gw.control_url, "llmgw_replaced_request_ids_total") == len(hostile)


async def test_client_going_away_cancels_the_upstream_stream(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "stream": True, "x_chunks": 100000, "x_chunk_delay_ms": 10}).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
                          + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    received = b""
    with trio.fail_after(10):
        while received.count(b"data: ") < 3:
            received += await stream.receive_some(65536)
    await stream.aclose()
    closed_at = time.time()

    async def aborted():
        return [t for u in (a, b) for t in (await stats(u))["aborted_at"]]

    noticed = (await wait_for(aborted, timeout=5))[0]
    # The upstream notices at its next write, at most one 10 ms pacing interval after the cancel.
    assert noticed - closed_at < 0.1 + 0.01
    assert await scrape_value(gw.control_url, "llmgw_inflight_requests", 'replica="a"') == 0
    assert await scrape_value(gw.control_url, "llmgw_inflight_requests", 'replica="b"') == 0


async def test_sigterm_drains_in_flight_requests_then_exits_zero(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))
    results = []

    async def slow_request():
        async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=10) as client:
            results.append(await client.post("/v1/completions",
                                             json={"model": "tiny", "prompt": "x", "x_delay_ms": 800}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow_request)
        await wait_for(lambda: _inflight(gw))
        os.kill(gw.pid, signal.SIGTERM)
    assert results[0].status_code == 200
    with trio.fail_after(10):
        assert await gw.process.wait() == 0


async def _inflight(gw) -> bool:
    return sum(r["inflight"] for r in (await replicas(gw)).values()) > 0


async def test_a_third_party_routing_plugin_is_installed_and_routes(start_fake_upstream, start_llmgw, tmp_path):
    source = tmp_path / "llmgw-last-tier"
    (source / "llmgw_last_tier").mkdir(parents=True)
    (source / "pyproject.toml").write_text("""
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "llmgw-last-tier"
version = "0.0.1"
[project.entry-points.llmgw]
last = "llmgw_last_tier"
""")
    (source / "llmgw_last_tier" / "__init__.py").write_text('''
import pluggy
hookimpl = pluggy.HookimplMarker("llmgw")

class AlwaysLast:  # duck-typed: no RoutingTier base class, no hook but pick
    name = "always_last"
    def __init__(self, model, services):
        pass
    async def pick(self, request, candidates):
        from llmgw.plugin import Decision
        return Decision(candidates[-1], outcome="last", tier=self.name)

@hookimpl
def register_routing_tiers():
    return {"always_last": AlwaysLast}
''')
    target = tmp_path / "site"
    result = await trio.run_process(
        [os.path.join(os.path.dirname(os.sys.executable), "pip"), "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(source)], capture_stdout=True, capture_stderr=True,
        check=False)
    assert result.returncode == 0, result.stderr.decode()

    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    config = two_replica_config(a.url, b.url).replace("routing: round_robin", "routing: always_last")
    gw = await start_llmgw(config, env={"PYTHONPATH": str(target)})
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as client:
        served = [(await client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})).headers[
            "x-llmgw-replica"] for _ in range(4)]
    assert served == ["b"] * 4
    assert await scrape_value(gw.control_url, "llmgw_routing_decisions_total", 'tier="always_last",outcome="last"') == 4


async def test_the_demo_serves_without_a_config(start_llmgw):
    gw = await start_llmgw(None)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        served = set()
        for _ in range(4):
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["role"] == "assistant"
            served.add(response.headers["x-llmgw-replica"])
    assert len(served) == 2


async def test_in_flight_prompt_tokens_count_from_the_send_and_a_failed_attempt_releases_them(
        start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a", status=503)  # every attempt on a fails: retried on b
    b = await start_fake_upstream("b")
    gw = await start_llmgw(two_replica_config(a.url, b.url))
    body = {"model": "tiny", "prompt": "p" * 4000, "x_delay_ms": 1500}  # b answers its head after 1.5 s
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=10) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: client.post("/v1/completions", json=body))
            with trio.fail_after(5):  # non-streamed, no head yet: its prompt (about 1,000 tokens) is in flight
                while (await replicas(gw))["b"]["inflight_tokens"] < 1000:
                    await trio.sleep(0.05)
            assert (await replicas(gw))["a"]["inflight_tokens"] == 0  # the failed attempt gave them back
    final = await replicas(gw)
    assert final["a"]["inflight_tokens"] == final["b"]["inflight_tokens"] == 0
