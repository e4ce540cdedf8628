"""Overload control's room shared across gateways, with real processes: ``llmgw sim`` engines that run two
requests at a time, a control ``llmgw serve``, a ``--role gateway`` gateway in this process (so the test can say
how many requests its queue holds), and a real ``redis-server`` between them.

Each gateway learns the engines' capacity and seats from its own scrapes of their ``/metrics``; the requests in
flight through one gateway take the room (and the seats) of the other; the requests one gateway holds shrink the
other's share.
"""

from __future__ import annotations

import coredis
import httpx
import pytest
import trio

from llmgw.cluster import records
from llmgw.cluster.records import Keys
from llmgw.flow.model import DEFAULT_CLASSES, FlowSettings
from llmgw.testing.metrics import metric_value
from llmgw.testing.processes import CLUSTER_SECRET
from llmgw.testing.sims import MODEL, stream_story
from llmgw.testing.two_gateways import control_and_gateway

pytestmark = pytest.mark.slow

INTERACTIVE, BATCH = DEFAULT_CLASSES[0], DEFAULT_CLASSES[2]
STREAMS = 6  # over 2 engines of 2 running each: 2 wait


async def room_figures(http: httpx.AsyncClient, control_url: str) -> tuple[float | None, float | None]:
    """The control gateway's summed learnt capacity of MODEL's replicas and its free room, from one scrape."""
    text = (await http.get(control_url + "/metrics")).text
    capacities = [metric_value(text, "llmgw_flow_replica_capacity", f'model="{MODEL}",replica="sim-{i}"', None)
                  for i in range(2)]
    free = metric_value(text, "llmgw_flow_room_free", f'model="{MODEL}"', None)
    known = [c for c in capacities if c is not None]
    return (sum(known) if len(known) == 2 else None), free


async def test_in_flight_and_held_requests_of_one_gateway_reach_the_others_room(nursery, start_llmgw, redis_url,
                                                                                cluster_name, monkeypatch):
    # 200 output tokens at 20 ms a step: a stream stays in flight about 4 s; at most 2 run per engine.
    control, gateway = await control_and_gateway(nursery, start_llmgw, redis_url, cluster_name, monkeypatch.setenv)
    room = gateway.room
    replicas = gateway.router.replicas.members(MODEL)
    assert room.free(MODEL, INTERACTIVE) > 1000  # no engine has said it is full: nothing held

    async with httpx.AsyncClient(timeout=30) as http:
        async with trio.open_nursery() as streams:
            for seed in range(STREAMS):
                streams.start_soon(stream_story, http, control.url, seed)
            with trio.fail_after(10):  # this gateway sees the engines queue, and the control's requests in flight
                while not (sum(r.peer_inflight for r in replicas) == STREAMS
                           and all(room.capacity(r) is not None for r in replicas)):
                    await trio.sleep(0.02)
            assert sum(r.local_inflight for r in replicas) == 0
            assert all(room.capacity(r) <= 2 for r in replicas)  # what the engines ran, at most
            assert room.free(MODEL, INTERACTIVE) == 0  # the other gateway's requests fill it
            assert room.saturation(MODEL) >= 1.0
            with trio.fail_after(10):  # the engines queue for seats (their KV nearly empty): 2 each
                while not all(room.seats(r) == 2 for r in replicas):
                    await trio.sleep(0.02)
            with trio.fail_after(15):  # the first four streams end: one of the other gateway's on each replica
                while [r.peer_inflight for r in replicas] != [1, 1]:
                    await trio.sleep(0.02)
            # Batch keeps floor(2 x 0.85) = 1 seat of each replica: the other gateway's one there takes it; the
            # interactive class may fill what the capacity leaves (the summed rule alone would let batch in).
            assert room.free(MODEL, BATCH) == 0
            assert room.free(MODEL, INTERACTIVE) == sum(room.capacity(r) - 1 for r in replicas)
            with trio.fail_after(10):  # the control learnt the same from its own scrapes
                while (await room_figures(http, control.control_url))[0] is None:
                    await trio.sleep(0.05)
            streams.cancel_scope.cancel()

        with trio.fail_after(10):
            while sum(r.inflight for r in replicas) or (await room_figures(http, control.control_url))[1] == 0:
                await trio.sleep(0.05)
        capacity, free = await room_figures(http, control.control_url)
        assert capacity and free == capacity  # nobody holds requests: all the free room is the control's

        room.count_queued(lambda model: 6 if model == MODEL else 0)  # this gateway's queue holds 6
        with trio.fail_after(5):
            while True:
                capacity, free = await room_figures(http, control.control_url)
                assert capacity
                if free == max(1, int(capacity) // 7):  # its quota: capacity x 1 / (1 + 6), nothing in flight
                    break
                await trio.sleep(0.05)
        assert capacity >= 2 and free < capacity

        room.count_queued(lambda model: 0)
        with trio.fail_after(5):
            while True:
                capacity, free = await room_figures(http, control.control_url)
                if capacity and free == capacity:
                    break
                await trio.sleep(0.05)


async def test_a_forged_count_of_held_requests_is_clamped_and_a_forged_signature_refused(shared_cluster, redis_url,
                                                                                        cluster_name):
    """Whoever can write to Redis: a report signed with the cluster secret claiming 2**40 requests held for the
    model, and 4,096 models nobody serves, is taken at what an honest gateway can hold, of the served model only;
    the same held requests added to a report they were not signed with are refused whole."""
    _, control, _ = await shared_cluster(followers=0, routing="round_robin")
    signer = records.Signer(CLUSTER_SECRET.encode())
    held = records.encode_load_queued({MODEL: 1 << 40, **{f"ghost-{i}": 5 for i in range(4095)}})
    fields = {b"o": b"forger", b"x": b"2000", b"l": records.pack([])}
    fields[b"s"] = signer.sign(fields[b"o"], fields[b"x"], fields[b"l"])
    tampered = {**fields, b"o": b"tamperer", b"q": held, b"t": b"\0" * 32}
    tampered[b"s"] = signer.sign(tampered[b"o"], tampered[b"x"], tampered[b"l"])
    fields[b"q"] = held
    fields[b"t"] = signer.sign(fields[b"o"], fields[b"x"], fields[b"l"], held)
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    async with httpx.AsyncClient(timeout=30) as http, coredis.Redis(host=host, port=int(port),
                                                                    decode_responses=False) as redis:
        with trio.fail_after(10):
            while True:  # the reports live 2 s: written until seen
                await redis.xadd(Keys(cluster_name).load, tampered)
                await redis.xadd(Keys(cluster_name).load, fields)
                peers = (await http.get(control.control_url + "/admin/cluster")).json()["peers"]
                if "forger" in peers:
                    break
                await trio.sleep(0.1)
        assert peers["forger"]["held"] == {MODEL: FlowSettings().max_queued}
        assert "tamperer" not in peers
        text = (await http.get(control.control_url + "/metrics")).text
        assert metric_value(text, "llmgw_cluster_bad_records_total", 'stream="load"') >= 1
