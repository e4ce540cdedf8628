"""The runbook's rolling upgrade (docs/runbook.md, "Upgrade llmgw without dropping requests"), step by step, under a
steady load, in the production topology of :mod:`llmgw.testing.ha`: candidates A (leading) and B, a ``--role
gateway`` F, a remote ``llmgw agent --join A,B`` running two simulator engines, one Redis.

Each process is stopped with SIGTERM (what ``systemctl restart`` and Kubernetes send) and started again, as an
upgrade does with the new version's binary: first the gateways that do not lead (F, then B), then the leader A
(its successor B takes the lease at once: A gives it up), then the agent (its engines keep running and the next
agent adopts them). The load is that of a client behind an L4 balancer (:mod:`llmgw.bench.fault_load`: round robin
over the data ports, a fresh connection per request, a connection refused sent to the next gateway); a stopped
gateway leaves the rotation once it has exited and comes back once its ``/ready`` says 200, as a balancer's health
check does. The test asserts what the runbook promises: not one request failed, streamed or not; the engines were
neither restarted nor replaced; the agent kept its node identity.
"""

from __future__ import annotations

import signal

import pytest
import trio

from llmgw.bench.fault_load import LoadSettings, SteadyLoad
from llmgw.testing.ha import FIXTURE, LEASE_TTL, HaCluster

pytestmark = pytest.mark.slow

# Default engine timing (20 ms a step): 16 tokens take about 320 ms, so requests are in flight at every SIGTERM.
LOAD = LoadSettings(concurrency=6, rate=15, stream_every=3, max_tokens=16)
STEP_AFTER = 15  # requests that must end between two steps, with every gateway back in the rotation


async def test_a_rolling_restart_of_every_process_fails_no_request_and_restarts_no_engine(ha_cluster: HaCluster):
    ha = ha_cluster
    a, b = ha.candidates
    f = ha.gateway
    engines, secret = ha.engine_pids(), ha.node_secret()
    assert len(engines) == ha.replicas
    load = SteadyLoad([p.data_url for p in ha.gateways], LOAD)
    async with load.running():
        await load.wait_finished(STEP_AFTER)

        load.phase = "F (--role gateway)"
        await ha.restart(f, load, "--role", "gateway")
        await load.wait_finished(STEP_AFTER)

        load.phase = "B (candidate, not leading)"
        await ha.restart(b, load)
        await load.wait_finished(STEP_AFTER)

        load.phase = "A (the leader)"
        stopped = trio.current_time()
        async def b_leads() -> None:
            await ha.wait_leader([b], timeout=LEASE_TTL + 5)
            print(f"\nB leads {trio.current_time() - stopped:.2f} s after the leader's SIGTERM")

        await ha.restart(a, load, while_down=b_leads)
        await ha.wait_routable(timeout=30)
        await load.wait_finished(STEP_AFTER)

        load.phase = "the agent"
        ha.agent.kill(signal.SIGTERM)
        await ha.agent.wait_exit(timeout=20)
        ha.agent = await a.start_agent("a", FIXTURE, join=f"{a.control_url},{b.control_url}",
                                       state_dir=ha.agent_state)
        print(f"the cluster whole again (the agent's engines at the leader) {await ha.wait_converged():.2f} s after "
              f"the new agent connected")
        await ha.wait_routable(timeout=30)
        await load.wait_finished(STEP_AFTER)
        await load.pause()
    failed = ha.load_outcome(load)
    assert not failed, f"requests failed during the rolling restart: {failed}"
    assert ha.engine_pids() == engines, "an engine was restarted or replaced"
    assert ha.node_secret() == secret, "the agent had to join again with the join token"
