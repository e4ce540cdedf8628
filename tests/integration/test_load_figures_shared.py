"""Each gateway's figures per model reach the others through the load reports, with real processes: ``llmgw sim``
engines that run two requests at a time, a control ``llmgw serve`` that takes the requests, a ``--role gateway``
gateway in this process that takes none (so the test reads what it learnt of the other), and a real
``redis-server`` between them, the reports signed with the cluster secret.

What the control gateway counted (the requests that entered its queue, the output allowance of those in flight)
is what this gateway reads of it, by its origin; the leader's autoscaler sums those (tests/unit/
test_autoscale_signals.py) and a gateway's queue sheds on the others' drain rates (tests/unit/test_flow_queue.py).
"""

from __future__ import annotations

import httpx
import pytest
import trio

from llmgw.testing.sims import MODEL, stream_story
from llmgw.testing.two_gateways import control_and_gateway

pytestmark = pytest.mark.slow

STREAMS = 6  # over 2 engines of 2 running each: 2 wait at the control gateway
MAX_TOKENS = 200


async def test_a_gateways_arrivals_and_output_in_flight_reach_the_other_gateway(nursery, start_llmgw, redis_url,
                                                                                 cluster_name, monkeypatch):
    control, gateway = await control_and_gateway(nursery, start_llmgw, redis_url, cluster_name, monkeypatch.setenv,
                                                 MAX_TOKENS)
    assert gateway.shared is not None
    sharing = gateway.shared.load
    replicas = gateway.router.replicas.members(MODEL)

    async def stream(http: httpx.AsyncClient, seed: int) -> None:
        assert await stream_story(http, control.url, seed, MAX_TOKENS) == 200

    async with httpx.AsyncClient(timeout=30) as http:
        async with trio.open_nursery() as streams:
            for seed in range(STREAMS):
                streams.start_soon(stream, http, seed)
            with trio.fail_after(10):  # every request entered the control's queue, some are in flight there
                while True:
                    [(origin, figures)] = list(sharing.peer_figures(MODEL).items()) or [("", None)]
                    inflight = sum(r.peer_inflight for r in replicas)
                    if figures is not None and figures.entered == STREAMS and inflight:
                        break
                    await trio.sleep(0.02)
            assert origin != gateway.shared.origin
            # The output allowance of the requests the control has in flight: MAX_TOKENS each (reports of the same
            # moment: read both until they agree).
            with trio.fail_after(10):
                while sharing.peer_figures(MODEL)[origin].output_inflight != \
                        MAX_TOKENS * sum(r.peer_inflight for r in replicas):
                    await trio.sleep(0.02)
            assert sum(r.local_inflight for r in replicas) == 0  # this gateway took none of them
        with trio.fail_after(10):  # all answered: nothing in flight there, the arrivals stay counted
            while sharing.peer_figures(MODEL)[origin].output_inflight:
                await trio.sleep(0.05)
        assert sharing.peer_figures(MODEL)[origin].entered == STREAMS
