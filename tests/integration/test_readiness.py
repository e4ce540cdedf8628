"""``GET /ready`` for load balancers and orchestrators, on the data port and the control port: 503 with the reasons
(models without a routable replica, unknown models, draining, a ``--role gateway`` process without the shared
state) until every model (or every one the query names) can be routed; ``/health`` stays liveness."""

from __future__ import annotations

import httpx
import trio

from helpers import wait_for
from llmgw.testing.processes import free_port
from llmgw.testing.shared_state import state_section


async def ready(http: httpx.AsyncClient, base: str, query: str = "") -> tuple[int, dict]:
    answer = await http.get(base + "/ready" + query)
    return answer.status_code, answer.json()


async def test_ready_waits_for_a_routable_replica_of_every_model(gateway_in_process, start_fake_upstream):
    up = await start_fake_upstream("up")
    port = free_port()
    gw = await gateway_in_process(f"""
models:
  - name: tiny
    replicas:
      - url: {up.url}
  - name: late
    replicas:
      - url: http://127.0.0.1:{port}
health:
  interval: 0.1s
  failures_to_down: 1
""")
    http = gw.http

    async def late_is_down() -> bool:
        return (await ready(http, gw.url))[1]["models_without_replica"] == ["late"]

    await wait_for(late_is_down)
    for base in (gw.url, gw.control_url):
        status, body = await ready(http, base)
        assert status == 503 and body["ready"] is False and body["models_without_replica"] == ["late"], body
        assert body["draining"] is False and body["state_loaded"] is True and body["unknown_models"] == []
        assert (await http.get(base + "/health")).status_code == 200  # liveness is not readiness
    # Asked about the models it serves, it is ready; about a model it does not know, it is not.
    assert (await ready(http, gw.url, "?model=tiny"))[0] == 200
    status, body = await ready(http, gw.control_url, "?model=tiny&model=nope")
    assert status == 503 and body["unknown_models"] == ["nope"]
    bad = await http.get(gw.url + "/ready?verbose=1")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_parameter"

    await start_fake_upstream("late", port=port)

    async def all_ready() -> bool:
        return (await ready(http, gw.url))[0] == 200

    await wait_for(all_ready)
    for base in (gw.url, gw.control_url):
        assert await ready(http, base) == (200, {"ready": True, "models": 2, "draining": False, "state_loaded": True,
                                                 "models_without_replica": [], "unknown_models": []})


async def test_a_draining_gateway_is_not_ready(gateway_in_process, start_fake_upstream, nursery):
    upstream = await start_fake_upstream("a")
    gw = await gateway_in_process(f"models:\n  - name: tiny\n    replicas:\n      - url: {upstream.url}\n")
    assert (await ready(gw.http, gw.control_url))[0] == 200
    in_flight = trio.Event()

    async def slow_request() -> None:
        in_flight.set()
        await gw.chat(x_delay_ms=2000)

    nursery.start_soon(slow_request)
    await in_flight.wait()
    await trio.sleep(0.2)
    nursery.start_soon(gw.gateway.shutdown, 10.0)
    await trio.sleep(0.2)
    status, body = await ready(gw.http, gw.control_url)
    assert status == 503 and body["draining"] is True and body["models_without_replica"] == [], body


async def test_a_gateway_role_process_is_not_ready_before_the_shared_state(gateway_in_process, redis_url,
                                                                         cluster_name):
    """No control process publishes this cluster: the follower never loads it."""
    gw = await gateway_in_process(state_section(redis_url, cluster_name),
                                  role="gateway")
    status, body = await ready(gw.http, gw.url)
    assert status == 503 and body["state_loaded"] is False and body["models"] == 0, body
