"""The reconciler as pure logic: fake nodes (inventory records with stand-in sessions), real placement."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from llmgw import wire
from llmgw.agent.discovery import discover
from llmgw.config import parse_config
from llmgw.control.fingerprint import canonical_profile, profile_fingerprint
from llmgw.control.inventory import NodeRecord, NodeState
from llmgw.control.reconciler import (
    Adopt,
    Command,
    Place,
    Reconciler,
    Retire,
    Unplaceable,
    desired_replicas,
    place_with_plan_all,
)

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
WALL_MS = 1_000_000


def config(replicas: int = 2, *, nodes: int = 1, args: str = "[]", extra_profile: str = "", extra_deployment: str = ""):
    tp = 2 if nodes == 2 else 1
    return parse_config(f"""
agents: {{token: t}}
profiles:
  - name: sim
    engine: sim
    model_path: tiny
    served_model_name: tiny
    tp: {tp}
    nodes: {nodes}
    args: {args}
    api_key: engine-key
{extra_profile}
deployments:
  - profile: sim
    replicas: {replicas}
{extra_deployment}""")


def node(node_id: str, fixture: str | None = "tiny-2gpu-a", *, shards=(), serial: int = 1,
         state: NodeState = NodeState.CONNECTED) -> NodeRecord:
    register = (discover(f"fixture:{NODES / fixture}.json", node_id=node_id, address=f"10.0.0.{ord(node_id[0])}")
                if fixture else wire.Register(node_id=node_id, address="10.0.0.9"))
    return NodeRecord(node_id, register, state=state, session=object(), session_serial=serial,
                      shards={report.shard_id: report for report in shards})


def nodes_of(*records: NodeRecord) -> dict[str, NodeRecord]:
    return {record.node_id: record for record in records}


def report_for(message: wire.StartShard, state=wire.ShardState.READY, pid: int = 100) -> wire.ShardReport:
    return wire.ShardReport(shard_id=message.shard_id, replica_id=message.replica_id, rank=message.rank,
                            node_count=message.node_count, state=state, pid=pid, fingerprint=message.fingerprint,
                            generation=message.generation, gpu_indices=list(message.gpu_indices),
                            endpoint=f"http://127.0.0.1:{9000 + pid}")


def starts(actions) -> list[Command]:
    return [a for a in actions if isinstance(a, Command) and isinstance(a.message, wire.StartShard)]


def run_cluster(cfg, nodes, reconciler=None):
    """Plan once, then let every started shard report READY on its node."""
    reconciler = reconciler or Reconciler(place_with_plan_all)
    desired = desired_replicas(cfg, profile_fingerprint)
    actions = reconciler.plan(desired, nodes, now=0.0, wall_ms=WALL_MS)
    for pid, command in enumerate(starts(actions), start=1):
        nodes[command.node_id].shards[command.message.shard_id] = report_for(command.message, pid=pid)
    return reconciler, desired, actions


def test_places_each_replica_on_its_own_node_with_the_full_start_message():
    cfg = config()
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    reconciler, desired, actions = run_cluster(cfg, nodes)
    assert [a.kind for a in actions] == ["place", "place", "start", "start"]
    first, second = (c.message for c in starts(actions))
    assert {starts(actions)[0].node_id, starts(actions)[1].node_id} == {"a", "b"}  # spread
    assert first.replica_id == "sim-0" and second.replica_id == "sim-1"
    assert first.gpu_indices == [0] and len(first.gpu_uuids) == 1 and first.gpu_uuids[0].startswith("GPU-")
    assert first.http_port == 0 and first.rank == 0 and first.node_count == 1
    assert first.fingerprint == profile_fingerprint(cfg.profile("sim"))
    assert first.generation == WALL_MS and second.generation == WALL_MS + 1  # monotonic
    assert first.profile == wire.ShardProfile(name="sim", engine="sim", model_path="tiny", served_model_name="tiny")
    assert first.engine_api_key == "engine-key"
    # Idempotent: nothing new happened, nothing to do.
    assert reconciler.plan(desired, nodes, now=1.0, wall_ms=WALL_MS + 5) == []


def test_a_reconnected_agent_is_asked_again_only_for_what_it_lost():
    cfg = config()
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    reconciler, desired, actions = run_cluster(cfg, nodes)
    lost = next(c for c in starts(actions) if c.node_id == "a").message
    nodes["a"].shards.clear()  # the agent came back without its shard
    assert reconciler.plan(desired, nodes, now=1.0, wall_ms=WALL_MS) == []  # same session: asked already
    nodes["a"].session_serial = 2
    again = reconciler.plan(desired, nodes, now=1.0, wall_ms=WALL_MS)
    assert [(a.kind, a.node_id, a.message) for a in again] == [("start", "a", lost)]  # same id, same generation


def test_a_restarted_control_plane_adopts_running_shards_without_starting_anything():
    cfg = config()
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    before, desired, _ = run_cluster(cfg, nodes)
    fresh = Reconciler(place_with_plan_all)
    actions = fresh.plan(desired, nodes, now=0.0, wall_ms=WALL_MS + 10_000)
    assert [a.kind for a in actions] == ["adopt", "adopt"]
    assert {a.key for a in fresh.assignments.values()} == {a.key for a in before.assignments.values()}
    assert all(a.origin == "adopted" for a in fresh.assignments.values())
    assert fresh.plan(desired, nodes, now=1.0, wall_ms=WALL_MS + 10_001) == []
    # New generations stay above the adopted ones.
    assert fresh._next_generation(0) > max(a.generation for a in fresh.assignments.values())


def test_nothing_new_is_placed_during_the_grace_but_reported_shards_are_adopted():
    cfg = config()
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    _, desired, _ = run_cluster(cfg, nodes)
    del nodes["b"]  # b has not reconnected yet
    fresh = Reconciler(place_with_plan_all, place_after=10.0)
    actions = fresh.plan(desired, nodes, now=0.0, wall_ms=WALL_MS)
    assert [a.kind for a in actions] == ["adopt"]
    later = fresh.plan(desired, nodes, now=10.0, wall_ms=WALL_MS)
    assert [a.kind for a in later] == ["place", "start"]  # b is still away: its replica goes elsewhere


def test_stale_fingerprints_and_generations_are_stopped_on_the_node_that_runs_them():
    cfg = config(replicas=1)
    stale_profile = wire.ShardReport(shard_id="sim-0-g5-r0", replica_id="sim-0", fingerprint="old",
                                     generation=5, state=wire.ShardState.READY, gpu_indices=[1])
    orphan = wire.ShardReport(shard_id="gone-0-g5-r0", replica_id="gone-0", fingerprint="x", generation=5,
                              state=wire.ShardState.FAILED)
    nodes = nodes_of(node("a", shards=[stale_profile, orphan]))
    reconciler = Reconciler(place_with_plan_all)
    actions = reconciler.plan(desired_replicas(cfg, profile_fingerprint), nodes, now=0.0, wall_ms=WALL_MS)
    assert [a.kind for a in actions] == ["place", "start", "stop", "stop"]
    start = starts(actions)[0].message
    assert start.gpu_indices == [0]  # GPU 1 is held by the stale shard until it stops
    stops = {a.message.shard_id: a.reason for a in actions if a.kind == "stop"}
    assert "old profile" in stops["sim-0-g5-r0"] and "not in the config" in stops["gone-0-g5-r0"]


def test_a_removed_deployment_is_drained_only_after_the_router_released_it():
    cfg = config()
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    reconciler, _, _ = run_cluster(cfg, nodes)
    actions = reconciler.plan({}, nodes, now=1.0, wall_ms=WALL_MS)
    assert [a.kind for a in actions] == ["retire", "retire"]
    assert reconciler.plan({}, nodes, now=1.0, wall_ms=WALL_MS) == []
    retired = sorted(reconciler.assignments.values(), key=lambda a: a.replica_id)
    assert reconciler.release(retired[0].key)
    actions = reconciler.plan({}, nodes, now=1.0, wall_ms=WALL_MS)
    assert [(a.kind, a.message.shard_id) for a in actions] == [("drain", retired[0].leader.shard_id)]
    leader = retired[0].leader
    nodes[leader.node_id].shards[leader.shard_id].state = wire.ShardState.STOPPED
    reconciler.plan({}, nodes, now=1.0, wall_ms=WALL_MS)
    assert retired[0].key not in reconciler.assignments and retired[1].key in reconciler.assignments


def test_a_changed_profile_retires_the_old_replica_and_places_the_new_one():
    nodes = nodes_of(node("a"))
    reconciler, _, _ = run_cluster(config(replicas=1), nodes)
    changed = desired_replicas(config(replicas=1, args='["--seed", "3"]'), profile_fingerprint)
    actions = reconciler.plan(changed, nodes, now=1.0, wall_ms=WALL_MS + 100)
    assert [a.kind for a in actions] == ["retire", "place", "start"]
    assert "profile sim changed" in actions[0].reason
    assert starts(actions)[0].message.gpu_indices == [1]  # the old one still holds GPU 0


def test_a_disconnected_node_is_left_alone_and_takes_no_new_replicas():
    cfg = config(replicas=1)
    nodes = nodes_of(node("a"))
    reconciler, desired, _ = run_cluster(cfg, nodes)
    nodes["a"].state, nodes["a"].session = NodeState.DISCONNECTED, None
    nodes["a"].shards.clear()
    assert reconciler.plan(desired, nodes, now=1.0, wall_ms=WALL_MS) == []  # no stop, no re-placement
    more = desired_replicas(config(replicas=2), profile_fingerprint)
    actions = reconciler.plan(more, nodes, now=1.0, wall_ms=WALL_MS)
    assert [a.kind for a in actions] == ["unplaced"]
    assert dict(actions[0].reasons)["a"].startswith("disconnected")


def test_a_serving_copy_reported_late_wins_over_a_replica_still_starting():
    cfg = config(replicas=1)
    nodes = nodes_of(node("a"))
    _, desired, actions = run_cluster(cfg, nodes)
    running = nodes["a"].shards  # what the late node "b" actually runs, moved there
    late = node("b", "tiny-2gpu-b", shards=[dataclasses.replace(r) for r in running.values()])
    fresh = Reconciler(place_with_plan_all)
    only_a = nodes_of(node("a"))
    placed = fresh.plan(desired, only_a, now=0.0, wall_ms=WALL_MS + 50)  # placed anew before b came back
    assert [a.kind for a in placed] == ["place", "start"]
    both = nodes_of(only_a["a"], late)
    actions = fresh.plan(desired, both, now=1.0, wall_ms=WALL_MS + 60)
    assert [a.kind for a in actions] == ["retire", "adopt"]
    assert isinstance(actions[0], Retire) and not actions[0].assignment.drain
    assert isinstance(actions[1], Adopt) and actions[1].assignment.node_ids == ["b"]
    assert fresh.release(actions[0].assignment.key)
    only_a["a"].shards[starts(placed)[0].message.shard_id] = report_for(starts(placed)[0].message,
                                                                        wire.ShardState.STARTING)
    stop = fresh.plan(desired, both, now=1.0, wall_ms=WALL_MS + 60)
    assert [(a.kind, a.node_id) for a in stop] == [("stop", "a")]


def test_a_two_node_profile_is_placed_as_a_gang_or_not_at_all():
    cfg = config(replicas=1, nodes=2)
    reconciler = Reconciler(place_with_plan_all)
    desired = desired_replicas(cfg, profile_fingerprint)
    one = nodes_of(node("a"))
    actions = reconciler.plan(desired, one, now=0.0, wall_ms=WALL_MS)
    assert len(actions) == 1 and isinstance(actions[0], Unplaceable) and actions[0].first
    assert "gang needs 2 nodes, 1 fits" in dict(actions[0].reasons)["a"]
    assert reconciler.plan(desired, one, now=1.0, wall_ms=WALL_MS) == []  # reported once, not every pass
    both = nodes_of(one["a"], node("b", "tiny-2gpu-b"))
    actions = reconciler.plan(desired, both, now=2.0, wall_ms=WALL_MS)
    assert isinstance(actions[0], Place)
    messages = sorted((c.message for c in starts(actions)), key=lambda m: m.rank)
    assert [(m.rank, m.node_count) for m in messages] == [(0, 2), (1, 2)]
    assert [c.node_id for c in sorted(starts(actions), key=lambda c: c.message.rank)] == ["a", "b"]
    assert {m.leader_address for m in messages} == {both["a"].address}
    assert {m.leader_port for m in messages} == {29500}
    assert all(len(m.gpu_indices) == 1 for m in messages)
    assert len({m.replica_id for m in messages}) == 1 and len({m.generation for m in messages}) == 1


def test_an_incomplete_reported_gang_is_not_adopted():
    cfg = config(replicas=1, nodes=2)
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    _, desired, _ = run_cluster(cfg, nodes)
    del nodes["b"]
    fresh = Reconciler(place_with_plan_all, place_after=5.0)
    assert fresh.plan(desired, nodes, now=0.0, wall_ms=WALL_MS) == []  # half a gang: wait for the other half
    actions = fresh.plan(desired, nodes, now=5.0, wall_ms=WALL_MS)
    assert [a.kind for a in actions] == ["unplaced", "stop"]  # after the grace: not adoptable, stopped


def test_owner_names_the_node_a_shard_was_placed_on():
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    reconciler, _, actions = run_cluster(config(replicas=1), nodes)
    command = starts(actions)[0]
    assignment, slot = reconciler.owner(command.message.shard_id)
    assert slot.node_id == command.node_id and assignment.replica_id == "sim-0"
    assert reconciler.owner("nobody-g1-r0") is None


def test_a_replica_that_served_is_never_re_pointed_to_a_copy_reported_by_another_node():
    cfg = config(replicas=1)
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    reconciler, desired, actions = run_cluster(cfg, nodes)
    (command,) = starts(actions)
    owner_node, start = command.node_id, command.message
    other = "b" if owner_node == "a" else "a"
    assert reconciler.plan(desired, nodes, now=1.0, wall_ms=WALL_MS + 1) == []  # its leader was Ready: it served
    # Another node reports a Ready copy of the same replica (same fingerprint, a newer generation)...
    copy = dataclasses.replace(report_for(start), shard_id="sim-0-g99999999-r0", generation=99_999_999,
                               endpoint="http://10.6.6.6:8000")
    nodes[other].shards[copy.shard_id] = copy
    # ...and the real engine crashes: the replica waits for its own engine; the copy is stopped as a stray.
    nodes[owner_node].shards[start.shard_id] = report_for(start, wire.ShardState.FAILED)
    later = reconciler.plan(desired, nodes, now=2.0, wall_ms=WALL_MS + 2)
    assert not [a for a in later if a.kind in ("adopt", "retire")]
    (assignment,) = reconciler.assignments.values()
    assert assignment.node_ids == [owner_node] and assignment.leader.shard_id == start.shard_id
    assert ("stop", other, copy.shard_id) in [(a.kind, a.node_id, a.message.shard_id) for a in later
                                                if isinstance(a, Command)]


def test_an_unproven_report_is_never_adopted_and_is_stopped_on_its_node():
    cfg = config(replicas=1)
    nodes = nodes_of(node("a"))
    _, desired, _ = run_cluster(cfg, nodes)
    nodes["a"].unproven = set(nodes["a"].shards)  # the control plane could not verify their placement proofs
    fresh = Reconciler(place_with_plan_all)
    actions = fresh.plan(desired, nodes, now=0.0, wall_ms=WALL_MS + 10_000)
    assert "adopt" not in [a.kind for a in actions]
    stops = [a for a in actions if isinstance(a, Command) and isinstance(a.message, wire.StopShard)]
    assert [(s.node_id, s.message.shard_id) for s in stops] == [("a", sid) for sid in nodes["a"].shards]
    assert "placement is not proven" in stops[0].reason


def test_the_start_message_tells_the_agent_how_the_router_keys_kv_blocks():
    """Content keys unless the profile's kv_index options say ``key_function: vllm`` (engine hashes)."""
    for options, mode in (("", "content"), ("    routing_options: {key_function: content}\n", "content"),
                          ("    routing_options: {key_function: vllm}\n", "engine")):
        cfg = config(1, extra_profile="    kv_events: true\n    routing: kv_index\n" + options)
        (start,) = starts(run_cluster(cfg, nodes_of(node("a")))[2])
        assert (start.message.profile.kv_events, start.message.profile.kv_key_mode) == (True, mode)
    # Engine hashes change how the engine is started (its hash algorithm and seed): a new fingerprint; content keys
    # keep the fingerprint the profile had before the key mode counted.
    stock, engine = (config(1, extra_profile="    kv_events: true\n    routing: kv_index\n" + options).profile("sim")
                     for options in ("", "    routing_options: {key_function: vllm}\n"))
    assert "kv_key_mode" not in canonical_profile(stock) and canonical_profile(engine)["kv_key_mode"] == "engine"
    assert profile_fingerprint(stock) != profile_fingerprint(engine)


BIG = """    sleep_mode: true
  - name: big
    engine: sim
    model_path: big
    tp: 2"""  # another model, on two GPUs of one node: none placed until asked for (below)
BIG_DEPLOYMENT = """  - profile: big
    replicas: 0"""


def _scaled_to(cfg, count: int, big: int = 0):
    return desired_replicas(cfg, profile_fingerprint, counts={"sim": count, "big": big})


def _parked_after_scale_down(sleep_mode: bool):
    """Two replicas running, one scaled down with keep_warm and released by the router: the plan that parks it."""
    cfg = config(extra_profile=BIG if sleep_mode else "", extra_deployment=BIG_DEPLOYMENT if sleep_mode else "")
    nodes = nodes_of(node("a"), node("b", "tiny-2gpu-b"))
    reconciler, _, _ = run_cluster(cfg, nodes)
    reconciler.keep_warm = lambda assignment: 60.0
    assert [a.kind for a in reconciler.plan(_scaled_to(cfg, 1), nodes, now=1.0, wall_ms=WALL_MS)] == ["retire"]
    retired = next(a for a in reconciler.assignments.values() if a.retiring)
    assert reconciler.release(retired.key)
    return cfg, nodes, reconciler, retired, reconciler.plan(_scaled_to(cfg, 1), nodes, now=1.0, wall_ms=WALL_MS)


def test_a_scaled_down_sleep_mode_replica_is_put_to_sleep_then_woken_by_the_next_step_up():
    cfg, nodes, reconciler, retired, actions = _parked_after_scale_down(sleep_mode=True)
    leader = retired.leader
    assert [(a.kind, a.node_id, a.message.shard_id) for a in actions] == [("sleep", leader.node_id, leader.shard_id)]
    assert actions[0].message.level == 1 and "sleep_mode" in actions[0].reason
    assert reconciler.parked == {leader.shard_id: 61.0} and retired.key not in reconciler.assignments
    report = nodes[leader.node_id].shards[leader.shard_id]
    assert reconciler.plan(_scaled_to(cfg, 1), nodes, now=2.0, wall_ms=WALL_MS) == []  # asked once
    report.state = wire.ShardState.SLEEPING
    assert reconciler.plan(_scaled_to(cfg, 1), nodes, now=3.0, wall_ms=WALL_MS) == []  # asleep, kept

    # The next step up adopts the sleeping engine (same shard, no start) and wakes it.
    actions = reconciler.plan(_scaled_to(cfg, 2), nodes, now=4.0, wall_ms=WALL_MS)
    assert [a.kind for a in actions] == ["adopt", "wake"]
    assert "woke it (a hot start)" in actions[0].reason
    assert actions[1].message == wire.WakeShard(leader.shard_id, actions[1].reason, 600.0)
    assert reconciler.parked == {} and reconciler.active()[retired.replica_id].slots == retired.slots
    assert reconciler.plan(_scaled_to(cfg, 2), nodes, now=5.0, wall_ms=WALL_MS) == []  # waking: asked once
    report.state = wire.ShardState.WAKING
    assert reconciler.plan(_scaled_to(cfg, 2), nodes, now=6.0, wall_ms=WALL_MS) == []
    report.state = wire.ShardState.READY
    assert reconciler.plan(_scaled_to(cfg, 2), nodes, now=7.0, wall_ms=WALL_MS) == []


def test_an_engine_that_does_not_wake_is_started_cold_in_its_place():
    cfg, nodes, reconciler, retired, _ = _parked_after_scale_down(sleep_mode=True)
    leader = retired.leader
    report = nodes[leader.node_id].shards[leader.shard_id]
    report.state = wire.ShardState.SLEEPING
    assert [a.kind for a in reconciler.plan(_scaled_to(cfg, 2), nodes, now=2.0, wall_ms=WALL_MS)] == ["adopt", "wake"]
    report.state, report.reason = wire.ShardState.STOPPED, "did not wake: POST /wake_up: HTTP 500"  # the agent's
    actions = reconciler.plan(_scaled_to(cfg, 2), nodes, now=3.0, wall_ms=WALL_MS)
    assert [(a.kind, a.node_id, a.message.shard_id) for a in actions] == [("start", leader.node_id, leader.shard_id)]
    assert actions[0].reason.startswith("stopped (did not wake")
    assert actions[0].message.profile.sleep_mode  # started cold, with sleep mode again


def test_a_sleeping_engine_is_stopped_when_its_time_is_up_or_its_gpus_are_wanted():
    cfg, nodes, reconciler, retired, _ = _parked_after_scale_down(sleep_mode=True)
    leader = retired.leader
    nodes[leader.node_id].shards[leader.shard_id].state = wire.ShardState.SLEEPING
    # Another model's replica needs two GPUs of one node: each node has one held (a replica, the sleeping engine).
    actions = reconciler.plan(_scaled_to(cfg, 1, big=1), nodes, now=2.0, wall_ms=WALL_MS)
    assert [(a.kind, getattr(a, "replica_id", "")) for a in actions] == [("unplaced", "big-0"), ("stop", "")]
    assert actions[1].message.shard_id == leader.shard_id
    assert "until a replica could not be placed" in actions[1].reason
    nodes[leader.node_id].shards[leader.shard_id].state = wire.ShardState.STOPPED  # its GPUs are free: big fits
    assert [a.kind for a in reconciler.plan(_scaled_to(cfg, 1, big=1), nodes, now=3.0, wall_ms=WALL_MS)] == [
        "place", "start"]
    cfg, nodes, reconciler, retired, _ = _parked_after_scale_down(sleep_mode=True)
    actions = reconciler.plan(_scaled_to(cfg, 1), nodes, now=62.0, wall_ms=WALL_MS)
    assert [(a.kind, a.message.shard_id) for a in actions] == [("stop", retired.leader.shard_id)]
    assert "no step up adopted it in time" in actions[0].reason


def test_without_sleep_mode_a_parked_engine_is_kept_awake():
    _, _, reconciler, retired, actions = _parked_after_scale_down(sleep_mode=False)
    assert actions == [] and retired.leader.shard_id in reconciler.parked


def test_sleep_mode_is_in_the_fingerprint_only_when_on():
    plain, asleep = config(), config(extra_profile="    sleep_mode: true")
    assert "sleep_mode" not in canonical_profile(plain.profile("sim"))
    assert profile_fingerprint(plain.profile("sim")) != profile_fingerprint(asleep.profile("sim"))
