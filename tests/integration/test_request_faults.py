"""Failures a request may cause stay with that request: real `llmgw serve`, simulators and fake upstreams.

The gateway retries on another replica only what never reached a replica or what a replica said about its own
health (502/503/504); an engine's answer to a bad request is relayed as it is, never retried, never counted
against the replica. Simulators reject what vLLM rejects and survive what used to kill them.
"""

from __future__ import annotations

import httpx

from helpers import assert_openai_error, replicas, stats, wait_for
from llmgw.testing.metrics import scrape_value
from llmgw.testing.sims import gateway_config, start_sims

CHAT = "/v1/chat/completions"
POISON_SALT = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"cache_salt":"\\ud800","max_tokens":40}'


def fake_config(*replicas_: tuple[str, str], model: str = "tiny", health: str = "interval: 0.2s") -> str:
    listed = "".join(f"      - url: {url}\n        name: {name}\n" for name, url in replicas_)
    return f"models:\n  - name: {model}\n    routing: round_robin\n    replicas:\n{listed}health:\n  {health}\n"


async def posts(*upstreams) -> int:
    return sum([(await stats(u))["by_path"].get(CHAT, 0) for u in upstreams])


async def test_a_lone_surrogate_salt_is_a_400_from_the_sim_kills_no_sim_and_is_not_retried(nursery, start_llmgw):
    sims = await start_sims(nursery, 2, num_blocks=64, time_scale=0.0,
                            extra=["--prefix-caching-hash-algo", "sha256_cbor"])
    pids = [s.pid for s in sims]
    gw = await start_llmgw(gateway_config([s.url for s in sims], routing="round_robin"))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for _ in range(5):
            response = await client.post(CHAT, content=POISON_SALT, headers={"content-type": "application/json"})
            error = assert_openai_error(response, 400)
            assert error["type"] == "BadRequestError" and "surrogates not allowed" in error["message"]
            assert response.headers["x-llmgw-replica"].startswith("sim-") and response.headers["x-request-id"]
        streamed = await client.post(CHAT, content=POISON_SALT.replace(b'"max_tokens"', b'"stream":true,"max_tokens"'))
        assert_openai_error(streamed, 400)
        for field in (b'"role":"\\udfff"', b'"content":"a\\udbffb"'):
            body = b'{"model":"tiny","messages":[{%s%s}]}' % (
                field, b',"content":"hi"' if b"role" in field else b',"role":"user"')
            assert_openai_error(await client.post(CHAT, content=body), 400)
        served = set()
        for _ in sims:  # every sim still serves, in the same process (round robin: one request each)
            ok = await client.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 3})
            assert ok.status_code == 200, ok.text
            served.add(ok.headers["x-llmgw-replica"])
        assert len(served) == len(sims)
    assert [s.pid for s in sims] == pids and all(s.process.returncode is None for s in sims)
    async with httpx.AsyncClient(timeout=10) as client:
        for sim in sims:
            metrics = (await client.get(sim.url + "/metrics")).text.splitlines()
            failures = [line for line in metrics if line.startswith("llmgw_sim_request_failures_total{")]
            assert len(failures) == 1 and failures[0].endswith(" 0.0")  # refused at the door, not failed inside
    assert await scrape_value(gw.control_url, "llmgw_retries_total", 'model="tiny"') in (None, 0.0)
    assert await scrape_value(gw.control_url, "llmgw_requests_total", 'model="tiny",code="400"') == 8
    assert {r["state"] for r in (await replicas(gw)).values()} <= {"up", "unknown"}


async def test_the_sim_answers_vllms_400_for_json_too_deep_and_surrogates(nursery):
    (sim,) = await start_sims(nursery, 1, num_blocks=64, time_scale=0.0)
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as client:
        deep = b'{"model":"tiny","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
        assert_openai_error(await client.post(CHAT, content=deep), 400)
        assert_openai_error(await client.post("/v1/completions", content=b'{"prompt":"\\ud800"}'), 400)
        assert_openai_error(await client.post("/tokenize", content=b'{"prompt":"x","\\udc00":1}'), 400)
        paired = await client.post("/v1/completions", content=b'{"prompt":"\\ud83d\\ude00","max_tokens":2}')
        assert paired.status_code == 200, paired.text  # a surrogate pair is a character, not an error
        assert (await client.get("/health")).status_code == 200
    assert sim.process.returncode is None


async def test_an_engine_500_is_relayed_as_is_not_retried_and_does_not_count_against_health(
        start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(fake_config(("a", a.url), ("b", b.url)))  # passive_failures_to_down: 3
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for i in range(12):  # a steady stream of requests the engines fail on
            status = 500 if i % 3 else 400
            response = await client.post(CHAT, json={"model": "tiny", "x_status": status},
                                         headers={"x-request-id": f"bad-{i}"})
            assert response.status_code == status
            assert response.json()["error"]["message"] == "forced by x_status"  # the engine's own words
            assert response.headers["x-request-id"] == f"bad-{i}"
            assert response.headers["x-served-by"] == response.headers["x-llmgw-replica"]
        assert {r["state"] for r in (await replicas(gw)).values()} == {"up"}
        good = {(await client.post(CHAT, json={"model": "tiny"})).headers["x-llmgw-replica"] for _ in range(4)}
        assert good == {"a", "b"}  # both still routable
    assert await posts(a, b) == 12 + 4  # each bad request went to one replica, once
    assert await scrape_value(gw.control_url, "llmgw_retries_total", 'model="tiny"') in (None, 0.0)
    failures = "llmgw_upstream_request_failures_total"
    caused = [await scrape_value(gw.control_url, failures, f'replica="{n}",reason="status_500"')
              for n in ("a", "b")]
    assert sum(v or 0 for v in caused) == 8


async def test_a_replica_that_closes_after_taking_the_request_is_not_retried_nor_counted(
        start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(fake_config(("a", a.url), ("b", b.url)))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for _ in range(6):
            response = await client.post(CHAT, json={"model": "tiny", "x_close": True})
            error = assert_openai_error(response, 502, "upstream_error")
            assert "after it took the request" in error["message"] and response.headers["x-request-id"]
        assert {r["state"] for r in (await replicas(gw)).values()} == {"up"}
    assert await posts(a, b) == 6
    caused = [await scrape_value(gw.control_url, "llmgw_upstream_request_failures_total",
                                 f'replica="{n}",reason="closed_after_request"') for n in ("a", "b")]
    assert sum(v or 0 for v in caused) == 6


async def test_an_unwell_503_is_retried_counted_and_a_passing_probe_brings_the_replica_back(
        start_fake_upstream, start_llmgw):
    sick = await start_fake_upstream("sick", status=503)
    b = await start_fake_upstream("b")
    lone = await start_fake_upstream("lone", status=503)
    health = "interval: 30s\n  successes_to_up: 3\n  passive_failures_to_down: 1"
    config = (f"models:\n  - name: tiny\n    routing: round_robin\n    replicas:\n"
              f"      - url: {sick.url}\n        name: sick\n      - url: {b.url}\n        name: b\n"
              f"  - name: other\n    replicas:\n      - url: {lone.url}\n        name: lone\n"
              f"health:\n  {health}\n")
    gw = await start_llmgw(config)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        for _ in range(2):
            response = await client.post(CHAT, json={"model": "tiny"})
            assert response.status_code == 200 and response.headers["x-llmgw-replica"] == "b"
        assert (await stats(sick))["by_path"].get(CHAT, 0) >= 1
        errors = await scrape_value(gw.control_url, "llmgw_upstream_errors_total", 'replica="sick",kind="status_5xx"')
        assert errors is not None and errors >= 1
        # Down on the 503, its probe (which passes) runs at once: back long before the 30 s interval.
        await wait_for(lambda: _state(gw, "sick", "up"), timeout=10)
        # No other replica: the client gets the upstream's own 503 and body.
        alone = await client.post(CHAT, json={"model": "other"})
        assert alone.status_code == 503 and alone.json()["error"]["message"] == "forced by x_status"
        assert alone.headers["x-llmgw-replica"] == "lone" and alone.headers["x-request-id"]


async def _state(gw, name: str, state: str) -> bool:
    return (await replicas(gw))[name]["state"] == state


async def test_when_every_replica_is_unreachable_the_error_names_each_and_why(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    b = await start_fake_upstream("b")
    gw = await start_llmgw(fake_config(("a", a.url), ("b", b.url), health="interval: 60s"))
    await wait_for(lambda: _all_up(gw))
    for upstream in (a, b):
        upstream.process.kill()
        await upstream.process.wait()
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        response = await client.post(CHAT, json={"model": "tiny"}, headers={"x-request-id": "gone-1"})
    error = assert_openai_error(response, 503, "no_healthy_replica")
    assert response.headers["x-request-id"] == "gone-1"
    for name, upstream in (("a", a), ("b", b)):
        port = upstream.url.rsplit(":", 1)[1]
        assert f"{name}: cannot connect to 127.0.0.1:{port}" in error["message"], error["message"]


async def _all_up(gw) -> bool:
    return {r["state"] for r in (await replicas(gw)).values()} == {"up"}


async def test_gateway_made_answers_carry_a_request_id(start_fake_upstream, start_llmgw):
    a = await start_fake_upstream("a")
    gw = await start_llmgw(fake_config(("a", a.url)) + "api_keys:\n  - key: sk-1\nlimits:\n  max_body_bytes: 64KiB\n")
    auth = {"Authorization": "Bearer sk-1"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        answers = [
            await client.post(CHAT, json={"model": "nope"}, headers=auth),
            await client.post(CHAT, content=b'{"model": "tiny",', headers=auth),
            await client.post(CHAT, json={"messages": []}, headers=auth),
            await client.post(CHAT, json={"model": "tiny"}),
            await client.get(CHAT, headers=auth),
            await client.get("/v1/nothing", headers=auth),
            await client.get("/v1/models", headers=auth),
            await client.get("/health"),
            await client.post(CHAT, content=b"x" * 70_000, headers=auth),  # refused by the HTTP server itself
        ]
        # Whatever the answer to JSON nested beyond the parser (another layer's limit), it has an id too.
        deep = await client.post(CHAT, content=b'{"model":' + b"[" * 20_000 + b"]" * 20_000 + b"}", headers=auth)
        assert deep.headers["x-request-id"]
        echoed = await client.post(CHAT, json={"model": "nope"}, headers={**auth, "x-request-id": "mine-7"})
    assert [r.status_code for r in answers] == [404, 400, 400, 401, 405, 404, 200, 200, 413]
    ids = [r.headers.get("x-request-id") for r in answers]
    assert all(ids) and len(set(ids)) == len(ids), ids
    assert echoed.headers["x-request-id"] == "mine-7"
