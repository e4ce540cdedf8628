"""Hostile request bodies against a real ``llmgw serve`` and a fake upstream: typed 4xx answers, never a 500,
never a dead process; the bounds are counted in ``llmgw_rejected_bodies_total``."""

from __future__ import annotations

import json

import httpx
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from llmgw.http.jsonbody import DEFAULT_MAX_CONTAINERS

CHAT = "/v1/chat/completions"


def config(upstream_url: str, extra: str = "") -> str:
    return f"""
models:
  - name: tiny
    replicas: [{{url: {upstream_url}, name: plain}}]
  - name: tree
    routing: prefix_tree
    replicas: [{{url: {upstream_url}, name: tree}}]
log_level: warning
{extra}
"""


def assert_openai_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error["message"]


async def rejected(gw, reason: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.control_url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith(f'llmgw_rejected_bodies_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_deep_json_is_a_400_in_openai_shape_not_a_500(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(config(upstream.url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for depth in (101, 2_000, 90_000):  # past the bound, past Python's recursion limit, and far past
            body = b'{"model":"tiny","messages":' + b"[" * depth + b"]" * depth + b"}"
            message = assert_openai_error(await client.post(CHAT, content=body), 400, "invalid_json")
            assert "deeper than 100 levels" in message
        ok = await client.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text
    assert await rejected(gw, "too_deep") == 3
    assert gw.process.returncode is None


async def test_nan_and_infinity_are_a_400_never_forwarded(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")  # it would answer 200 to anything forwarded
    gw = await start_llmgw(config(upstream.url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for word, why in (("NaN", "not a JSON number"), ("Infinity", "not a JSON number"),
                          ("-Infinity", "not a JSON number"), ("1e400", "beyond what a double holds"),
                          ("-1E+999", "beyond what a double holds")):  # the last two: Python reads them as inf
            body = ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": %s}'
                    % word).encode()
            message = assert_openai_error(await client.post(CHAT, content=body, headers={
                "content-type": "application/json"}), 400, "invalid_json")
            assert word in message and why in message
        ok = await client.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "NaN"}],
                                           "temperature": 0.5})
        assert ok.status_code == 200, ok.text
    assert await rejected(gw, "non_finite_number") == 5


async def test_bounds_follow_the_limits_keys(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(config(upstream.url, "limits:\n  max_json_depth: 5\n  max_json_values: 50\n"
                                                "  max_json_containers: 8\n"))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        deep = {"model": "tiny", "x": [[[[[1]]]]]}  # 6 levels with the outer object
        assert_openai_error(await client.post(CHAT, json=deep), 400, "invalid_json")
        wide = {"model": "tiny", "prompt": list(range(60))}
        message = assert_openai_error(await client.post("/v1/completions", json=wide), 413, "request_too_complex")
        assert "more than 50 JSON values" in message
        many = {"model": "tiny", "x": [[], [], [], [], [], [], [], []]}
        message = assert_openai_error(await client.post(CHAT, json=many), 413, "request_too_complex")
        assert "more than 8 JSON arrays and objects" in message
        fits = {"model": "tiny", "prompt": list(range(40)), "x": [[[1]]]}
        assert (await client.post("/v1/completions", json=fits)).status_code == 200
    assert await rejected(gw, "too_many_values") == 1
    assert await rejected(gw, "too_many_containers") == 1


async def test_a_body_of_many_small_values_is_refused_before_it_is_parsed(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(config(upstream.url))
    body = b'{"model":"tiny","x":[' + b",".join([b"[]"] * DEFAULT_MAX_CONTAINERS) + b"]}"
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        assert_openai_error(await client.post(CHAT, content=body), 413, "request_too_complex")
    assert await rejected(gw, "too_many_containers") == 1


# -- fuzzing ----------------------------------------------------------------------------------------------------------

_keys = st.text(max_size=8).filter(lambda key: not key.startswith("x_"))  # x_* steer the fake upstream
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_keys, children, max_size=4),
    max_leaves=25,
)
_messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                           "content": st.one_of(st.text(max_size=50), _json_values)}),
    _json_values,
), max_size=4)
_request = st.fixed_dictionaries(
    {"model": st.one_of(st.sampled_from(["tiny", "tree"]), _json_values)},
    optional={"messages": st.one_of(_messages, _json_values), "prompt": _json_values,
              "max_tokens": _json_values, "stream": st.booleans()},
)
_bodies = st.one_of(
    _request.map(lambda value: json.dumps(value).encode()),
    _json_values.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=300),
    st.tuples(_request, st.integers(0, 80), st.binary(max_size=8)).map(
        lambda t: json.dumps(t[0]).encode()[: t[1]] + t[2]),
    st.tuples(st.integers(90, 3000), st.sampled_from([b"[", b"{\"a\":", b"[1,"])).map(
        lambda t: b'{"model":"tiny","messages":' + t[1] * t[0]),
)


async def test_fuzzed_bodies_get_typed_answers_and_the_gateway_lives(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a", chunks=2)
    gw = await start_llmgw(config(upstream.url))
    seen: set[int] = set()
    answered = []

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=_bodies, path=st.sampled_from([CHAT, "/v1/completions", "/v1/embeddings"]))
    def fuzz(client: httpx.Client, body: bytes, path: str) -> None:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        seen.add(response.status_code)
        answered.append(response.status_code)
        if response.status_code == 200:
            return
        assert response.status_code in (400, 404, 413), (body, response.status_code, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]

    def run() -> None:
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            fuzz(client)

    await trio.to_thread.run_sync(run)
    assert len(answered) >= 300 and {200, 400} <= seen, (len(answered), seen)
    assert gw.process.returncode is None
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        ok = await client.post(CHAT, json={"model": "tree", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200


async def test_requests_the_http_server_refuses_are_counted(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(config(upstream.url))
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    for raw in (b"GET /health HTTP/1.1\r\n\r\n", b"GET /health\r\n\r\n",
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"):
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(raw)
                answer = b""
                while chunk := await stream.receive_some(65536):
                    answer += chunk
        assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 505 ", b"HTTP/1.1 501 ")), answer
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.control_url + "/metrics")).text
    for code in ("400", "501", "505"):
        assert f'llmgw_http_refused_requests_total{{code="{code}"}} 1.0' in text
