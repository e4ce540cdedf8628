"""The hooks a routing tier hears, in order, from the data plane: one attempt per replica tried.

An in-process data plane and router (real sockets): a replica nobody listens on, a fake upstream answering
503 and one answering 200. ``routed`` comes with the request already counted in the replica's load;
``attempt_failed`` for each attempt that failed before its answer, then ``finished`` exactly once per attempt;
``first_token`` between them for a stream.
"""

from __future__ import annotations

import json

from llmgw.gateway.dataplane import DataPlane, DataPlaneSettings
from llmgw.http.messages import Request
from llmgw.metrics import Metrics
from llmgw.plugin import Decision, RoutingTier, hookimpl
from llmgw.router.health import HealthSettings, HealthTracker
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.testing.plugins import registry_with
from llmgw.testing.processes import free_port


class Recording(RoutingTier):
    """Picks the first candidate named in the body's ``order``; records every hook."""

    name = "recording"
    wants_usage = True
    events: list[tuple] = []

    def __init__(self, model, services):
        pass

    async def pick(self, request, candidates):
        by_name = {r.name: r for r in candidates}
        return Decision(next(by_name[n] for n in request.body["order"] if n in by_name), tier=self.name)

    def routed(self, request, decision):
        r = decision.replica
        self.events.append(("routed", r.name, r.inflight, r.inflight_tokens == decision.inflight_tokens > 0))

    def first_token(self, request, decision, ttft):
        self.events.append(("first_token", decision.replica.name))

    def attempt_failed(self, request, decision, reason):
        self.events.append(("attempt_failed", decision.replica.name, reason))

    def finished(self, request, decision, usage):
        self.events.append(("finished", decision.replica.name, usage is not None))


class RecordingPlugin:
    @hookimpl
    def register_routing_tiers(self):
        return {"recording": Recording}


async def data_plane(start_fake_upstream) -> tuple[DataPlane, list[Replica]]:
    metrics = Metrics()
    router = Router(registry_with(RecordingPlugin()), metrics)
    router.configure_model("tiny", "recording")
    unwell = await start_fake_upstream("unwell", status=503)
    ok = await start_fake_upstream("ok", chunks=3)
    replicas = [Replica(name="dead", model="tiny", url=f"http://127.0.0.1:{free_port()}"),
                Replica(name="unwell", model="tiny", url=unwell.url), Replica(name="ok", model="tiny", url=ok.url)]
    for replica in replicas:
        replica.pool = replica.open_pool(3.0)
        router.add_replica(replica)
    return DataPlane(router, HealthTracker(HealthSettings(), metrics), metrics, DataPlaneSettings()), replicas


def post(body: dict) -> Request:
    return Request("POST", "/v1/completions", [(b"content-type", b"application/json")],
                   json.dumps({"model": "tiny", "prompt": "hello", **body}).encode())


async def test_each_failed_attempt_is_told_then_finished_and_the_retry_routed_anew(start_fake_upstream):
    plane, replicas = await data_plane(start_fake_upstream)
    Recording.events.clear()
    response = await plane.handle(post({"order": ["dead", "unwell", "ok"]}))
    assert response.status == 200
    assert response.after_send is not None  # the answer's accounting, which the server runs once it is sent
    response.after_send()
    assert Recording.events == [
        ("routed", "dead", 1, True), ("attempt_failed", "dead", "connect"), ("finished", "dead", False),
        ("routed", "unwell", 1, True), ("attempt_failed", "unwell", "status_503"), ("finished", "unwell", False),
        ("routed", "ok", 1, True), ("finished", "ok", True),
    ]
    assert [(r.inflight, r.inflight_tokens) for r in replicas] == [(0, 0)] * 3


async def test_a_stream_is_routed_before_its_head_and_finished_once_after_its_first_token(start_fake_upstream):
    plane, replicas = await data_plane(start_fake_upstream)
    Recording.events.clear()
    response = await plane.handle(post({"order": ["ok"], "stream": True}))
    assert response.status == 200
    assert Recording.events == [("routed", "ok", 1, True)]  # the head is here, no token relayed yet
    async for _ in response.body:
        pass
    await response.body.aclose()
    assert Recording.events == [("routed", "ok", 1, True), ("first_token", "ok"), ("finished", "ok", False)]
    assert [(r.inflight, r.inflight_tokens) for r in replicas] == [(0, 0)] * 3
