"""``llmgw bench fault --gateways N``: several gateways sharing state through Redis, a steady load spread over them,
while a follower gateway and then Redis itself are killed.

Real processes on loopback (:mod:`.cluster_rig`): two simulators with KV events, a
private ``redis-server``, a control ``llmgw serve`` and ``N - 1`` ``--role gateway``
followers (``state.load_ttl`` ``--load-ttl``). The load of :mod:`.fault_load` runs
throughout, request *n* sent to gateway *n mod N* (a connection refused is sent again
to the next gateway, as a load balancer would). Each fault gets ``--duration``
seconds of load, half before the ``SIGKILL`` and half after the recovery:

- **gateway**: the last follower is killed. Requests in flight inside it fail
  (counted on its row, and all must have started before it was gone); the other
  gateways must fail none. *Load gone*: from the kill until that gateway's load
  reports expired in each survivor's view (its origin left ``/admin/cluster``
  ``peers``, so its requests no longer count in their ``peer_inflight``). It is
  then started again on its ports, and *back* is when it routes with an index
  equal to the control process's.
- **primary** (``--redis sentinel``, instead of **redis**): the gateways use
  ``state.sentinel``; the primary is killed and not started again: Redis is
  back when the sentinel names its replica as the new primary. Measured as
  **redis**.
- **redis**: ``redis-server`` killed, started again on the same port
  ``--redis-down`` seconds later. No request may fail anywhere (routing never
  waits for Redis). Per gateway: when ``/health`` said ``state.degraded`` (from
  the kill) and for how long, when it was live again (from Redis's return), and
  for each follower, when its ``/admin/kv`` blocks per replica equal the control
  process's again (from Redis's return; read between two reads of the control's,
  as the load keeps changing them). That they differed just before Redis came
  back (the follower kept its last state while the engines went on storing) is
  recorded too.

Prints a Markdown table; ``--json`` writes it all.
"""

from __future__ import annotations

import collections
import contextlib
import os
import platform
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import trio

from ..testing.metrics import samples
from .cluster_rig import CONTROL, ClusterRig, GatewayProcess
from .fault_load import LoadSettings, PhaseCounts, SteadyLoad

LOAD_GONE_TARGET_S = 2.0
INDEX_EQUAL_TARGET_S = 5.0
NEW_LEADER_TARGET_S = 3.0
POLL = 0.02


@dataclass
class GatewayOutcome:
    gateway: str
    role: str
    requests: int  # ended with their last attempt on this gateway
    failed: dict[str, int]  # outcome -> count (in_flight, stream_cut, http_503, ...)
    refused: int  # connections this gateway refused (sent on to the next one)
    load_gone_s: float | None = None  # gateway fault, survivors: kill -> the victim's reports expired here
    degraded_after_s: float | None = None  # redis fault: kill -> /health said degraded
    degraded_for_s: float | None = None  # redis fault: how long it said so
    live_after_return_s: float | None = None  # redis fault: Redis back -> /health not degraded
    index_equal_after_return_s: float | None = None  # redis fault, followers: Redis back -> /admin/kv == control's
    index_differed_before_return: bool | None = None  # redis fault, followers: it did differ while Redis was away


@dataclass
class ClusterFaultResult:
    fault: str
    victim: str | None
    sent: int
    lost_before_gone: bool  # every in_flight/stream_cut request started before the killed process was gone
    victim_inflight_at_kill: int | None  # gateway fault: its requests in flight, as the survivors last saw them
    back_s: float | None  # gateway fault: kill -> started again, routing with the control's index
    down_s: float | None  # redis fault: how long Redis was away
    gateways: list[GatewayOutcome] = field(default_factory=list)
    new_leader: str | None = None  # leader fault: the candidate that took over; redis fault: the leader after
    new_leader_s: float | None = None  # leader fault: kill -> it leads; redis fault: Redis back -> a leader
    leaderless_while_down: bool | None = None  # redis fault: no process led at any poll while Redis was away
    index_equal_s: float | None = None  # leader fault: kill -> every follower's index equals the new leader's
    engines_same_pids: bool | None = None  # leader and redis faults: no simulator restarted (static replicas)
    snapshots_loaded: int | None = None  # leader fault: snapshots the surviving followers loaded until index_equal_s
    continued: int | None = None  # leader fault: of those followers, how many went on with the new log, no snapshot

    def failed_elsewhere(self) -> int:
        return sum(sum(g.failed.values()) for g in self.gateways if g.gateway != self.victim)


def outcomes(rig: ClusterRig, counts: PhaseCounts) -> list[GatewayOutcome]:
    rows = []
    for gateway in rig.gateways:
        by_outcome = counts.by_target.get(gateway.url) or collections.Counter()
        rows.append(GatewayOutcome(gateway.name, gateway.role, sum(by_outcome.values()),
                                   {k: n for k, n in by_outcome.items() if k != "ok"},
                                   counts.refused_by_target.get(gateway.url, 0)))
    return rows


async def poll_until(what: str, check, timeout: float, interval: float = POLL):
    """``await check()`` until it returns something other than None (HTTP errors count as not yet)."""
    with trio.fail_after(timeout):
        while True:
            try:
                value = await check()
            except (httpx.HTTPError, ValueError, KeyError):
                value = None
            if value is not None:
                return value
            await trio.sleep(interval)


async def index_equal(rig: ClusterRig, follower: GatewayProcess) -> bool:
    """The follower's blocks per replica equal the control's, read just before or just after."""
    before = await rig.kv_blocks(rig.control)
    own = await rig.kv_blocks(follower)
    return own == before or own == await rig.kv_blocks(rig.control)


async def gateway_fault(rig: ClusterRig, load: SteadyLoad, duration: float) -> ClusterFaultResult:
    victim = rig.followers[-1]
    survivors = [g for g in rig.gateways if g is not victim]
    load.phase = "gateway"
    await trio.sleep(duration / 2)
    origin = (await rig.cluster_view(victim))["origin"]
    seen = [(await rig.cluster_view(g))["peers"].get(origin, {}).get("inflight", {}) for g in survivors]
    inflight = max(sum(view.values()) for view in seen)
    gone: dict[str, float] = {}

    async def load_gone(gateway: GatewayProcess) -> None:
        async def check():
            return True if origin not in (await rig.cluster_view(gateway))["peers"] else None
        await poll_until(f"{victim.name}'s load gone from {gateway.name}'s view", check, 30)
        gone[gateway.name] = time.monotonic() - killed_at

    killed_at = time.monotonic()
    await victim.kill()
    gone_at = time.monotonic()
    async with trio.open_nursery() as nursery:
        for gateway in survivors:
            nursery.start_soon(load_gone, gateway)
    await victim.start(rig.nursery)
    await rig.wait_kv_healthy(victim)

    async def caught_up():
        return True if await index_equal(rig, victim) else None

    await poll_until(f"{victim.name} back with the control's index", caught_up, 60)
    back_s = time.monotonic() - killed_at
    await trio.sleep(duration / 2)
    await load.pause()
    counts = load.phases["gateway"]
    load.resume()
    rows = outcomes(rig, counts)
    for row in rows:
        row.load_gone_s = round(gone[row.gateway], 3) if row.gateway in gone else None
    return ClusterFaultResult("gateway", victim.name, counts.sent(),
                              all(t <= gone_at for t in counts.lost_started_at), inflight, round(back_s, 3), None,
                              rows)


async def wait_for_leader(rig: ClusterRig, candidates: list[GatewayProcess], what: str) -> GatewayProcess:
    """The candidate that leads, once one does; the rig's control process from then on."""
    async def elected():
        for candidate in candidates:
            if await rig.leading(candidate):
                return candidate
        return None

    leader = await poll_until(what, elected, 60)
    rig.lead_with(leader)
    return leader


async def leader_fault(rig: ClusterRig, load: SteadyLoad, duration: float) -> ClusterFaultResult:
    """``kill -9`` of the leader: time until another candidate leads, and until every follower's index equals
    the new leader's; failed requests on the survivors; the engines' pids (static simulators: never touched)."""
    victim = rig.control
    candidates = [g for g in rig.followers if g.role == CONTROL]
    pids = [sim.pid for sim in rig.sims]
    load.phase = "leader"
    await trio.sleep(duration / 2)
    before = [await snapshot_counts(rig, g) for g in rig.followers if g is not victim]
    killed_at = time.monotonic()
    await victim.kill()
    gone_at = time.monotonic()

    leader = await wait_for_leader(rig, candidates, "another candidate leads")
    new_leader_s = time.monotonic() - killed_at
    survivors = [g for g in rig.followers if g is not victim]

    async def all_equal():
        return True if all([await index_equal(rig, g) for g in survivors]) else None

    await poll_until("every follower's index equal to the new leader's", all_equal, 60)
    index_equal_s = time.monotonic() - killed_at
    after = [await snapshot_counts(rig, g) for g in survivors]
    await victim.start(rig.nursery)  # a candidate again: it follows now
    await rig.wait_kv_healthy(victim)
    await trio.sleep(duration / 2)
    await load.pause()
    counts = load.phases["leader"]
    load.resume()
    return ClusterFaultResult("leader", victim.name, counts.sent(),
                              all(t <= gone_at for t in counts.lost_started_at), None, None, None,
                              outcomes(rig, counts), leader.name, round(new_leader_s, 3),
                              index_equal_s=round(index_equal_s, 3),
                              snapshots_loaded=sum(a[0] - b[0] for a, b in zip(after, before)),
                              continued=sum(a[1] > b[1] for a, b in zip(after, before)),
                              engines_same_pids=[sim.pid for sim in rig.sims] == pids and
                              all(sim.returncode is None for sim in rig.sims))


async def snapshot_counts(rig: ClusterRig, gateway: GatewayProcess) -> tuple[int, int]:
    """``(snapshots loaded, logs continued without one)`` by ``gateway`` so far (its ``/metrics``)."""
    parsed = samples((await rig.http.get(gateway.control_url + "/metrics")).text)
    return (int(sum(value for key, value in parsed.items()
                    if key.startswith("llmgw_cluster_snapshots_total{") and 'direction="loaded"' in key)),
            int(parsed.get('llmgw_cluster_snapshots_total{direction="skipped",reason="continued"}', 0)))


@dataclass
class HealthWatch:
    """``/health``'s ``state.degraded`` of one gateway, polled: when it first said so and when it stopped."""

    degraded_at: float | None = None
    live_at: float | None = None


async def watch_health(rig: ClusterRig, gateway: GatewayProcess, watch: HealthWatch) -> None:
    while True:
        try:
            state = (await rig.http.get(gateway.control_url + "/health")).json()["state"]
        except (httpx.HTTPError, ValueError, KeyError):
            state = None
        now = time.monotonic()
        if state is not None:
            if state["degraded"] and watch.degraded_at is None:
                watch.degraded_at = now
            elif not state["degraded"] and watch.degraded_at is not None and watch.live_at is None:
                watch.live_at = now
        await trio.sleep(POLL)


async def redis_fault(rig: ClusterRig, load: SteadyLoad, duration: float, down: float) -> ClusterFaultResult:
    """``redis-server`` killed, and started again on its port ``down`` seconds later."""
    async def outage(returning: trio.Event) -> dict[str, bool]:
        await rig.redis.kill()
        await trio.sleep(down)
        differed = {f.name: not await index_equal(rig, f) for f in rig.followers}  # fail-static meanwhile
        returning.set()  # from here a candidate may be elected: the restarted server answers before restart() returns
        await rig.redis.restart()
        return differed

    return await _outage(rig, load, duration, "redis", outage)


async def primary_fault(rig: ClusterRig, load: SteadyLoad, duration: float) -> ClusterFaultResult:
    """The Redis primary killed behind Sentinel: over when the sentinel names its replica as the new primary."""
    group = rig.sentinel
    assert group is not None, "a rig opened with sentinel=True"

    async def outage(returning: trio.Event) -> dict[str, bool]:
        old = await group.primary_port()
        await group.server_on(old).kill()

        async def promoted():
            return True if await group.primary_port() != old else None

        await poll_until("the sentinel promotes the replica", promoted, 60, interval=0.05)
        returning.set()
        return {}

    return await _outage(rig, load, duration, "primary", outage)


async def _outage(rig: ClusterRig, load: SteadyLoad, duration: float, fault: str,
                  outage: Callable[[trio.Event], Awaitable[dict[str, bool]]]) -> ClusterFaultResult:
    """Load for ``duration / 2``, then ``outage(returning)`` (Redis gone, until it is back; it sets ``returning``
    as Redis starts to come back, and says which followers' indexes differed from the control's meanwhile), each
    gateway's health and each follower's index watched until all are live and equal again, then ``duration / 2``
    more."""
    load.phase = fault
    await trio.sleep(duration / 2)
    watches = {g.name: HealthWatch() for g in rig.gateways}
    equal_after: dict[str, float] = {}
    candidates = [g for g in rig.gateways if g.role == CONTROL]
    pids = [sim.pid for sim in rig.sims]
    led_while_down: list[str] = []

    async def watch_leaders(until: trio.Event) -> None:
        await trio.sleep(rig.lease_ttl + 0.5)  # the leader may lead until its lease's deadline
        while not until.is_set():
            for candidate in candidates:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    if await rig.leading(candidate) and not until.is_set():
                        led_while_down.append(candidate.name)
            await trio.sleep(POLL)

    async with trio.open_nursery() as nursery:
        for gateway in rig.gateways:
            nursery.start_soon(watch_health, rig, gateway, watches[gateway.name])
        back = trio.Event()
        if rig.redis_held_leases:
            nursery.start_soon(watch_leaders, back)
        killed_at = time.monotonic()
        differed = await outage(back)
        returned_at = time.monotonic()
        leader = None
        if rig.redis_held_leases:
            leader = await wait_for_leader(rig, candidates, "a leader once Redis is back")
            leader_s = time.monotonic() - returned_at

        async def follower_equal(follower: GatewayProcess) -> None:
            async def check():
                return True if await index_equal(rig, follower) else None
            await poll_until(f"{follower.name}'s index equal to the control's", check, 60)
            equal_after[follower.name] = time.monotonic() - returned_at

        async with trio.open_nursery() as followers:
            for follower in rig.followers:
                followers.start_soon(follower_equal, follower)

        async def all_live():
            return True if all(w.live_at is not None or w.degraded_at is None for w in watches.values()) else None

        await poll_until("every gateway live again", all_live, 60)
        nursery.cancel_scope.cancel()
    await trio.sleep(duration / 2)
    await load.pause()
    counts = load.phases[fault]
    load.resume()
    rows = outcomes(rig, counts)
    for row in rows:
        watch = watches[row.gateway]
        if watch.degraded_at is not None:
            row.degraded_after_s = round(watch.degraded_at - killed_at, 3)
            if watch.live_at is not None:
                row.degraded_for_s = round(watch.live_at - watch.degraded_at, 3)
        if watch.live_at is not None:
            row.live_after_return_s = round(max(0.0, watch.live_at - returned_at), 3)
        if row.gateway in equal_after:
            row.index_equal_after_return_s = round(equal_after[row.gateway], 3)
            row.index_differed_before_return = differed.get(row.gateway)
    result = ClusterFaultResult(fault, None, counts.sent(), all(t <= killed_at for t in counts.lost_started_at),
                                None, None, round(returned_at - killed_at, 3), rows)
    if leader is not None:
        result.new_leader, result.new_leader_s = leader.name, round(leader_s, 3)
        result.leaderless_while_down = not led_while_down
        result.engines_same_pids = [sim.pid for sim in rig.sims] == pids and \
            all(sim.returncode is None for sim in rig.sims)
    return result


def markdown(results: list[ClusterFaultResult]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    lines = ["| fault | gateway | requests | failed | refused, sent to the next | killed one's load gone from its view "
             "| degraded: seen after / for | live again after Redis is back | index == leader's after Redis is back |",
             "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        fault = {"gateway": f"kill -9 {result.victim}", "redis": f"kill -9 redis ({s(result.down_s)} down)",
                 "leader": f"kill -9 {result.victim} (the leader)",
                 "primary": f"kill -9 redis primary (promoted after {s(result.down_s)})"}[result.fault]
        for g in result.gateways:
            failed = ", ".join(f"{n} {kind}" for kind, n in sorted(g.failed.items())) or "0"
            degraded = "-" if g.degraded_after_s is None else f"{s(g.degraded_after_s)} / {s(g.degraded_for_s)}"
            equal_cell = s(g.index_equal_after_return_s) + (" (had differed)" if g.index_differed_before_return else "")
            name = f"{g.gateway} (killed)" if g.gateway == result.victim else g.gateway
            lines.append(f"| {fault} | {name} | {g.requests} | {failed} | {g.refused} | {s(g.load_gone_s)} "
                         f"| {degraded} | {s(g.live_after_return_s)} | {equal_cell} |")
    lines.append("")
    for result in results:
        if result.fault == "leader":
            lost = sum(sum(g.failed.values()) for g in result.gateways if g.gateway == result.victim)
            engines = "the same pids, never restarted" if result.engines_same_pids else "RESTARTED"
            lines.append(
                f"- kill -9 of the leader {result.victim}: {result.new_leader} led after {s(result.new_leader_s)} "
                f"(target <= {NEW_LEADER_TARGET_S:g} s); every follower's index equal to the new leader's "
                f"{s(result.index_equal_s)} after the kill ({result.continued} of "
                f"{len([g for g in result.gateways if g.gateway not in (result.victim, result.new_leader)])} "
                f"followers went on with the new leader's log, {result.snapshots_loaded} snapshots loaded); "
                f"{result.failed_elsewhere()} failed on the other gateways "
                f"(target 0); {lost} lost in flight on it ({'all' if result.lost_before_gone else 'NOT all'} started "
                f"before it was gone); simulators {engines} "
                f"(static replicas: no agent to re-register)")
            continue
        if result.fault == "gateway":
            gone = max((g.load_gone_s for g in result.gateways if g.load_gone_s is not None), default=None)
            lost = sum(sum(g.failed.values()) for g in result.gateways if g.gateway == result.victim)
            lines.append(
                f"- kill -9 of {result.victim} ({result.victim_inflight_at_kill} requests in flight there, as its "
                f"peers last saw): {result.failed_elsewhere()} failed on the other gateways (target 0); {lost} lost "
                f"in flight on it ({'all' if result.lost_before_gone else 'NOT all'} started before it was gone); "
                f"its load left every survivor's view after {s(gone)} at most (target <= {LOAD_GONE_TARGET_S:g} s); "
                f"started again and caught up after {s(result.back_s)}")
        else:
            failed_anywhere = sum(sum(g.failed.values()) for g in result.gateways)
            equal = max((g.index_equal_after_return_s for g in result.gateways
                         if g.index_equal_after_return_s is not None), default=None)
            what = ("of redis, back" if result.fault == "redis"
                    else "of the redis primary, its replica promoted by the sentinel")
            lines.append(f"- kill -9 {what} after {s(result.down_s)}: {failed_anywhere} failed on every "
                         f"gateway (target 0); every follower's index equal to the leader's {s(equal)} after Redis "
                         f"was back at most (target <= {INDEX_EQUAL_TARGET_S:g} s)")
            if result.new_leader is not None:
                lines.append(f"  - leader: {'none' if result.leaderless_while_down else 'SOME'} while Redis was away "
                             f"(after the old one's lease); {result.new_leader} led {s(result.new_leader_s)} after "
                             f"Redis was back; simulators "
                             f"{'the same pids' if result.engines_same_pids else 'RESTARTED'}")
    return "\n".join(lines)


async def run(args) -> dict:
    settings = LoadSettings.from_args(args)
    load_before = os.getloadavg()
    results: list[ClusterFaultResult] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-fault-cluster-") as workdir:
        candidates = 2 if args.gateways >= 3 else 1  # the leader, one standby, and --role gateway followers
        async with ClusterRig.open(Path(workdir), followers=args.gateways - 1, sims=args.replicas,
                                   time_scale=1.0, sentinel=args.redis == "sentinel", candidates=candidates,
                                   load_ttl=f"{args.load_ttl:g}s") as rig:
            load = SteadyLoad([g.url for g in rig.gateways], settings)
            async with load.running():
                await trio.sleep(args.duration / 2)  # warm-up
                results.append(await gateway_fault(rig, load, args.duration))
                print("  gateway: done", flush=True)
                if candidates > 1:
                    results.append(await leader_fault(rig, load, args.duration))
                    print("  leader: done", flush=True)
                if rig.sentinel is not None:
                    results.append(await primary_fault(rig, load, args.duration))
                    print("  redis primary: done", flush=True)
                else:
                    results.append(await redis_fault(rig, load, args.duration, args.redis_down))
                    print("  redis: done", flush=True)
            gateways = {g.name: {"role": g.role, "url": g.url, "control_url": g.control_url} for g in rig.gateways}
    return {"mode": "cluster",
            "settings": asdict(settings) | {"duration_s": args.duration, "replicas": args.replicas,
                                            "gateways": args.gateways, "redis": args.redis,
                                            "redis_down_s": args.redis_down,
                                            "load_ttl_s": args.load_ttl},
            "targets": {"failed_elsewhere": 0, "load_gone_s": LOAD_GONE_TARGET_S, "new_leader_s": NEW_LEADER_TARGET_S,
                        "index_equal_after_return_s": INDEX_EQUAL_TARGET_S},
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "load_average_before": load_before, "load_average_after": os.getloadavg()},
            "gateways": gateways,
            "results": [asdict(r) for r in results]}


def result_from_dict(data: dict) -> ClusterFaultResult:
    return ClusterFaultResult(**{**data, "gateways": [GatewayOutcome(**g) for g in data["gateways"]]})
