"""``GET /ready`` for load balancers and orchestrators, on the data port and the control port: 503 with the reasons
(models without a routable replica, unknown models, draining, a ``--role gateway`` process without the shared
state) until every model (or every one the query names) can be routed; ``/health`` stays liveness."""

from __future__ import annotations

import httpx
import trio

from helpers import wait_for
from llmgw.testing.processes import free_port


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
        assert body["reasons"] == ["no routable replica (every replica down, draining or not placed yet) for "
                                   "'late'"]
        assert body["draining"] is False and body["state_loaded"] is True and body["unknown_models"] == []
        assert (await http.get(base + "/health")).status_code == 200  # liveness is not readiness
    # Asked about the models it serves, it is ready; about a model it does not know, it is not.
    assert (await ready(http, gw.url, "?model=tiny"))[0] == 200
    status, body = await ready(http, gw.control_url, "?model=tiny&model=nope")
    assert status == 503 and body["unknown_models"] == ["nope"] and body["reasons"] == ["not known here: 'nope'"]
    bad = await http.get(gw.url + "/ready?verbose=1")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_parameter"

    await start_fake_upstream("late", port=port)

    async def all_ready() -> bool:
        return (await ready(http, gw.url))[0] == 200

    await wait_for(all_ready)
    for base in (gw.url, gw.control_url):
        assert await ready(http, base) == (200, {"ready": True, "models": 2, "draining": False, "state_loaded": True,
                                                 "reasons": [], "models_without_replica": [], "unknown_models": []})


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
    assert body["reasons"] == ["the gateway is draining (it was asked to stop): it takes no new requests"]


async def test_a_gateway_role_process_is_not_ready_before_the_shared_state(gateway_in_process, redis_url,
                                                                         cluster_name):
    """No control process publishes this cluster: the follower never loads it."""
    gw = await gateway_in_process(f"state:\n  backend: redis\n  url: {redis_url}\n  cluster: {cluster_name}\n",
                                  role="gateway")
    status, body = await ready(gw.http, gw.url)
    assert status == 503 and body["state_loaded"] is False and body["models"] == 0, body
    assert body["reasons"][:2] == ["this process follows the cluster's shared state and has not loaded it yet: it "
                                   "knows no deployed model", "no models are configured or known yet"], body


async def test_with_api_keys_ready_names_models_only_to_a_key_holder_on_the_data_port(gateway_in_process,
                                                                                     start_fake_upstream):
    up = await start_fake_upstream("up")
    gw = await gateway_in_process(f"""
models:
  - name: tiny
    replicas:
      - url: {up.url}
  - name: secret-model
    replicas:
      - url: http://127.0.0.1:{free_port()}
health:
  interval: 0.1s
  failures_to_down: 1
api_keys:
  - key: sk-ready-0123456789
""")
    http = gw.http
    key = {"Authorization": "Bearer sk-ready-0123456789"}

    async def secret_is_down() -> bool:
        return (await http.get(gw.url + "/ready", headers=key)).json()["models_without_replica"] == ["secret-model"]

    await wait_for(secret_is_down)
    # Whether a model exists is not told without a key: ?model= is a 401, as /v1 is.
    for query in ("?model=tiny", "?model=nope", "?model=secret-model"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = await http.get(gw.url + "/ready" + query, headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", answer.text
    assert (await http.get(gw.url + "/ready?model=tiny", headers=key)).status_code == 200
    named = await http.get(gw.url + "/ready?model=nope", headers=key)
    assert named.status_code == 503 and named.json()["unknown_models"] == ["nope"]
    # A bare /ready stays open for load balancers, with the same status and no name in it.
    anonymous = await http.get(gw.url + "/ready")
    assert anonymous.status_code == 503 and "secret-model" not in anonymous.text, anonymous.text
    assert anonymous.json()["models_without_replica_count"] == 1 and "models_without_replica" not in anonymous.json()
    assert anonymous.json()["reasons"] == ["no routable replica (every replica down, draining or not placed yet) "
                                           "for 1 model"]
    # The control port is the operators': it answers as before.
    assert (await http.get(gw.control_url + "/ready?model=nope")).json()["unknown_models"] == ["nope"]
