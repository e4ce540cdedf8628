"""Admission and settlement in the data plane (issue 30, items 2 and 3): a gateway with keys and limits in front
of real simulators. A limited key's request is reserved before routing and refused 429 in OpenAI's shape with
``Retry-After`` and the ``x-ratelimit-*`` headers; every answer of a limited key carries the headers; the
reservation is settled with the engine's usage, once, however the answer ends (a stream whose usage the gateway
asked for and the client did not see, a stream broken off, a client that went away)."""

from __future__ import annotations

import json
import re
import signal

import httpx
import trio

from helpers import wait_for
from llmgw.tenancy.usage import FIELDS
from llmgw.testing.shared_state import state_section, wait_replicas
from llmgw.testing.sims import gateway_config, start_sims

LIMITED, OPEN, NARROW = "sk-limited-0001", "sk-open-0002", "sk-narrow-0003"
MESSAGES = [{"role": "user", "content": "tell me about the sea"}]


def config(url: str, limits: str, *, keys: str = "") -> str:
    return (f"models:\n  - name: tiny\n    replicas:\n      - url: {url}\n        name: a\n"
            f"api_keys:\n  - key: {LIMITED}\n    name: limited\n    limits: {limits}\n"
            f"  - key: {OPEN}\n    name: open\n"
            f"  - key: {NARROW}\n    name: narrow\n    models: [other]\n    limits: {{rpm: 1000}}\n{keys}")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def chat(gw, key: str, model: str = "tiny", **fields) -> httpx.Response:
    return await gw.post("/v1/chat/completions", {"model": model, "messages": MESSAGES, **fields}, headers=auth(key))


def ratelimit_headers(response: httpx.Response) -> dict[str, str]:
    return {name: value for name, value in response.headers.items() if name.startswith("x-ratelimit-")}


async def in_flight(gw) -> bool:
    return any(replica.local_inflight for replica in gw.gateway.replicas)


def usage_rows(gw) -> list:
    """Every row the gateway's usage sink is given from now on (key name, status class counts...)."""
    seen: list = []
    gw.gateway.tenancy.usage.on_row.append(lambda row, counts: seen.append((row, dict(zip(FIELDS, counts)))))
    return seen


async def test_rpm_refused_429_with_retry_after_and_headers_on_every_answer(gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=256, extra=("--output-tokens", "4:4"))
    gw = await gateway_in_process(config(sim.url, "{rpm: 2}"))
    rows = usage_rows(gw)
    answers = [await chat(gw, LIMITED, max_tokens=8) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429], answers[-1].text
    first, second, refused = answers
    assert ratelimit_headers(first)["x-ratelimit-limit-requests"] == "2"
    assert [ratelimit_headers(a)["x-ratelimit-remaining-requests"] for a in (first, second)] == ["1", "0"]
    assert re.fullmatch(r"\d+(ms|(\.\d+)?s)", ratelimit_headers(first)["x-ratelimit-reset-requests"])
    error = refused.json()["error"]
    assert error["type"] == error["code"] == "rate_limit_exceeded" and "2 requests per minute" in error["message"]
    assert refused.headers["content-type"] == "application/json"
    assert int(refused.headers["retry-after"]) >= 1  # whole seconds, rounded up
    assert ratelimit_headers(refused)["x-ratelimit-remaining-requests"] == "0"
    assert "x-request-id" in refused.headers
    # A 429 is counted against its key; the two answers reached the usage sink with the engine's usage.
    answered = [counts for row, counts in rows if row.key_name == "limited" and counts["answers_2xx"]]
    assert len(answered) == 2 and all(c["output_tokens"] == 4 and c["input_tokens"] > 0 for c in answered)
    assert sum(c["refused_rate"] for row, c in rows if row.key_name == "limited") == 1

    # A key without limits: answered as before, no x-ratelimit headers, never refused.
    opened = [await chat(gw, OPEN, max_tokens=8) for _ in range(3)]
    assert [a.status_code for a in opened] == [200] * 3 and not any(ratelimit_headers(a) for a in opened)
    assert await gw.metric("llmgw_tenant_settled_total", 'basis="usage"') == 5  # its usage is recorded too
    # A model the key may not use: the directory's 403, before any limit is looked at.
    narrow = await chat(gw, NARROW)
    assert narrow.status_code == 403 and narrow.json()["error"]["code"] == "model_not_allowed"
    assert not ratelimit_headers(narrow)
    # A model that does not exist is answered 404 before any limit is looked at.
    assert (await chat(gw, LIMITED, model="nope")).status_code == 404


async def test_tpm_reserves_the_estimate_and_settles_with_the_engine_usage(gateway_in_process, nursery):
    """The reservation of a request in flight holds the key's tokens; its answer's usage gives back the rest, so
    a request that could not be admitted beside it is admitted once it settled."""
    [sim] = await start_sims(nursery, 1, num_blocks=256,
                             extra=("--output-tokens", "6:6", "--decode-ms-per-step", "150"))
    gw = await gateway_in_process(config(sim.url, "{tpm: 1500}"))
    rows = usage_rows(gw)
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 1000}).encode()
    estimate = len(body) + 1000  # the body's bytes (the prompt's bound) and max_tokens

    async def post() -> httpx.Response:
        return await gw.http.post(gw.url + "/v1/chat/completions", content=body,
                                  headers={**auth(LIMITED), "content-type": "application/json"})

    answers: list[httpx.Response] = []
    async with trio.open_nursery() as both:
        async def first() -> None:
            answers.append(await post())

        both.start_soon(first)
        await wait_for(lambda: in_flight(gw))  # admitted and sent: the engine is decoding it
        beside = await post()  # while the first is decoding: its reservation leaves 1500 - estimate
        assert beside.status_code == 429, beside.text
        assert beside.json()["error"]["type"] == "rate_limit_exceeded" and "tokens per minute" in beside.text
        assert int(ratelimit_headers(beside)["x-ratelimit-remaining-tokens"]) < estimate
    [first_answer] = answers
    assert first_answer.status_code == 200
    used = first_answer.json()["usage"]
    assert used["completion_tokens"] == 6 and 0 < used["prompt_tokens"] < len(body)
    after = await post()  # settled: the unused part of the first reservation came back
    assert after.status_code == 200, after.text
    remaining = int(ratelimit_headers(after)["x-ratelimit-remaining-tokens"])
    # What this one reserved and what the first used are out; a few seconds' refill (25 tokens/s) came in.
    floor = 1500 - estimate - used["total_tokens"]
    assert floor <= remaining <= floor + 25 * 10, (remaining, floor)
    charged = [c for row, c in rows if row.key_name == "limited" and c["answers_2xx"]]
    assert [c["input_tokens"] + c["output_tokens"] for c in charged] == [used["total_tokens"]] + [
        after.json()["usage"]["total_tokens"]]


def normalized(stream: bytes) -> bytes:
    """A stream's bytes without what differs between two requests (the completion's id, its creation time)."""
    return re.sub(rb'"created":\d+', b'"created":0', re.sub(rb'"id":"[^"]*"', b'"id":""', stream))


async def raw_stream(http: httpx.AsyncClient, url: str, body: dict, key: str | None = None) -> bytes:
    headers = auth(key) if key is not None else {}
    async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        return b"".join([piece async for piece in response.aiter_raw()])


async def test_a_stream_usage_is_asked_for_settled_and_stripped_unless_the_client_asked(gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=256, extra=("--output-tokens", "7:7"))
    gw = await gateway_in_process(config(sim.url, "{tpm: 100000}"))
    rows = usage_rows(gw)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 50, "stream": True, "seed": 3}
    direct = await raw_stream(gw.http, sim.url, body)
    assert b'"usage"' not in direct
    relayed = await raw_stream(gw.http, gw.url, body, LIMITED)
    assert normalized(relayed) == normalized(direct)  # the client reads what the engine alone would have sent
    [(row, counts)] = [(row, c) for row, c in rows if row.key_name == "limited"]
    assert counts["output_tokens"] == 7 and counts["input_tokens"] > 0 and counts["answers_2xx"] == 1

    asked = {**body, "stream_options": {"include_usage": True}}
    direct = await raw_stream(gw.http, sim.url, asked)
    relayed = await raw_stream(gw.http, gw.url, asked, LIMITED)
    assert normalized(relayed) == normalized(direct) and relayed.count(b'"usage"') == 1  # relayed untouched
    usage = json.loads(relayed.split(b"\n\n")[-3].removeprefix(b"data: "))["usage"]
    assert rows[-1][1]["output_tokens"] == usage["completion_tokens"] == 7
    assert rows[-1][1]["input_tokens"] == usage["prompt_tokens"]


async def test_a_broken_stream_and_an_engine_without_usage_settle_what_was_sent(gateway_in_process,
                                                                                 start_fake_upstream):
    """The fake upstream never sends usage: a stream is charged the estimate's prompt and the tokens relayed;
    one broken off after three events is charged those three; the concurrency slot comes back each time."""
    upstream = await start_fake_upstream("a")
    gw = await gateway_in_process(config(upstream.url, "{concurrency: 1}"))
    rows = usage_rows(gw)
    body = {"model": "tiny", "messages": MESSAGES, "stream": True, "x_chunks": 5}
    whole = await raw_stream(gw.http, gw.url, body, LIMITED)
    assert whole.count(b"data: ") == 6 and whole.endswith(b"data: [DONE]\n\n")
    broken = await raw_stream(gw.http, gw.url, {**body, "x_break_after": 3}, LIMITED)
    assert broken.count(b'"content"') == 3 and b"broke off this answer" in broken
    charged = [c for row, c in rows if row.key_name == "limited"]
    assert [c["output_tokens"] for c in charged] == [5, 3]
    sent = len(json.dumps({**body, "x_break_after": 3}, separators=(",", ":")).encode())  # as httpx sends it
    assert charged[1]["input_tokens"] == sent  # the estimate's prompt: the client's body, in bytes
    assert all(c["answers_2xx"] == 1 for c in charged)
    assert (await chat(gw, LIMITED)).status_code == 200  # the slot of each came back
    assert await gw.metric("llmgw_tenant_settled_total", 'basis="sent"') == 2
    assert await gw.metric("llmgw_tenant_settled_total", 'basis="usage"') == 1  # the last one's body had usage


async def test_a_client_that_goes_away_settles_and_frees_its_slot(gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=256,
                             extra=("--output-tokens", "400:400", "--decode-ms-per-step", "20"))
    gw = await gateway_in_process(config(sim.url, "{concurrency: 1}"))
    rows = usage_rows(gw)
    body = {"model": "tiny", "messages": MESSAGES, "stream": True, "max_tokens": 400}
    async with gw.http.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=auth(LIMITED)) as stream:
        assert stream.status_code == 200 and ratelimit_headers(stream) == {}  # concurrency has no header
        events = 0
        async for line in stream.aiter_lines():
            events += line.startswith("data: ")
            if events == 1:
                busy = await chat(gw, LIMITED)  # the one slot is this stream's
                assert busy.status_code == 429 and "1 concurrent requests" in busy.json()["error"]["message"]
            if events == 5:
                break
    await wait_for(lambda: gone(rows))
    [counts] = [c for row, c in rows if row.key_name == "limited" and not c["refused_rate"]]
    assert counts["answers_4xx"] == 1  # 499
    # What was relayed before the client left (its first event is the role, no token), not max_tokens.
    assert 4 <= counts["output_tokens"] < 400
    assert (await chat(gw, LIMITED, max_tokens=4)).status_code == 200  # its slot came back


async def gone(rows) -> bool:
    return any(row.key_name == "limited" and c["answers_4xx"] for row, c in rows)


async def test_an_answer_made_here_for_a_limited_key_carries_the_headers(gateway_in_process, nursery):
    """No replica could take it (the engine is gone): a 502/503 made by the gateway, with the key's headers, and
    its reservation given back (nothing reached an engine, nothing recorded as usage)."""
    [sim] = await start_sims(nursery, 1, num_blocks=256, extra=("--output-tokens", "4:4"))
    gw = await gateway_in_process(config(sim.url, "{rpm: 100, tpm: 100000}"))
    rows = usage_rows(gw)
    assert (await chat(gw, LIMITED, max_tokens=4)).status_code == 200
    sim.kill(signal.SIGKILL)
    await sim.wait_exit()
    failed = await chat(gw, LIMITED, max_tokens=4)
    assert failed.status_code in (502, 503), failed.text
    headers = ratelimit_headers(failed)
    assert headers["x-ratelimit-limit-requests"] == "100" and headers["x-ratelimit-limit-tokens"] == "100000"
    assert len([row for row, c in rows if row.key_name == "limited"]) == 1  # the first answer only
    assert await gw.metric("llmgw_tenant_settled_total", 'basis="nothing"') == 1
    tokens_left = int(headers["x-ratelimit-remaining-tokens"])
    again = await chat(gw, LIMITED, max_tokens=4)
    # The failed one's reservation came back: the next one's remaining tokens are not lower by it.
    assert int(ratelimit_headers(again)["x-ratelimit-remaining-tokens"]) >= tokens_left


async def test_a_key_rpm_holds_across_two_gateways_sharing_redis(start_llmgw, nursery, redis_url, cluster_name):
    """Two gateways of one cluster (the Redis limiter's leased shares): a burst spread over both admits the key's
    rpm once, not once per gateway; each refusal is the 429 with its headers."""
    [sim] = await start_sims(nursery, 1, num_blocks=256, extra=("--output-tokens", "2:2"))
    text = (gateway_config([sim.url], routing="round_robin") + state_section(redis_url, cluster_name)
            + f"api_keys:\n  - key: {LIMITED}\n    name: limited\n    limits: {{rpm: 10}}\n")
    control = await start_llmgw(text)
    follower = await start_llmgw(text, "--role", "gateway")
    for gateway in (control, follower):
        await wait_replicas(gateway.control_url, 1)
    statuses: list[int] = []
    refusals: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=30) as http:

        async def one(url: str) -> None:
            answer = await http.post(url + "/v1/chat/completions", headers=auth(LIMITED),
                                     json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                refusals.append(answer)

        started = trio.current_time()
        async with trio.open_nursery() as burst:
            for i in range(30):
                burst.start_soon(one, (control, follower)[i % 2].url)
        elapsed = trio.current_time() - started
    admitted = statuses.count(200)
    assert statuses.count(429) == 30 - admitted, statuses
    # The bucket refills at rpm/60 per second: what the burst's own duration added may be admitted too.
    assert 1 <= admitted <= 10 + int(elapsed * 10 / 60) + 1, (admitted, elapsed)
    assert all(r.json()["error"]["type"] == "rate_limit_exceeded" and "retry-after" in r.headers
               and r.headers["x-ratelimit-limit-requests"] == "10" for r in refusals)


async def test_a_money_budget_holds_its_requests_across_two_gateways(start_llmgw, nursery, redis_url, cluster_name):
    """A total budget of 20 requests' cost, 40 requests at once over two gateways of one cluster: exactly 20 are
    admitted (the budget's rest is never held back in one gateway's share while the other refuses its requests
    as spent), and every refusal says the budget is spent. Only output is priced and the engine answers
    max_tokens, so a request's reservation is its cost."""
    [sim] = await start_sims(nursery, 1, num_blocks=256, extra=("--output-tokens", "2:2"))
    text = (gateway_config([sim.url], routing="round_robin") + state_section(redis_url, cluster_name)
            + f"api_keys:\n  - key: {LIMITED}\n    name: limited\n    budgets: [{{period: total, usd: 0.04}}]\n"
            + "prices:\n  - model: tiny\n    input: 0\n    output: 1000\n")  # 2 tokens: 0.002 USD
    control = await start_llmgw(text)
    follower = await start_llmgw(text, "--role", "gateway")
    for gateway in (control, follower):
        await wait_replicas(gateway.control_url, 1)
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=30) as http:

        async def one(url: str) -> None:
            answers.append(await http.post(url + "/v1/chat/completions", headers=auth(LIMITED),
                                           json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}))

        async with trio.open_nursery() as burst:
            for i in range(40):
                burst.start_soon(one, (control, follower)[i % 2].url)
    statuses = [answer.status_code for answer in answers]
    assert statuses.count(200) == 20, statuses
    refusals = [answer.json()["error"] for answer in answers if answer.status_code == 429]
    assert len(refusals) == 20 and all(error["type"] == "insufficient_quota" and "has spent its total budget"
                                       in error["message"] for error in refusals), refusals


async def test_a_reload_swaps_the_estimate_settings_and_prices(gateway_in_process, nursery):
    """``tenancy.default_max_tokens`` and the prices apply from the next request after a reload: a request without
    max_tokens that could never fit the key's tpm fits once the default is lowered, and is charged the new price."""
    [sim] = await start_sims(nursery, 1, num_blocks=256, extra=("--output-tokens", "3:3"))
    text = config(sim.url, "{tpm: 2000}") + "tenancy:\n  default_max_tokens: 5000\n"
    gw = await gateway_in_process(text)
    rows = usage_rows(gw)
    refused = await chat(gw, LIMITED)
    assert refused.status_code == 429 and "can never be admitted" in refused.json()["error"]["message"]
    path = gw.gateway.config.source
    with open(path, "w") as file:
        file.write(text.replace("default_max_tokens: 5000", "default_max_tokens: 100")
                   + "prices:\n  - model: tiny\n    input: 1\n    output: 2\n")
    assert (await gw.admin("/admin/reload", "POST")).json()["reloaded"] is True
    answer = await chat(gw, LIMITED)
    assert answer.status_code == 200, answer.text
    used = answer.json()["usage"]
    [charged] = [c for row, c in rows if row.key_name == "limited" and c["answers_2xx"]]
    # USD 1 and 2 per million tokens: 1,000 and 2,000 nano-dollars per token.
    assert charged["nano_usd"] == used["prompt_tokens"] * 1000 + used["completion_tokens"] * 2000


async def test_without_keys_nothing_is_charged_or_rewritten(gateway_in_process, nursery):
    """No API key configured: no tenant, so nothing is charged or recorded, no x-ratelimit header is added, and a
    stream reads as the engine sent it, with or without the usage chunk the client asked for."""
    [sim] = await start_sims(nursery, 1, num_blocks=256, extra=("--output-tokens", "5:5"))
    gw = await gateway_in_process(f"models:\n  - name: tiny\n    replicas:\n      - url: {sim.url}\n        name: a\n")
    rows = usage_rows(gw)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 20, "stream": True, "seed": 1}
    direct = await raw_stream(gw.http, sim.url, body)
    assert normalized(await raw_stream(gw.http, gw.url, body)) == normalized(direct)
    asked = {**body, "stream_options": {"include_usage": True}}
    assert normalized(await raw_stream(gw.http, gw.url, asked)) == normalized(await raw_stream(gw.http, sim.url,
                                                                                                asked))
    answer = await gw.chat(max_tokens=4)
    assert answer.status_code == 200 and not ratelimit_headers(answer)
    assert rows == []
    for basis in ("usage", "sent", "nothing"):
        assert await gw.metric("llmgw_tenant_settled_total", f'basis="{basis}"') == 0
