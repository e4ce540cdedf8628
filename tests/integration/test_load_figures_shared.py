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

from llmgw.config.loading import parse_config
from llmgw.gateway.app import Gateway
from llmgw.testing.processes import CLUSTER_SECRET, CLUSTER_SECRET_ENV
from llmgw.testing.shared_state import cluster_config, wait_replicas
from llmgw.testing.sims import MODEL, start_sims, stream_story

pytestmark = pytest.mark.slow

STREAMS = 6  # over 2 engines of 2 running each: 2 wait at the control gateway
MAX_TOKENS = 200


async def test_a_gateways_arrivals_and_output_in_flight_reach_the_other_gateway(nursery, start_llmgw, redis_url,
                                                                                 cluster_name, monkeypatch):
    # 200 output tokens at 20 ms a step: a stream stays in flight about 4 s.
    engines = await start_sims(nursery, 2, num_blocks=512, block_size=16, time_scale=1, seed=0,
                               extra=("--max-num-seqs", "2", "--output-tokens", f"{MAX_TOKENS}:{MAX_TOKENS}"))
    config = cluster_config(engines, redis_url, cluster_name, routing="round_robin")
    control = await start_llmgw(config)
    await wait_replicas(control.control_url, 2)
    monkeypatch.setenv(CLUSTER_SECRET_ENV, CLUSTER_SECRET)
    gateway = Gateway(parse_config(config), role="gateway")
    await nursery.start(gateway.run, ("127.0.0.1", 0), ("127.0.0.1", 0))
    assert gateway.shared is not None
    sharing = gateway.shared.load
    with trio.fail_after(20):
        while len(gateway.router.replicas.members(MODEL)) < 2:
            await trio.sleep(0.05)
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
