"""Issue 29's faults, each under steady traffic, in the production topology: two candidates A and B, one
``--role gateway`` F, a remote ``llmgw agent --join A,B`` deploying two simulator replicas, a real redis-server,
``state.secret_env`` set, ``agents.heartbeat_interval`` 0.5 s, one chat every 100 ms through each gateway.

Each test asserts the issue's targets: no failed request on a gateway that was not itself frozen; every replica
routable on every gateway from ``lease_ttl + lease_renew + 1 s`` after Redis answered again or a new leader was
elected, to the end of a window long enough for any hold to have run out (a dropped replica would show); the
engines never restarted (their pids and restart counts in the agent's ledger).
"""

from __future__ import annotations

import signal
from typing import Awaitable, Callable

import coredis
import httpx
import pytest
import trio

from llmgw.cluster import records
from llmgw.cluster.election import Election, Fence
from llmgw.cluster.identities import SharedIdentities
from llmgw.cluster.link import RedisLink
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys
from llmgw.config.loading import parse_config
from llmgw.control.identity import NodeIdentities
from llmgw.testing.cluster import CHAT
from llmgw.testing.ha import HEARTBEAT, LEASE_TTL, HaCluster, RoutabilityWatch, recovery_limit
from llmgw.testing.processes import free_port
from llmgw.testing.redis import PrivateRedis
from llmgw.testing.shared_state import cluster_config, state_section, wait_kv_healthy
from llmgw.testing.sims import KV_SIM_ENV, KV_SIM_EXTRA, start_sims
from llmgw.testing.traffic import TrafficRecorder
from llmgw.wire.liveness import hold_window

pytestmark = pytest.mark.slow

# Long enough after the recovery for a new term's hold of the replicas it followed to run out: a replica dropped
# wrongly would show (the 2 s: an election after Redis answers, and the watch's sampling).
SETTLE = hold_window(HEARTBEAT, LEASE_TTL) + 2.0

Fault = Callable[[HaCluster], Awaitable[tuple[float, set[int], float]]]


async def under_traffic(ha: HaCluster, fault: Fault) -> None:
    """Run ``fault`` (-> ``(recovered at, indices of frozen gateways, when they were let go)``) with traffic
    through every gateway and the replica listings watched; then assert the targets."""
    before = ha.engine_pids()
    assert len(before) == ha.replicas
    secret = ha.node_secret()
    recorders = [TrafficRecorder(ha.http, process.data_url, name) for process, name in zip(ha.gateways, "ABF")]
    watch = RoutabilityWatch(ha)
    try:
        recovered, frozen, thawed = await traffic_through(ha, fault, recorders, watch)
    finally:
        ha.write_logs(ha.agent_state.parent / "logs")
    for recorder in recorders:
        print(f"gateway {recorder.name}: {recorder.summary()}")
    failed = {recorder.name: (recorder.summary(), f"first at {recorder.first_failure() - recovered:+.1f} s")
              for i, recorder in enumerate(recorders) if i not in frozen and recorder.failed()}
    assert not failed, f"failed requests on gateways that were not frozen: {failed}"
    for i, recorder in enumerate(recorders):
        since = (max(recovered, thawed) if i in frozen else recovered) + recovery_limit()
        short = watch.short(i, since)
        assert not short, (f"gateway {recorder.name} did not route every replica from {since - recovered:.1f} s after "
                           f"the recovery: (seconds after it, replicas routable) "
                           f"{[(round(t - recovered, 1), n) for t, n in short][:20]}")
        if i not in frozen:  # a load balancer checking /ready would have taken it out of rotation
            not_ready = watch.not_ready(i)
            assert not not_ready, (f"gateway {recorder.name} was not ready (seconds after the recovery, status, "
                                   f"reasons): {[(round(t - recovered, 1), st, r) for t, st, r in not_ready][:5]}")
    after = ha.engine_pids()
    assert after == before, f"engines restarted: {before} -> {after}"
    print(f"the cluster whole again (one leader, followed, the agent's engines adopted) "
          f"{await ha.wait_converged():.2f} s after the fault's window")
    # Whoever leads now knew the agent's node: it proved its secret, it did not join anew with the token.
    assert ha.node_secret() == secret, "the agent had to join again: the leader did not know its node"


async def traffic_through(ha: HaCluster, fault: Fault, recorders: list[TrafficRecorder],
                          watch: RoutabilityWatch) -> tuple[float, set[int], float]:
    """The fault under traffic, and the window after it (until any hold has run out); what ``fault`` returned."""
    async with trio.open_nursery() as running:
        for recorder in recorders:
            await running.start(recorder.run)
        await running.start(watch.run)
        await trio.sleep(1.0)
        recovered, frozen, thawed = await fault(ha)
        took = await ha.wait_routable(timeout=30)
        print(f"\nevery replica routable on every gateway {trio.current_time() - recovered:.2f} s after the recovery "
              f"({took:.2f} s after the fault's end)")
        await trio.sleep_until(max(recovered, thawed) + SETTLE)
        running.cancel_scope.cancel()
    return recovered, frozen, thawed


async def test_redis_frozen_8s_fails_nothing_and_keeps_every_replica(ha_cluster: HaCluster):
    async def fault(ha: HaCluster):
        ha.redis.running.kill(signal.SIGSTOP)
        try:
            await trio.sleep(8)
        finally:
            ha.redis.running.kill(signal.SIGCONT)
        return trio.current_time(), set(), 0.0

    await under_traffic(ha_cluster, fault)


@pytest.mark.parametrize("elected", ["any", "other"])
async def test_redis_killed_and_restarted_empty_fails_nothing_and_keeps_every_replica(ha_cluster: HaCluster,
                                                                                      elected: str):
    # "other": the candidate that did not lead before is the one elected on the empty Redis (A is held back by a
    # freeze until B leads): it has never seen the agent's node identity but in Redis, which lost it.
    async def fault(ha: HaCluster):
        a, b = ha.candidates
        assert a.serve is not None
        await ha.redis.kill(signal.SIGKILL)
        await trio.sleep(8)
        if elected == "other":
            a.serve.kill(signal.SIGSTOP)
        try:
            await ha.redis.restart()
            restarted = trio.current_time()
            if elected == "other":
                await ha.wait_leader([b], timeout=LEASE_TTL + 5)
        finally:
            a.serve.kill(signal.SIGCONT)
        return restarted, {0} if elected == "other" else set(), trio.current_time()

    await under_traffic(ha_cluster, fault)


async def test_the_leader_frozen_7s_fails_nothing_elsewhere_and_keeps_every_replica(ha_cluster: HaCluster):
    async def fault(ha: HaCluster):
        a, b = ha.candidates
        assert a.serve is not None
        a.serve.kill(signal.SIGSTOP)
        frozen_at = trio.current_time()
        try:
            await ha.wait_leader([b], timeout=LEASE_TTL + 5)
            elected = trio.current_time()
            await trio.sleep_until(frozen_at + 7)
        finally:
            a.serve.kill(signal.SIGCONT)
        return elected, {0}, trio.current_time()

    await under_traffic(ha_cluster, fault)


@pytest.mark.parametrize("expiry", ["px6000", "none"])
async def test_a_forged_lease_fails_nothing_and_keeps_every_replica(ha_cluster: HaCluster, cluster_name: str,
                                                                    expiry: str):
    # The lease is signed with the cluster secret: a forged one (anyone who can write to Redis; no secret) ended
    # the leader's term and left the cluster leaderless until it expired. Now the leader puts its own back at its
    # next renewal or fenced write and keeps its term; the other candidate never takes the forged one over it.
    async def fault(ha: HaCluster):
        leader = ha.candidates[0]
        term = (await ha.health(leader))["state"]["leader"]["term"]
        client = coredis.Redis.from_url(ha.redis.url, decode_responses=False)
        async with client:
            await client.set(Keys(cluster_name).leader, b"999 evil http://127.0.0.1:1",
                             px=6000 if expiry == "px6000" else None)
            forged = trio.current_time()
            with trio.fail_after(5):
                while (await client.get(Keys(cluster_name).leader)).startswith(b"999 "):
                    await trio.sleep(0.02)
        back = trio.current_time()
        print(f"\nthe leader's lease back {back - forged:.2f} s after the forgery")
        await trio.sleep(2 * LEASE_TTL)  # several renewals and the other candidate's rounds
        for candidate in ha.candidates:
            state = (await ha.health(candidate))["state"]["leader"]
            assert state["leading"] == (candidate is leader), state
        assert (await ha.health(leader))["state"]["leader"]["term"] == term
        assert await leader.metric("llmgw_cluster_bad_records_total", 'stream="lease"') == 1
        return back, set(), 0.0

    await under_traffic(ha_cluster, fault)


async def test_a_deleted_lease_changes_no_leader_fails_nothing_and_keeps_every_replica(ha_cluster: HaCluster,
                                                                                       cluster_name: str):
    # A DEL of the lease (anyone who can write to Redis) ended the leader's term at its next renewal and the other
    # candidate took the lease: a change of leader on demand. Now the leader puts its lease back (the generation
    # counter still holds its term: nobody took one since) and the other candidate waits for it.
    async def fault(ha: HaCluster):
        leader, other = ha.candidates
        term = (await ha.health(leader))["state"]["leader"]["term"]
        client = coredis.Redis.from_url(ha.redis.url, decode_responses=False)
        lease = Keys(cluster_name).leader
        leaderless: list[tuple[str, dict]] = []

        async def watch_holders() -> None:
            # Every process names the leader throughout: a lease gone while it could still stand is its
            # holder's still (no "no_leader" on /health, no holder of another term).
            while True:
                for process, name in zip(ha.gateways, "ABF"):
                    health = await ha.health(process)
                    holder = health["state"]["leader"]["holder"]
                    if (holder or {}).get("generation") != term or "no_leader" in {r["code"] for r in
                                                                                     health["reasons"]}:
                        leaderless.append((name, health))
                await trio.sleep(0.05)

        async with client, trio.open_nursery() as watching:
            watching.start_soon(watch_holders)
            token = await client.get(lease)
            assert token is not None
            for _ in range(3):
                await client.delete([lease])
                deleted = trio.current_time()
                with trio.fail_after(5):
                    while await client.get(lease) != token:
                        await trio.sleep(0.01)
                print(f"\nthe leader's lease back {trio.current_time() - deleted:.2f} s after the DEL")
                await trio.sleep(1.0)
            watching.cancel_scope.cancel()
        assert not leaderless, leaderless[:3]
        back = trio.current_time()
        await trio.sleep(2 * LEASE_TTL)  # several renewals and the other candidate's rounds
        for candidate in ha.candidates:
            state = (await ha.health(candidate))["state"]["leader"]
            assert state["leading"] == (candidate is leader), state
        assert (await ha.health(leader))["state"]["leader"]["term"] == term  # a new term draws the next number
        assert (await ha.health(other))["state"]["leader"]["holder"]["generation"] == term
        assert await leader.metric("llmgw_cluster_lease_restored_total") == 3
        assert await other.metric("llmgw_cluster_elections_total") == 0
        return back, set(), 0.0

    await under_traffic(ha_cluster, fault)


@pytest.mark.parametrize("role", ["candidate", "gateway"])
async def test_a_process_started_while_redis_is_down_routes_its_own_configs_static_replicas(nursery, start_llmgw,
                                                                                          cluster_name, tmp_path,
                                                                                          role):
    # Nothing listens on the state's URL: the cluster's state cannot be loaded. Fail-static from its own config:
    # a candidate, and a --role gateway (which answered 503 state_not_loaded until Redis came), route the static
    # replicas their config lists, at once (not 6 s of waiting, then 503).
    engines = await start_sims(nursery, 2, env=KV_SIM_ENV, num_blocks=512, block_size=16, time_scale=0, seed=0,
                               extra=KV_SIM_EXTRA)
    port = free_port()
    config = cluster_config(engines, f"redis://127.0.0.1:{port}", cluster_name)
    process = await start_llmgw(config, *(("--role", "gateway") if role == "gateway" else ()))
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(5):
            started = trio.current_time()
            response = await http.post(process.url + "/v1/chat/completions", json=CHAT)
            assert response.status_code == 200, response.text
            assert trio.current_time() - started < 2.0
        health = (await http.get(process.control_url + "/health")).json()
        assert health["state"]["degraded"] is True  # and it says why it routes on its own config
        listed = (await http.get(process.control_url + "/admin/replicas")).json()
        assert sorted(r["name"] for r in listed) == ["sim-0", "sim-1"]
        assert any("routes its own config's static replicas" in line for line in process.lines)
        # Redis comes up: the candidate leads and publishes the same replicas (the gateway loads the snapshot of a
        # candidate started then), routing all along.
        traffic = TrafficRecorder(http, process.url)
        async with trio.open_nursery() as running:
            await running.start(traffic.run)
            await PrivateRedis(nursery, tmp_path / "redis-late").start(port)
            leader = process if role == "candidate" else await start_llmgw(config)
            with trio.fail_after(15):
                while not (await http.get(leader.control_url + "/health")).json()["state"]["leader"]["leading"]:
                    await trio.sleep(0.05)
                while not (await http.get(process.control_url + "/health")).json()["state"]["log"].get(
                        "loaded", True):
                    await trio.sleep(0.05)
            await wait_kv_healthy(process.control_url, len(engines))
            await trio.sleep(1.0)
            running.cancel_scope.cancel()
        assert traffic.sent() and not traffic.failed(), traffic.summary()


async def test_a_candidate_keeps_the_node_identities_redis_lost_but_not_a_forgotten_one(nursery, private_redis,
                                                                                       cluster_name, tmp_path):
    config = parse_config(state_section(private_redis.url, cluster_name, lease_ttl="600ms", lease_renew="100ms"))
    keys, signer = Keys(cluster_name), records.Signer(b"a cluster secret of at least 16 bytes")
    metrics = ClusterMetrics(None, "control", cluster_name, "leader")
    link = RedisLink(config.state, metrics)
    await nursery.start(link.run)
    election = Election(link, keys, config.state, metrics, "leader")
    election.listening("http://leader.invalid:1")
    await nursery.start(election.run)
    term = await election.wait_elected()
    leader_store = NodeIdentities(tmp_path / "leader")
    leader_store.bind("n1", "secret-1")
    nursery.start_soon(SharedIdentities(link, keys, signer, metrics).write_from, leader_store,
                       Fence(link, keys, election, term, metrics))
    candidate = SharedIdentities(link, keys, signer, metrics)  # another candidate's copy, as it follows
    await nursery.start(candidate.follow, 0.05)

    async def copy_is(node_ids: set[str]) -> None:
        with trio.fail_after(10):
            while set(candidate.known) != node_ids:
                await trio.sleep(0.05)

    await copy_is({"n1"})
    leader_store.bind("n2", "secret-2")
    await copy_is({"n1", "n2"})
    leader_store.forget("n1")
    leader_store.forget("n2")  # the last node forgotten: the hash stays (its marker), the copy follows it
    await copy_is(set())
    leader_store.bind("n3", "secret-3")
    await copy_is({"n3"})
    await private_redis.kill()
    await private_redis.restart()  # empty: the hash is gone, and the term with it
    await trio.sleep(0.3)
    assert set(candidate.known) == {"n3"}
    successor = NodeIdentities(tmp_path / "successor")  # a candidate that never led: nothing on its disk
    await candidate.load_into(successor)
    assert successor.verify("n3", "secret-3") and not successor.known("n1") and not successor.known("n2")
    nursery.cancel_scope.cancel()
