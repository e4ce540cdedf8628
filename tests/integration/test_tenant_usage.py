"""Usage of real requests through a gateway reaches the usage store, ``GET /admin/usage``, ``llmgw usage`` and the
``llmgw_tenant_*`` counters; none of it is lost through a gateway's kill -9 or a Redis restart (AOF on)."""

from __future__ import annotations

import csv
import io
import signal
import subprocess
import sys

import httpx
import pytest
import trio

from helpers import wait_for
from llmgw.tenancy.model import Price
from llmgw.testing.metrics import scrape_value
from llmgw.testing.redis import PrivateRedis
from llmgw.testing.shared_state import state_section

ALICE, BOB = "sk-alice-0000000001", "sk-bob-00000000000002"
PROMPT, COMPLETION = 5, 3  # what the fake upstream's usage says of every chat answer
PRICE = Price(input=2_000, cached_input=1_000, output=8_000)  # nano-dollars per token: 2, 1, 8 USD per million
COST = PROMPT * PRICE.input + COMPLETION * PRICE.output


def config(upstream_url: str, extra: str = "", flush: str = "100ms") -> str:
    return (f"models:\n  - name: tiny\n    replicas:\n      - url: {upstream_url}\n"
            "teams:\n  - name: search\n"
            f"api_keys:\n  - key: {ALICE}\n    name: alice\n    team: search\n"
            f"  - key: {BOB}\n    name: bob\n    limits:\n      rpm: 2\n"
            "prices:\n  - model: tiny\n    input: 2\n    cached_input: 1\n    output: 8\n"
            f"tenancy:\n  usage_flush_interval: {flush}\n" + extra)


async def chat(http: httpx.AsyncClient, url: str, key: str) -> int:
    answer = await http.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    return answer.status_code


async def usage(http: httpx.AsyncClient, control_url: str, **params: str) -> dict:
    answer = await http.get(control_url + "/admin/usage", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def by_key(answer: dict) -> dict[str, dict]:
    return {item["key_name"]: item for item in answer["data"]}


async def requests_of(http: httpx.AsyncClient, control_url: str, key: str) -> int:
    return by_key(await usage(http, control_url, group_by="key")).get(key, {}).get("requests", 0)


async def test_usage_of_real_requests_reaches_the_api_the_cli_and_the_counters(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(config(upstream.url))
    async with httpx.AsyncClient(timeout=10) as http:
        assert [await chat(http, gw.url, ALICE) for _ in range(5)] == [200] * 5
        assert [await chat(http, gw.url, BOB) for _ in range(3)] == [200, 200, 429]

        async def counted() -> bool:
            keys = by_key(await usage(http, gw.control_url, group_by="key"))
            return keys.get("alice", {}).get("requests") == 5 and keys.get("bob", {}).get("refused_rate") == 1

        await wait_for(counted)
        keys = by_key(await usage(http, gw.control_url, group_by="key"))
        alice, bob = keys["alice"], keys["bob"]
        assert alice["key_id"] == "cfg-alice"
        assert (alice["input_tokens"], alice["output_tokens"], alice["nano_usd"]) == (25, 15, 5 * COST)
        assert alice["usd"] == pytest.approx(5 * COST / 1e9)
        assert (bob["requests"], bob["answers_2xx"], bob["refused_rate"]) == (2, 2, 1)

        teams = {item["team"]: item for item in (await usage(http, gw.control_url, group_by="team,model"))["data"]}
        assert teams["search"]["requests"] == 5 and teams[""]["requests"] == 2

        answer = await http.get(gw.control_url + "/admin/usage", params={"group_by": "key", "format": "csv"})
        assert answer.headers["content-type"].startswith("text/csv")
        lines = list(csv.DictReader(io.StringIO(answer.text)))
        assert {line["key_name"]: line["requests"] for line in lines} == {"alice": "5", "bob": "2"}

        wrong = await http.get(gw.control_url + "/admin/usage", params={"group_by": "user"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "group_by"

        assert await scrape_value(gw.control_url, "llmgw_tenant_requests_total",
                                  'team="search",model="tiny",code="2xx"') == 5
        assert await scrape_value(gw.control_url, "llmgw_tenant_tokens_total",
                                  'team="none",model="tiny",kind="output"') == 6
        assert await scrape_value(gw.control_url, "llmgw_tenant_spend_usd_total",
                                  'team="search",model="tiny"') == pytest.approx(5 * COST / 1e9)
        assert await scrape_value(gw.control_url, "llmgw_tenant_refused_total",
                                  'team="none",reason="rate_limit_exceeded"') == 1

    table = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "llmgw", "usage", "--control", gw.control_url, "--group-by", "key"],
        capture_output=True, text=True, timeout=60))
    assert table.returncode == 0, table.stderr
    alice_line = next(line for line in table.stdout.splitlines() if line.startswith("cfg-alice"))
    assert alice_line.split()[:7] == ["cfg-alice", "alice", "5", "25", "0", "15", f"{5 * COST / 1e9:.6f}"]
    as_csv = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "llmgw", "usage", "--control", gw.control_url, "--group-by", "team", "--csv"],
        capture_output=True, text=True, timeout=60))
    assert as_csv.returncode == 0, as_csv.stderr
    assert {line["team"]: line["requests"] for line in csv.DictReader(io.StringIO(as_csv.stdout))} == \
        {"search": "5", "": "2"}


async def load(http: httpx.AsyncClient, url: str, completed: list[int], workers: int = 8) -> None:
    """Requests as ``alice`` from ``workers`` clients until cancelled (or the gateway is gone); each 200 that
    arrived whole is counted in ``completed``."""

    async def client() -> None:
        while True:
            try:
                status = await chat(http, url, ALICE)
            except httpx.HTTPError:
                return
            if status == 200:
                completed[0] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(client)


@pytest.mark.parametrize("backend", ["local", "redis"])
async def test_a_gateway_killed_mid_load_loses_no_completed_answer_usage(start_fake_upstream, start_llmgw, backend,
                                                                         redis_url, cluster_name):
    upstream = await start_fake_upstream("a")
    state = state_section(redis_url, cluster_name) if backend == "redis" else ""
    text = config(upstream.url, state, flush="60s")  # nothing flushed before the kill: all from the journal
    gw = await start_llmgw(text)
    completed = [0]
    async with httpx.AsyncClient(timeout=10) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, http, gw.url, completed)
            await wait_for(lambda: _true(completed[0] >= 100), timeout=60)
            gw.kill(signal.SIGKILL)
        await gw.wait_exit()
        assert completed[0] >= 100
        again = await start_llmgw(text)
        await wait_for(lambda: requests_of(http, again.control_url, "alice"))
        stored = await requests_of(http, again.control_url, "alice")
        assert completed[0] <= stored <= completed[0] + 8  # every answer a client got whole; at most those in flight
        assert any("usage journal: shipped" in line for line in again.lines)


async def test_usage_survives_a_redis_restart_with_aof_and_an_outage_in_between(nursery, start_fake_upstream,
                                                                               start_llmgw, tmp_path, cluster_name):
    redis = PrivateRedis(nursery, tmp_path / "redis", extra=("--appendonly", "yes"))
    await redis.start()
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(config(upstream.url, state_section(redis.url, cluster_name)))
    async with httpx.AsyncClient(timeout=10) as http:
        assert [await chat(http, gw.url, ALICE) for _ in range(6)] == [200] * 6
        await wait_for(lambda: _equals(requests_of(http, gw.control_url, "alice"), 6))
        await redis.kill()  # SIGKILL: what the AOF holds is all that comes back
        assert [await chat(http, gw.url, ALICE) for _ in range(4)] == [200] * 4  # usage waits while Redis is away
        await redis.start(redis.port)
        await wait_for(lambda: _equals(requests_of(http, gw.control_url, "alice"), 10), timeout=30)
        await trio.sleep(1)  # a repeated flush would show now
        assert await requests_of(http, gw.control_url, "alice") == 10


async def _equals(value, expected) -> bool:
    try:
        return await value == expected
    except AssertionError:  # the store does not answer yet (Redis restarting): a 503
        return False


async def _true(value: bool) -> bool:
    return value
