"""``/health`` tells the truth about a cluster: ``degraded`` at its top level, with each reason and since when,
while Redis is away or no leader exists, ``ok`` again after; 200 throughout (liveness); one log line per
transition, not per poll. Real processes: a simulator, a candidate ``llmgw serve``, a ``--role gateway`` follower
and a redis-server of the test's own, stopped and started again."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from llmgw.testing.metrics import scrape_value
from llmgw.testing.shared_state import cluster_config, wait_replicas
from llmgw.testing.sims import start_sims

pytestmark = pytest.mark.slow


async def health(http: httpx.AsyncClient, process) -> dict:
    answer = await http.get(process.control_url + "/health")
    assert answer.status_code == 200, answer.text  # liveness, degraded or not
    return answer.json()


async def wait_status(http: httpx.AsyncClient, processes, status: str, codes: set[str] | None = None,
                      timeout: float = 20.0) -> None:
    """Until every process's ``/health`` says ``status`` (and, when given, holds each reason of ``codes``)."""
    with trio.fail_after(timeout):
        while True:
            answers = [await health(http, process) for process in processes]
            if all(a["status"] == status and (codes is None or codes <= {r["code"] for r in a["reasons"]})
                   for a in answers):
                return
            await trio.sleep(0.1)


def transitions(process, start: int) -> list[str]:
    """The health lines from line ``start`` on, as ``LEVEL llmgw.gateway.health_report: message`` (a JSON
    line read back into that shape)."""
    lines = [json_as_text(line) for line in process.lines[start:]]
    return [line for line in lines if "llmgw.gateway.health_report: health:" in line]


def json_as_text(line: str) -> str:
    if not line.startswith("{"):
        return line
    entry = json.loads(line)
    return f"{entry['ts']} {entry['level'].upper()} {entry['logger']}: {entry['message']}"


async def test_a_cluster_whose_redis_is_stopped_is_degraded_with_the_reason_then_ok(nursery, start_llmgw,
                                                                                     private_redis, cluster_name):
    (sim,) = await start_sims(nursery, 1, num_blocks=256, block_size=16)
    config = cluster_config([sim], private_redis.url, cluster_name, routing="round_robin")
    control = await start_llmgw(config, "--log-level", "info", "--log-format", "json")
    follower = await start_llmgw(config, "--role", "gateway", "--log-level", "info")
    gateways = (control, follower)
    async with httpx.AsyncClient(timeout=30) as http:
        for gateway in gateways:
            await wait_replicas(gateway.control_url, 1)
        await wait_status(http, gateways, "ok")
        ok = await health(http, follower)
        assert ok["reasons"] == [] and ok["state"]["leader"]["holder"] is not None, ok
        marks = [len(gateway.lines) for gateway in gateways]
        # Under --log-format json the election's lines carry the term and the leader as keys of their own.
        entries = [json.loads(line) for line in control.lines if line.startswith("{")]
        took = next(e for e in entries if "took the lease" in e["message"])
        assert took["term"] == ok["state"]["leader"]["holder"]["generation"], took
        assert took["leader"] == ok["state"]["leader"]["holder"]["origin"], took

        await private_redis.kill()
        await wait_status(http, gateways, "degraded", {"redis_unreachable", "no_leader"})
        for gateway in gateways:
            answer = await health(http, gateway)
            redis = next(r for r in answer["reasons"] if r["code"] == "redis_unreachable")
            assert f"Redis at redis://127.0.0.1:{private_redis.port}/0 is unreachable" in redis["message"], redis
            assert redis["since"].endswith("Z") and answer["state"]["degraded"] is True
            assert await scrape_value(gateway.control_url, "llmgw_health_degraded", 'reason="redis_unreachable"',
                                      client=http) == 1
        # /ready says why too: on the control port in full, on the data port (clients) without Redis's address.
        not_ready = await http.get(follower.control_url + "/ready?model=nope")
        assert any("Redis at redis://" in reason for reason in not_ready.json()["reasons"]), not_ready.text
        not_ready = await http.get(follower.url + "/ready?model=nope")
        assert "the cluster's shared state is degraded: Redis is unreachable (since " in not_ready.text, not_ready.text
        assert str(private_redis.port) not in not_ready.text
        for _ in range(20):  # polls are not transitions
            await health(http, follower)
        # Routing goes on with the last known state meanwhile.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await http.post(follower.url + "/v1/chat/completions", json=chat)).status_code == 200

        await private_redis.restart()
        await wait_status(http, gateways, "ok")
        for gateway, mark in zip(gateways, marks):
            lines = transitions(gateway, mark)
            assert len(lines) >= 2 and "WARNING" in lines[0] and "health: degraded: " in lines[0], lines
            assert "Redis at" in lines[0] or "no leader" in lines[0], lines
            assert "health: ok again after" in lines[-1] and sum("ok again" in line for line in lines) == 1, lines
            assert sum("health: degraded: " in line for line in lines) == 1, lines
            # Between them only changes of the reasons (Redis, then no leader, then not loaded...), never a line
            # per poll: no line says what the one before it said.
            said = [line.split(" health: ", 1)[1] for line in lines]
            assert all(a.removeprefix("still degraded, now") != b.removeprefix("still degraded, now")
                       for a, b in zip(said, said[1:])), lines
            assert len(lines) <= 6, lines
            assert await scrape_value(gateway.control_url, "llmgw_health_degraded", 'reason="redis_unreachable"',
                                      client=http) == 0
