"""Leader election over Redis: every ``llmgw serve`` of a cluster without ``--role gateway`` is a candidate, one
holds the lease and runs the control plane, the others follow it and take over when it dies or is cut off.

Real processes on loopback: ``llmgw sim`` replicas with KV events, candidate ``llmgw serve`` processes and a real
``redis-server``. What is checked is what a user sees (``/health``, ``/admin/cluster``, ``/metrics``, answers to
requests) and what is in Redis (the log, the lease).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import coredis
import httpx
import pytest
import trio

from llmgw.cluster.link import RedisLink
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys, Signer
from llmgw.config.loading import parse_config
from llmgw.testing.cluster import CHAT, TOKEN, Cluster, all_up, shard_pids
from llmgw.testing.ha import candidate_config
from llmgw.testing.metrics import metric_value
from llmgw.testing.processes import Child, llmgw_command
from llmgw.testing.shared_state import cluster_config, start_cluster, state_section, wait_kv_healthy
from llmgw.testing.sims import KV_SIM_ENV, KV_SIM_EXTRA, MODEL, start_sims
from llmgw.wire.channel import agent_url

if TYPE_CHECKING:
    from llmgw.cluster.election import Election, Term

pytestmark = pytest.mark.slow

SECRET = Signer(b"a cluster secret of at least 16 bytes")  # the in-process candidates' cluster secret
PROMPT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello there"}]}


async def leader_state(http: httpx.AsyncClient, gateway: Child) -> dict:
    """The ``leader`` part of the gateway's ``/health`` (its campaign: leading or not, the holder it last read)."""
    return (await http.get(gateway.control_url + "/health")).json()["state"]["leader"]


async def wait_for_leader(http: httpx.AsyncClient, candidates: list[Child], timeout: float = 10.0) -> Child:
    """Until exactly one candidate leads and every candidate names it as the holder; that one."""
    with trio.fail_after(timeout):
        while True:
            states = [await leader_state(http, c) for c in candidates]
            leaders = [c for c, s in zip(candidates, states) if s["leading"]]
            holders = {(s["holder"] or {}).get("origin") for s in states}
            if len(leaders) == 1 and len(holders) == 1 and None not in holders:
                return leaders[0]
            await trio.sleep(0.05)


async def leader_and_other(http: httpx.AsyncClient, candidates: list[Child],
                           timeout: float = 10.0) -> tuple[Child, Child]:
    """``(leader, the other)`` of two candidates, once they agree."""
    leader = await wait_for_leader(http, candidates, timeout)
    (other,) = [c for c in candidates if c is not leader]
    return leader, other


async def two_candidates(nursery, start_llmgw, redis_url: str, cluster_name: str, state: str = ""):
    """``(simulators, [candidate A, candidate B])``: two ``llmgw serve`` processes of one cluster, neither with
    ``--role gateway``; A is started first (and so is elected first)."""
    engines, first, _ = await start_cluster(nursery, start_llmgw, redis_url, cluster_name, followers=0, state=state)
    second = await start_llmgw(cluster_config(engines, redis_url, cluster_name, state=state))
    await wait_kv_healthy(second.control_url, len(engines))
    return engines, [first, second]


async def test_two_candidates_elect_one_leader_and_the_other_follows_it(nursery, start_llmgw, redis_url,
                                                                        cluster_name):
    engines, candidates = await two_candidates(nursery, start_llmgw, redis_url, cluster_name)
    async with httpx.AsyncClient(timeout=30) as http:
        leader, follower = await leader_and_other(http, candidates)
        clusters = {c: (await http.get(c.control_url + "/admin/cluster")).json() for c in candidates}
        # The follower follows the leader's log (its writer is the leader's term), and has no control plane.
        assert clusters[follower]["log"]["writer"].startswith(clusters[leader]["origin"] + ".")
        assert clusters[follower]["log"]["loaded"] is True
        assert (await http.get(follower.control_url + "/admin/nodes")).status_code == 404
        assert (await http.get(leader.control_url + "/admin/nodes")).status_code == 200
        leading = {c: metric_value((await http.get(c.control_url + "/metrics")).text, "llmgw_cluster_leader")
                   for c in candidates}
        assert leading == {leader: 1.0, follower: 0.0}
        for gateway in candidates:  # both route
            response = await http.post(gateway.url + "/v1/chat/completions", json=PROMPT)
            assert response.status_code == 200, response.text
        # `llmgw status` at the follower says who leads, and reads the nodes from the leader it names.
        out = await status_at(follower)
        assert out.startswith(f"CLUSTER {cluster_name}: this process follows; the leader is "
                              f"{clusters[leader]['origin']} at {leader.control_url} (term 1)\n"), out
        assert "NODES (0)" in out and "REPLICAS (2)" in out
        # Still one leader, the same one, a few renewals later.
        await trio.sleep(1.5)
        assert await wait_for_leader(http, candidates) is leader
        assert metric_value((await http.get(leader.control_url + "/metrics")).text,
                            "llmgw_cluster_elections_total") == 1.0


async def status_at(process: Child) -> str:
    """What ``llmgw status --control`` at ``process`` prints (it must succeed)."""
    done = await trio.run_process(llmgw_command("status", "--control", process.control_url),
                                  capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def test_kill_9_of_the_leader_makes_the_other_candidate_leader_and_the_followers_follow_it(
        nursery, start_llmgw, redis_url, cluster_name):
    engines, candidates = await two_candidates(nursery, start_llmgw, redis_url, cluster_name)
    gateway = await start_llmgw(cluster_config(engines, redis_url, cluster_name), "--role", "gateway")
    async with httpx.AsyncClient(timeout=30) as http:
        old, survivor = await leader_and_other(http, candidates)
        old.kill(signal.SIGKILL)
        await old.wait_exit()
        new = await wait_for_leader(http, [survivor], timeout=15)
        state = await leader_state(http, new)
        assert state["term"] == 2  # the lease's generation moved on: the fencing token of the new term
        survivor_origin = (await http.get(survivor.control_url + "/admin/cluster")).json()["origin"]
        # The --role gateway process follows the new leader's log (its snapshot, then its batches)...
        with trio.fail_after(15):
            while not ((await http.get(gateway.control_url + "/admin/cluster")).json()["log"]["writer"]
                       or "").startswith(survivor_origin + "."):
                await trio.sleep(0.1)
        # ...and both keep routing, the new leader with its own control plane.
        assert (await http.get(survivor.control_url + "/admin/nodes")).status_code == 200
        for process in (survivor, gateway):
            response = await http.post(process.url + "/v1/chat/completions", json=PROMPT)
            assert response.status_code == 200, response.text
        assert metric_value((await http.get(survivor.control_url + "/metrics")).text,
                            "llmgw_cluster_leader_transitions_total", 'to="leader",reason="elected"') == 1.0


async def test_a_paused_leader_steps_down_and_writes_nothing_after_its_successor(nursery, start_llmgw, redis_url,
                                                                                 cluster_name):
    engines, candidates = await two_candidates(nursery, start_llmgw, redis_url, cluster_name)
    async with httpx.AsyncClient(timeout=30) as http:
        old, other = await leader_and_other(http, candidates)
        old_origin = (await http.get(old.control_url + "/admin/cluster")).json()["origin"]
        old.kill(signal.SIGSTOP)  # a paused leader (a long GC, a frozen VM): its lease runs out meanwhile
        try:
            new = await wait_for_leader(http, [other], timeout=15)
            new_origin = (await http.get(new.control_url + "/admin/cluster")).json()["origin"]
            await trio.sleep(0.5)
        finally:
            old.kill(signal.SIGCONT)
        # Back, it finds its term over: it follows, the new leader keeps its term.
        assert await wait_for_leader(http, candidates) is other
        assert (await leader_state(http, other))["term"] == 2
        with trio.fail_after(15):  # the new term published its first snapshot (after its adoption window)
            while not (await http.get(other.control_url + "/admin/cluster")).json()["log"]["published"]:
                await trio.sleep(0.1)
        await trio.sleep(1.0)  # renewals of the new term; whatever the old one had pending would be written now
        assert await wait_for_leader(http, candidates) is other
        assert (await http.get(old.control_url + "/admin/nodes")).status_code == 404
        log_writers = await log_writers_in_order(redis_url, cluster_name)
        first_new = next(i for i, writer in enumerate(log_writers) if writer.startswith(new_origin + "."))
        assert not any(writer.startswith(old_origin + ".") for writer in log_writers[first_new:]), log_writers


async def log_writers_in_order(redis_url: str, cluster: str) -> list[str]:
    client = coredis.Redis.from_url(redis_url, decode_responses=False)
    async with client:
        entries = await client.xrange(Keys(cluster).log)
    return [entry.field_values[b"w"].decode() for entry in entries]


async def quick_candidate(nursery, redis_url: str, cluster_name: str, origin: str, signer=None) -> "Election":
    """A candidate's :class:`~llmgw.cluster.election.Election` in this process against the test's Redis (``lease_ttl``
    600 ms, renewed every 100 ms), its link and its campaign running in ``nursery``."""
    from llmgw.cluster.election import Election

    config = parse_config(state_section(redis_url, cluster_name, lease_ttl="600ms", lease_renew="100ms"))
    metrics = ClusterMetrics(None, "control", cluster_name, origin)
    link = RedisLink(config.state, metrics)
    await nursery.start(link.run)
    election = Election(link, Keys(cluster_name), config.state, metrics, origin, signer)
    election.listening(f"http://{origin}.invalid:1")
    await nursery.start(election.run)
    return election


async def leader_and_candidate(nursery, redis_url: str, cluster_name: str) -> tuple["Election", "Term", "Election"]:
    """``(a, its term, b)``: two :func:`quick_candidate` of the cluster secret :data:`SECRET`, ``a`` leading."""
    a = await quick_candidate(nursery, redis_url, cluster_name, "a", SECRET)
    term = await a.wait_elected()
    return a, term, await quick_candidate(nursery, redis_url, cluster_name, "b", SECRET)


async def test_a_stale_terms_write_is_refused_by_redis_and_ends_that_term(nursery, redis_url, cluster_name):
    from llmgw.cluster.election import Fence, Fenced  # here: the other tests run (and fail) on main

    keys = Keys(cluster_name)

    async def candidate(origin: str) -> "Election":
        return await quick_candidate(nursery, redis_url, cluster_name, origin)

    old = await candidate("old")
    old_term = await old.wait_elected()
    old_fence = Fence(old.link, keys, old, old_term, old.metrics)
    await old_fence.run("test", [[b"XADD", keys.log, b"*", b"w", b"old"]])  # while it holds the lease: written
    # Its lease runs out in Redis while it cannot renew (the pause, seen from Redis), and another takes it.
    # (Its renewals stop: a lease deleted under a leader that renews is put back, which is not this test's.)
    async def no_renewal(term) -> bool:
        return False

    old.keep = no_renewal  # type: ignore[method-assign]
    client = coredis.Redis.from_url(redis_url, decode_responses=False)
    async with client:
        await client.delete([keys.leader])
    new = await candidate("new")
    new_term = await new.wait_elected()
    assert new_term.generation == old_term.generation + 1
    with pytest.raises(Fenced):
        await old_fence.run("test", [[b"XADD", keys.log, b"*", b"w", b"old-late"]])
    assert old_term.scope.cancel_called and not old.leading
    assert scrape_metric(old.metrics.fenced_writes) == 1
    new_fence = Fence(new.link, keys, new, new_term, new.metrics)
    await new_fence.run("test", [[b"XADD", keys.log, b"*", b"w", b"new"]])
    async with client:
        written = [entry.field_values[b"w"] for entry in await client.xrange(keys.log)]
    assert written == [b"old", b"new"]
    nursery.cancel_scope.cancel()


def scrape_metric(counter) -> float:
    return counter._value.get()


async def test_a_lease_no_candidate_signed_ends_no_term_and_is_replaced_at_once(nursery, redis_url, cluster_name):
    """Anyone who can write to Redis could end every term (``SET llmgw:C:leader ...``: the leader's renewal found
    it taken) and hold the cluster leaderless until the forged lease expired. The lease is signed with the
    cluster secret now: the leader puts its own back over a forged one (compare-and-set on the exact bad value,
    the secret never sent to Redis) and keeps its term, its fenced writes go on, another candidate never takes
    it; with no leader, a candidate replaces a forged lease at once. A stale term's write is still refused."""
    from llmgw.cluster.election import Fence, Fenced  # here: the other tests run (and fail) on main

    keys = Keys(cluster_name)
    a, term, b = await leader_and_candidate(nursery, redis_url, cluster_name)
    fence = Fence(a.link, keys, a, term, a.metrics)
    client = coredis.Redis.from_url(redis_url, decode_responses=False)
    forged = [b"999 evil http://127.0.0.1:1", term.token.rsplit(b" ", 1)[0],  # its own value, unsigned
              b"%d a http://a.invalid:1 %s" % (term.generation + 1, term.token.rsplit(b" ", 1)[1]),  # next term
              b"x" * 100_000]
    async with client:
        for i, value in enumerate(forged):
            await client.set(keys.leader, value, px=5000)
            if i % 2:  # the next fenced write finds it (else the next renewal does)
                await fence.run("test", [[b"XADD", keys.log, b"*", b"w", b"a"]])
            with trio.fail_after(5):
                while await client.get(keys.leader) != term.token:
                    await trio.sleep(0.02)
        await trio.sleep(1.0)  # several renewals and b's rounds: nobody's term changed
        assert a.term is term and a.leading and not term.scope.cancel_called and not b.leading
        assert scrape_metric(a.metrics.bad_records.labels("lease")) == len(forged)
        assert scrape_metric(a.metrics.fenced_writes) == 0

        # No leader: a forged lease of 5 s (less than the 10 lease_ttls a candidate's own lease may have left,
        # which main waited for) is replaced by the next candidate at once.
        a_task_scope = term.scope
        a.pause(60)
        a.end_term("ended", term)
        await client.set(keys.leader, b"1000 evil http://127.0.0.1:1", px=5000)
        forged_at = trio.current_time()
        new_term = await b.wait_elected()
        assert trio.current_time() - forged_at < 2.0
        assert new_term.generation > term.generation and a_task_scope.cancel_called
        # The old term's fenced write is refused: b's lease is a candidate's, not put back.
        with pytest.raises(Fenced):
            await fence.run("test", [[b"XADD", keys.log, b"*", b"w", b"a-late"]])
        assert await client.get(keys.leader) == new_term.token


async def test_a_deleted_lease_ends_no_term_but_one_given_up_or_lost_with_redis_data_does(nursery, redis_url,
                                                                                            cluster_name):
    """A ``DEL`` of the lease (anyone who can write to Redis) ended the leader's term at its next renewal, and the
    other candidate took the lease at once: a change of leader on demand. Now the leader puts it back (its
    generation counter says no term was drawn since) and keeps its term; the other candidate waits for that while
    the lease it last read could stand. A lease given up (the release mark) is taken at once; one gone with the
    counter (Redis lost its data) ends the term, and the same candidate takes the next one while the other waits;
    one gone with a later generation drawn ends it too."""
    keys = Keys(cluster_name)
    a, term, b = await leader_and_candidate(nursery, redis_url, cluster_name)
    client = coredis.Redis.from_url(redis_url, decode_responses=False)
    async with client:
        await trio.sleep(0.3)  # b has read a's lease
        for _ in range(5):  # deleted, over and over: put back each time, the same term, b never takes it
            await client.delete([keys.leader])
            with trio.fail_after(2):
                while await client.get(keys.leader) != term.token:
                    await trio.sleep(0.01)
            await trio.sleep(0.2)
        assert a.term is term and a.leading and not term.scope.cancel_called and not b.leading
        assert scrape_metric(a.metrics.lease_restored) == 5
        assert scrape_metric(a.metrics.transitions.labels("follower", "taken")) == 0

        # Gone with the generation counter (Redis lost its data): the term ends, a takes the next one, b waits.
        await client.delete([keys.leader, keys.leader_generation])
        with trio.fail_after(2):
            while not term.scope.cancel_called:
                await trio.sleep(0.01)
        second = await a.wait_elected()
        assert second.generation == term.generation + 1
        assert scrape_metric(a.metrics.transitions.labels("follower", "lost")) == 1
        assert await client.get(keys.leader_generation) == str(second.generation).encode()
        await trio.sleep(0.3)
        assert a.term is second and not b.leading

        # Gone with a later generation drawn (a term this one did not see): the term ends.
        await client.set(keys.leader_generation, str(second.generation + 5))
        await client.delete([keys.leader])
        with trio.fail_after(2):
            while not second.scope.cancel_called:
                await trio.sleep(0.01)
        assert scrape_metric(a.metrics.transitions.labels("follower", "taken")) == 1
        with trio.fail_after(3):  # whoever takes it draws past the counter
            while not (a.leading or b.leading):
                await trio.sleep(0.01)
        third = (a if a.leading else b).term
        assert third is not None and third.generation == second.generation + 6

        # Given up: the other candidate takes it at once (the release mark), not once the lease could expire.
        leader, other = (a, b) if a.leading else (b, a)
        leader.pause(60)
        leader.end_term("ended", third)
        given_up = trio.current_time()
        fourth = await other.wait_elected()
        assert trio.current_time() - given_up < 0.4  # a lease_ttl is 0.6 s
        assert fourth.generation == third.generation + 1


async def test_a_gateway_names_the_leader_while_its_lease_is_gone_or_forged_within_a_lease_ttl(nursery, redis_url,
                                                                                              cluster_name):
    """A ``--role gateway`` process read the lease every ``lease_renew`` and named no leader (``/health``:
    ``no_leader``) at the first read that found it deleted or forged, which the leader puts back at its next
    renewal. It names the last leader it read until that one's lease could have expired."""
    from llmgw.cluster.election import LeaderWatch, lease_value

    config = parse_config(state_section(redis_url, cluster_name, lease_ttl="600ms", lease_renew="50ms"))
    keys, signer = Keys(cluster_name), SECRET
    metrics = ClusterMetrics(None, "gateway", cluster_name, "f")
    link = RedisLink(config.state, metrics)
    await nursery.start(link.run)
    watch = LeaderWatch(link, keys, config.state, signer)
    client = coredis.Redis.from_url(redis_url, decode_responses=False)
    async with client:
        await client.set(keys.leader, lease_value(7, "a", "http://a.invalid:1", signer), px=5000)
        await nursery.start(watch.run)
        with trio.fail_after(2):
            while watch.holder is None:
                await trio.sleep(0.01)
        assert watch.holder["generation"] == 7
        for gone in (lambda: client.delete([keys.leader]), lambda: client.set(keys.leader, b"999 evil x", px=5000)):
            await gone()
            await trio.sleep(0.3)  # six reads, within a lease_ttl of the last good one
            assert watch.holder is not None and watch.holder["generation"] == 7
            await client.set(keys.leader, lease_value(7, "a", "http://a.invalid:1", signer), px=5000)
            await trio.sleep(0.1)
        await client.delete([keys.leader])
        await trio.sleep(0.8)  # more than a lease_ttl since the last good read: no leader
        assert watch.holder is None
    nursery.cancel_scope.cancel()


async def test_a_redis_outage_leaves_no_leader_then_one_is_elected_and_every_process_routes_throughout(
        nursery, start_llmgw, private_redis, cluster_name):
    # Static replicas (simulators this test started): llmgw cannot restart them. Whether deployed engines survive a
    # Redis outage with their pids is test_cluster_faults.py's (read from the agent's ledger).
    engines, candidates = await two_candidates(nursery, start_llmgw, private_redis.url, cluster_name)
    async with httpx.AsyncClient(timeout=30) as http:
        await wait_for_leader(http, candidates)
        await private_redis.kill()
        with trio.fail_after(10):  # the leader stops before its lease could have expired; nobody takes over
            while any([(await leader_state(http, c))["leading"] for c in candidates]):
                await trio.sleep(0.05)
        for _ in range(3):
            for process in candidates:  # fail-static: both route on the last known table
                response = await http.post(process.url + "/v1/chat/completions", json=PROMPT)
                assert response.status_code == 200, response.text
            assert not any([(await leader_state(http, c))["leading"] for c in candidates])
            await trio.sleep(0.5)
        await private_redis.restart()
        leader, follower = await leader_and_other(http, candidates, timeout=15)
        leader_origin = (await http.get(leader.control_url + "/admin/cluster")).json()["origin"]
        with trio.fail_after(15):
            while not ((await http.get(follower.control_url + "/admin/cluster")).json()["log"]["writer"]
                       or "").startswith(leader_origin + "."):
                await trio.sleep(0.1)
        for process in candidates:
            response = await http.post(process.url + "/v1/chat/completions", json=PROMPT)
            assert response.status_code == 200, response.text
            assert process.returncode is None
    assert all(engine.returncode is None for engine in engines)


@pytest.fixture
async def leader_pair_with_an_agent(cluster: Cluster, redis_url: str, cluster_name: str, tmp_path):
    """``(first serve, the second candidate's Cluster, the agent, its engine's pid by replica)``: two candidates
    with their own identity stores and the cluster secret (every test child's), the first leading, and agent ``a``
    joined with both URLs, its replica up and followed by the second."""
    second = Cluster(cluster.nursery, tmp_path / "second", cluster.engines, fixtures=cluster.fixtures,
                     cwd=cluster.cwd)
    (tmp_path / "second").mkdir()
    for c, name in ((cluster, "first"), (second, "second")):
        c.write_config(candidate_config(tmp_path / f"control-{name}", redis_url, cluster_name))
    first_serve = await cluster.start_serve()
    with trio.fail_after(10):
        while not (await cluster.admin("/health"))["state"]["leader"]["leading"]:
            await trio.sleep(0.05)
    await second.start_serve()
    agent = await cluster.start_agent("a", "tiny-2gpu-a", join=f"{cluster.control_url},{second.control_url}")
    pids = shard_pids(await cluster.settled(1))
    await second.replicas_where("the deployed replica followed", lambda r: all(r.get(n, {}).get("url") for n in pids))
    return first_serve, second, agent, pids


async def test_after_kill_9_of_the_leader_the_agent_follows_the_new_one_which_adopts_its_engine(
        leader_pair_with_an_agent, tmp_path):
    first_serve, second, agent, pids = leader_pair_with_an_agent
    async with httpx.AsyncClient(timeout=30) as http:
        secret = (tmp_path / "agent-a" / "node-secret").read_text()
        killed_at = trio.current_time()
        first_serve.kill(signal.SIGKILL)
        await first_serve.wait_exit()
        # The other candidate leads, the agent reconnects to it (one of its --join URLs) with its node secret and
        # its placement proofs, and the new leader adopts the running engine: same pid, no restart.
        adopted = await second.wait_for("the engine adopted by the new leader", lambda: adopted_on(second, pids),
                                        timeout=30)
        print(f"\nagent re-registered and its engine adopted by the new leader {trio.current_time() - killed_at:.2f} s"
              " after the old one's kill -9")
        assert restarts(adopted) == {name: 0 for name in pids}
        assert (await second.nodes())["a"]["state"] == "connected"
        assert (tmp_path / "agent-a" / "node-secret").read_text() == secret  # known, not joined anew
        assert any(f"connected to {agent_url(second.control_url)}" in line for line in agent.lines)
        response = await http.post(second.data_url + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        assert adopted_pids(await second.replicas()) == pids


async def adopted_on(cluster: Cluster, pids: dict[str, int]) -> dict | None:
    replicas = await cluster.replicas()
    return replicas if all_up(len(pids))(replicas) and adopted_pids(replicas) == pids else None


def adopted_pids(replicas: dict[str, dict]) -> dict[str, int]:
    return {name: (r.get("shards") or [{}])[0].get("pid") for name, r in replicas.items()}


def restarts(replicas: dict[str, dict]) -> dict[str, int]:
    return {name: r["shards"][0]["restarts"] for name, r in replicas.items()}


async def test_a_candidate_whose_control_plane_cannot_start_lets_another_lead_and_keeps_routing(
        nursery, start_llmgw, redis_url, cluster_name, tmp_path):
    broken = tmp_path / "broken-control"
    broken.mkdir()
    (broken / "nodes.json").write_text("{not json")  # an identity store it cannot read
    engines = await start_sims(nursery, 2, env=KV_SIM_ENV, num_blocks=512, block_size=16, time_scale=0, seed=0,
                               extra=KV_SIM_EXTRA)
    config = cluster_config(engines, redis_url, cluster_name)
    first = await start_llmgw(config + f"agents:\n  control_state_dir: {broken}\n")
    async with httpx.AsyncClient(timeout=30) as http:
        with trio.fail_after(10):  # it won the lease, its term failed, and it gave the lease up
            while not any("the control plane cannot start here" in line for line in first.lines):
                await trio.sleep(0.05)
        second = await start_llmgw(config + f"agents:\n  control_state_dir: {tmp_path / 'good-control'}\n")
        assert await wait_for_leader(http, [first, second], timeout=15) is second
        await wait_kv_healthy(first.control_url, len(engines))  # the failed one follows the new leader
        response = await http.post(first.url + "/v1/chat/completions", json=PROMPT)
        assert response.status_code == 200, response.text
        assert first.returncode is None


async def kv_blocks(http: httpx.AsyncClient, process: Child) -> dict[str, int]:
    return {r["name"]: r["blocks"] for r in (await http.get(process.control_url + "/admin/kv")).json()["replicas"]}


async def test_a_new_leader_continues_the_log_and_a_follower_holding_it_loads_no_snapshot(
        nursery, start_llmgw, redis_url, cluster_name):
    engines, candidates = await two_candidates(nursery, start_llmgw, redis_url, cluster_name)
    gateway = await start_llmgw(cluster_config(engines, redis_url, cluster_name), "--role", "gateway")
    await wait_kv_healthy(gateway.control_url, len(engines))
    async with httpx.AsyncClient(timeout=30) as http:
        old, survivor = await leader_and_other(http, candidates)
        for n in range(4):  # blocks in every index, published in the old leader's log
            prompt = {**PROMPT, "messages": [{"role": "user", "content": f"prompt {n} " * 40}]}
            assert (await http.post(old.url + "/v1/chat/completions", json=prompt)).status_code == 200
        with trio.fail_after(10):
            while (await kv_blocks(http, gateway)) != (await kv_blocks(http, old)) or \
                    not sum((await kv_blocks(http, gateway)).values()):
                await trio.sleep(0.05)
        old_writer = (await http.get(old.control_url + "/admin/cluster")).json()["log"]["writer"]
        loaded_before = metric_value((await http.get(gateway.control_url + "/metrics")).text,
                                     "llmgw_cluster_snapshots_total", 'direction="loaded"')
        old.kill(signal.SIGKILL)
        await old.wait_exit()
        new = await wait_for_leader(http, [survivor], timeout=15)
        new_writer = (await http.get(new.control_url + "/admin/cluster")).json()["log"]["writer"]
        with trio.fail_after(15):  # the follower is on the new leader's log...
            while (await http.get(gateway.control_url + "/admin/cluster")).json()["log"]["writer"] != new_writer:
                await trio.sleep(0.05)
        # ...which began with the old one's last batch, so the follower went on without loading any snapshot.
        first = await first_batch_of(redis_url, cluster_name, new_writer)
        assert first[b"n"] == b"1" and first[b"c"].decode().startswith(old_writer + " "), first
        metrics = (await http.get(gateway.control_url + "/metrics")).text
        assert metric_value(metrics, "llmgw_cluster_snapshots_total", 'direction="loaded"') == loaded_before
        assert metric_value(metrics, "llmgw_cluster_snapshots_total", 'direction="skipped",reason="continued"') == 1
        # What the engines store from now on reaches the follower through the new leader's batches.
        prompt = {**PROMPT, "messages": [{"role": "user", "content": "after the failover " * 40}]}
        assert (await http.post(new.url + "/v1/chat/completions", json=prompt)).status_code == 200
        with trio.fail_after(10):
            while (await kv_blocks(http, gateway)) != (await kv_blocks(http, new)):
                await trio.sleep(0.05)
        assert metric_value((await http.get(gateway.control_url + "/metrics")).text, "llmgw_cluster_snapshots_total",
                            'direction="loaded"') == loaded_before


async def first_batch_of(redis_url: str, cluster: str, writer: str) -> dict[bytes, bytes]:
    client = coredis.Redis.from_url(redis_url, decode_responses=False)
    async with client:
        entries = await client.xrange(Keys(cluster).log)
    return next(dict(entry.field_values) for entry in entries if entry.field_values[b"w"] == writer.encode())


async def test_a_role_gateway_process_names_the_leader_to_agents_health_and_status(
        nursery, start_llmgw, redis_url, cluster_name):
    from llmgw.wire.channel import AgentCredentials, UpgradeRefused, WebSocketConnector

    engines, leader, _ = await start_cluster(nursery, start_llmgw, redis_url, cluster_name, followers=0)
    gateway = await start_llmgw(cluster_config(engines, redis_url, cluster_name), "--role", "gateway")
    async with httpx.AsyncClient(timeout=30) as http:
        origin = (await http.get(leader.control_url + "/admin/cluster")).json()["origin"]
        with trio.fail_after(10):
            while ((await leader_state(http, gateway))["holder"] or {}).get("origin") != origin:
                await trio.sleep(0.05)
        state = await leader_state(http, gateway)
        assert state["leading"] is False and state["candidate"] is False
        assert state["holder"]["control_url"] == leader.control_url
        # An agent dialling it is refused as a candidate that does not lead refuses it: 503, naming the leader.
        with pytest.raises(UpgradeRefused) as refused:
            async with WebSocketConnector(gateway.control_url).connect(AgentCredentials(token=TOKEN.encode())):
                pass
        assert refused.value.status == 503 and refused.value.leader == leader.control_url
        assert "not lead" in refused.value.message
        out = await status_at(gateway)
        assert out.startswith(f"CLUSTER {cluster_name}: this process follows (--role gateway); the leader is "
                              f"{origin} at {leader.control_url} (term 1)\n"), out
        assert "REPLICAS (2)" in out


async def test_kill_9_of_the_leader_while_traffic_flows_to_an_agents_replica_fails_nothing_and_it_stays_listed(
        leader_pair_with_an_agent):
    first_serve, second, agent, pids = leader_pair_with_an_agent

    async def kill_9():
        first_serve.kill(signal.SIGKILL)
        await first_serve.wait_exit()

    answers, listings = await through_a_fault(second, pids, kill_9, settle=0.5)
    # Through the switch no request failed at the new leader, and the replica never left its listing: held
    # from the old leader's table (its address, routable) until the re-registered agent's report claimed it.
    assert_nothing_failed(answers, listings)
    assert any(entry and entry.get("held") for entry in listings)  # the new leader's listing, before the claim
    async with httpx.AsyncClient(timeout=30) as http:
        assert metric_value((await http.get(second.control_url + "/metrics")).text,
                            "llmgw_cluster_held_replicas_total", 'outcome="claimed"') >= 1
    assert adopted_pids(await second.replicas()) == pids


async def through_a_fault(at: Cluster, pids: dict[str, int], fault, settle: float) -> tuple[list, list]:
    """``(answers, listings)``: a chat sent to ``at`` every 50 ms, and ``at``'s listing of the (one) replica of
    ``pids``, from 0.5 s before ``fault()`` starts until it is over, ``at`` has adopted the engine (how long after
    the fault's start is printed), and ``settle`` s more."""
    (name,) = pids
    answers: list[tuple[int, str]] = []
    listings: list[dict | None] = []
    stop = trio.Event()
    async with httpx.AsyncClient(timeout=30) as http:

        async def traffic():
            while not stop.is_set():
                response = await http.post(at.data_url + "/v1/chat/completions", json=CHAT)
                answers.append((response.status_code, response.text[:300]))
                await trio.sleep(0.05)

        async def watch():
            while not stop.is_set():
                listings.append((await at.replicas()).get(name))
                await trio.sleep(0.05)

        async with trio.open_nursery() as watching:
            watching.start_soon(traffic)
            watching.start_soon(watch)
            await trio.sleep(0.5)
            started = trio.current_time()
            async with trio.open_nursery() as faulting:  # until the fault is over and the engine adopted
                faulting.start_soon(fault)
                await at.wait_for("the engine adopted by the new leader", lambda: adopted_on(at, pids), timeout=30)
                print(f"\nthe engine adopted by the new leader {trio.current_time() - started:.2f} s after the fault "
                      f"began; {len(answers)} requests so far")
            await trio.sleep(settle)
            stop.set()
    return answers, listings


def assert_nothing_failed(answers: list, listings: list) -> None:
    """Every answer a 200, and the replica listed with its address and up in every listing."""
    assert answers and all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200]
    assert listings and all(entry is not None and entry["url"] and entry["state"] == "up" for entry in listings), \
        [entry and {k: entry.get(k) for k in ("url", "state", "reason", "held")} for entry in listings
         if not (entry and entry["url"] and entry["state"] == "up")]


async def test_a_held_replica_whose_agent_does_not_come_back_leaves_routing_after_the_hold(
        leader_pair_with_an_agent):
    first_serve, second, agent, pids = leader_pair_with_an_agent
    (name,) = pids
    async with httpx.AsyncClient(timeout=30) as http:
        agent.kill(signal.SIGKILL)  # its engine is orphaned: nobody re-registers it with the next leader
        await agent.wait_exit()
        first_serve.kill(signal.SIGKILL)
        await first_serve.wait_exit()
        with trio.fail_after(15):
            while not (await http.get(second.control_url + "/health")).json()["state"]["leader"]["leading"]:
                await trio.sleep(0.05)
        await second.replicas_where("the replica held by the new leader", lambda r: r.get(name, {}).get("held"))
        # heartbeat_interval 0.5 s, lease_ttl 2 s: held for 5.5 + 2 + 0.5 + 1 = 9 s (llmgw.wire.liveness), then out
        # of routing (the control's own entry, waiting for a placement, stays listed without an address).
        listed = await second.replicas_where("the held replica let go", lambda r: not r.get(name, {}).get("url"),
                                             timeout=15)
        assert not listed.get(name, {}).get("held")
        assert metric_value((await http.get(second.control_url + "/metrics")).text,
                            "llmgw_cluster_held_replicas_total", 'outcome="dropped"') == 1


async def test_a_leader_frozen_7s_loses_no_request_at_the_other_candidate_whose_term_adopts_the_agents_engine(
        leader_pair_with_an_agent, cluster):
    from llmgw.wire.channel import AgentCredentials, UpgradeRefused, WebSocketConnector

    first_serve, second, agent, pids = leader_pair_with_an_agent
    (name,) = pids

    async def freeze_7s():
        # The leader freezes (a long GC, a stopped VM): its socket stays open, its lease runs out, the other
        # candidate leads. The agent hears nothing, gives the session up after its silence limit (5.5 s at a
        # 0.5 s heartbeat) and dials its other URL, whose term still holds the replica.
        first_serve.kill(signal.SIGSTOP)
        try:
            await trio.sleep(7)
        finally:
            first_serve.kill(signal.SIGCONT)

    answers, listings = await through_a_fault(second, pids, freeze_7s, settle=1.0)
    assert_nothing_failed(answers, listings)
    async with httpx.AsyncClient(timeout=30) as http:
        assert metric_value((await http.get(second.control_url + "/metrics")).text,
                            "llmgw_cluster_held_replicas_total", 'outcome="dropped"') == 0.0
        replicas = await second.replicas()
        assert adopted_pids(replicas) == pids and restarts(replicas) == {name: 0}
        assert (await second.nodes())["a"]["state"] == "connected"
        # The agent gave the frozen leader up by itself, and dialled its other URL first.
        assert any(f"disconnected from {agent_url(cluster.control_url)}: the control plane said nothing for 5.5s; "
                   f"reconnecting to {agent_url(second.control_url)} in 0.05s" in line for line in agent.lines)
        assert any(f"connected to {agent_url(second.control_url)}" in line for line in agent.lines)
        # Thawed, the old leader finds its term over: it follows, and sends a new agent to the leader.
        assert await wait_for_leader(http, [cluster, second], timeout=15) is second
    with pytest.raises(UpgradeRefused) as refused:
        async with WebSocketConnector(cluster.control_url).connect(AgentCredentials(token=TOKEN.encode())):
            pass
    assert refused.value.status == 503 and refused.value.leader == second.control_url
