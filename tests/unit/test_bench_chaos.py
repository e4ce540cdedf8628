"""The parts of ``llmgw bench chaos``: its schedule, the soak's plan and slopes, the table, the cuttable TCP proxy,
the Trio task count the soak samples, and the routing options it adds to every process's config."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import trio

from llmgw import cli
from llmgw.bench.chaos import (
    ChaosResult,
    Condition,
    GatewayRow,
    Watch,
    markdown,
    parser,
    result_dict,
    result_from_dict,
    slopes,
)
from llmgw.bench.chaos_rig import AUTO_MAX, AUTO_MIN, AUTO_MODEL, AUTO_PROFILE, process_config
from llmgw.bench.chaos_scaler import ScalerLog, ScalerWindow
from llmgw.bench.chaos_schedule import (
    SCHEDULE,
    median_and_range,
    parse_faults,
    slope_per_hour,
    soak_plan,
)
from llmgw.bench.cut_proxy import cut_proxy
from llmgw.config.loading import parse_config
from llmgw.metrics import trio_task_count


def test_the_schedule_runs_every_fault_of_the_issue_in_order_and_refuses_an_unknown_name():
    assert [f.name for f in parse_faults("all")] == [
        "redis-stop", "redis-restart", "leader-stop", "leader-kill", "forged-lease", "lease-delete", "partition",
        "agent-kill", "engine-kill", "autoscaled-engine-kill"]
    assert parse_faults(None) == list(SCHEDULE)
    assert [f.name for f in parse_faults("engine-kill, redis-stop")] == ["engine-kill", "redis-stop"]
    with pytest.raises(ValueError, match="unknown fault.*nope"):
        parse_faults("redis-stop,nope")
    with pytest.raises(ValueError):
        parse_faults(",")


def test_a_soak_plan_goes_round_the_schedule_every_interval_and_ends_quiet():
    faults = parse_faults("redis-stop,leader-kill,engine-kill")
    plan = soak_plan(30, 120, faults)
    assert [at for at, _ in plan] == [120.0 * i for i in range(1, 15)]  # none in the last 2 minutes
    assert [f.name for _, f in plan[:4]] == ["redis-stop", "leader-kill", "engine-kill", "redis-stop"]
    assert soak_plan(1, 120, faults) == [] and soak_plan(30, 0, faults) == []


def test_slopes_are_per_hour_and_need_two_moments():
    assert slope_per_hour([(0, 100), (1800, 150), (3600, 200)]) == pytest.approx(100)
    assert slope_per_hour([(0, 5), (60, 5), (120, 5)]) == 0
    assert slope_per_hour([(10, 1)]) is None and slope_per_hour([(10, 1), (10, 2)]) is None
    assert median_and_range([3, 1, 2, 10]) == (2.5, 1, 10) and median_and_range([]) is None


def result(run: int, failed: int, back: float | None, healed: str | None = None) -> ChaosResult:
    rows = [GatewayRow("A", 50, {}, lost_inside=2, unroutable_s=0.4, back_s=1.0),
            GatewayRow("F1", 50, {"http_503": failed} if failed else {}, unroutable_s=3.0, degraded_s=8.2,
                       back_s=back)]
    return ChaosResult("leader-kill", "the leader kill -9", run, "A", 100, rows, back, 2.4, healed,
                       {"r0": 10, "r1": 11},
                       {"r0": 10, "r1": 11}, [], [], ["A term 1", "B term 2"], 0.0,
                       asdict(ScalerWindow(before=1, after=1, lowest=1, highest=1, decisions=[])))


def test_the_table_says_per_gateway_what_failed_apart_from_the_victims_own_and_how_long_until_routable():
    table = markdown([result(1, 7, 2.5)])
    row = table.splitlines()[2]
    assert "A: 0 (+2 in flight inside it); F1: 7 http_503" in row
    assert "A 0.4 s, F1 3.0 s" in row and "2.5 s (A itself: 1.0 s)" in row
    assert "same pids" in row and "A term 1 -> B term 2 (after 2.4 s)" in row and "| A 0.0 s, F1 8.2 s |" in row
    assert row.endswith("| 1 -> 1 |")
    healed = markdown([result(1, 7, None, healed="agent restarted")]).splitlines()[2]
    assert "not by itself (agent restarted)" in healed


def test_repeats_add_medians_with_their_spread_and_the_json_round_trips():
    results = [result(1, 7, 2.5), result(2, 1, 1.5), result(3, 3, None, healed="agent restarted")]
    summary = markdown(results).splitlines()[-1]
    assert "| 3 | 3 [1-7] | 2.0 s [1.5-2.5] | 2 of 3 | 0 of 3 |" in summary
    data = result_dict(results[0])
    assert data["failed_elsewhere"] == 7 and data["lost_inside"] == 2
    assert result_from_dict(data) == results[0]


def test_llmgw_bench_chaos_dispatches_to_its_module_and_bounds_its_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "chaos", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: llmgw bench chaos")
    assert all(flag in help_text for flag in ("--faults", "--quick", "--soak", "--repeats", "--json"))
    with pytest.raises(SystemExit):
        cli.main(["bench", "chaos", "--faults", "nope"])
    assert "unknown fault" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "chaos", "--gateways", "3"])
    assert parser().parse_args([]).faults == "all"
    with pytest.raises(SystemExit):
        cli.main(["bench", "chaos", "--soak", "1", "--routing-options", "[1, 2]"])
    assert "a YAML mapping" in capsys.readouterr().err


def test_the_soaks_routing_options_join_the_deployed_profiles_own(tmp_path):
    options = parser().parse_args(["--routing-options", "{tokenize_cache_tokens: 20000, tree_ttl: 60s}"])
    config = parse_config(process_config("redis://127.0.0.1:6379", tmp_path, 2, options.routing_options))
    for profile in config.profiles:
        assert profile.routing_options == {"tokenize_timeout": "2s", "tokenize_cache_tokens": 20000,
                                           "tree_ttl": "60s"}
    assert process_config("redis://127.0.0.1:6379", tmp_path, 2) == \
        process_config("redis://127.0.0.1:6379", tmp_path, 2, parser().parse_args([]).routing_options)


def test_the_rig_runs_an_autoscaled_deployment_beside_the_fixed_one_with_overload_control_on(tmp_path):
    config = parse_config(process_config("redis://127.0.0.1:6379", tmp_path, 2))
    assert config.flow.enabled
    fixed, autoscaled = config.deployments
    assert (fixed.profile, fixed.autoscaled) == ("tiny-sim", False)
    assert (autoscaled.profile, autoscaled.autoscaled) == (AUTO_PROFILE, True)
    assert autoscaled.bounds == (AUTO_MIN, AUTO_MAX)
    assert {p.served_model_name for p in config.profiles} == {"tiny", AUTO_MODEL}


def test_the_scaler_log_counts_each_decision_once_and_leaves_a_new_leaders_adoption_window_out():
    log = ScalerLog()
    up = {"at": 5.0, "kind": "up", "from": 1, "to": 2}
    log.record("A", {"desired": 1, "started_from": 1, "decisions": [{"at": 1.0, "kind": "hold", "from": 1,
                                                                     "to": 1}]}, at=10)
    log.record("A", {"desired": 2, "started_from": 1, "decisions": [up]}, at=21)
    log.record("A", {"desired": 2, "started_from": 1, "decisions": [up]}, at=22)
    log.record("B", {"desired": 3, "started_from": None, "decisions": []}, at=23)  # B adopting: its max
    log.record("B", {"desired": 2, "started_from": 2, "decisions": [{**up, "kind": "down", "from": 2, "to": 1,
                                                                     "reason": "idle"}]}, at=24)
    window = log.window(20, 30)
    assert window == ScalerWindow(before=1, after=2, lowest=2, highest=2, decisions=["up 1->2", "down 2->1"],
                                  reasons=["A: up 1->2: None", "B: down 2->1: idle"])
    assert window.stepped
    assert not log.window(0, 15).stepped and log.window(0, 15).decisions == []


async def echo_server(nursery: trio.Nursery) -> int:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some(4096):
                await stream.send_all(data)

    listeners = await nursery.start(trio.serve_tcp, echo, 0)
    return listeners[0].socket.getsockname()[1]


async def receive_within(stream: trio.SocketStream, seconds: float) -> bytes | None:
    with trio.move_on_after(seconds):
        return await stream.receive_some(4096)
    return None


async def test_a_cut_proxy_holds_every_byte_and_new_connection_until_restored(nursery):
    upstream = await echo_server(nursery)
    async with cut_proxy(upstream) as proxy:
        before = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        await before.send_all(b"one")
        assert await receive_within(before, 5) == b"one"
        proxy.cut()
        await before.send_all(b"two")
        assert await receive_within(before, 0.3) is None  # nothing through while cut
        during = await trio.open_tcp_stream("127.0.0.1", proxy.port)  # accepted, reaches nothing
        await during.send_all(b"three")
        assert await receive_within(during, 0.3) is None
        assert proxy.is_cut and proxy.cuts == 1
        proxy.restore()
        assert await receive_within(before, 5) == b"two"  # held, not lost
        assert await receive_within(during, 5) == b"three"
        await before.aclose()
        await during.aclose()


async def test_a_cut_proxy_closes_the_clients_side_when_the_upstream_goes_away(nursery):
    closing = trio.Event()

    async def hang_up(stream: trio.SocketStream) -> None:
        async with stream:
            await closing.wait()

    listeners = await nursery.start(trio.serve_tcp, hang_up, 0)
    async with cut_proxy(listeners[0].socket.getsockname()[1]) as proxy:
        client = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        await client.send_all(b"x")
        closing.set()
        with trio.fail_after(5):
            assert await client.receive_some(10) == b""  # EOF: the server closed, so does the proxy
        await client.aclose()
        with trio.fail_after(5):
            while proxy.connections:
                await trio.sleep(0.01)


async def test_a_cut_proxy_to_nothing_closes_the_connection_and_counts_it():
    async with cut_proxy(1) as proxy:  # nothing listens on port 1
        client = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        with trio.fail_after(10):
            assert await client.receive_some(10) == b""
        assert proxy.refused == 1
        await client.aclose()


async def test_the_trio_task_count_sees_tasks_in_nested_nurseries():
    before = trio_task_count()
    release = trio.Event()

    async def parent() -> None:
        async with trio.open_nursery() as inner:
            inner.start_soon(release.wait)
            inner.start_soon(release.wait)
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(parent)
        await trio.sleep(0.05)
        assert trio_task_count() == before + 3
        release.set()
    assert trio_task_count() == before


def test_a_polled_condition_counts_each_findings_time_until_the_next_poll_and_when_it_was_last_over():
    condition = Condition()
    for at, holds in ((0.0, False), (1.0, True), (1.5, True), (4.0, False), (4.1, False)):
        condition.record(at, holds)
    assert condition.held_s == pytest.approx(3.0)  # from the poll at 1.0 to the one at 4.0
    assert condition.back_after(2.0) == 2.0 and condition.back_after(5.0) == 0.0
    condition.record(5.0, True)
    assert condition.back_after(2.0) is None  # it holds again: not back
    never = Condition()
    never.record(0.0, False)
    assert never.back_after(1.0) == 0.0 and never.held_s == 0


def test_a_watch_has_every_gateway_routable_only_once_the_last_one_is():
    watch = Watch()
    watch.unroutable["A"].record(0.0, False)
    watch.unroutable["F1"].record(0.0, True)
    assert watch.all_routable_since() is None
    watch.unroutable["F1"].record(2.0, False)
    watch.unroutable["A"].record(2.5, False)
    assert watch.all_routable_since() == 2.0


def test_a_soaks_slopes_follow_the_longest_lived_pid_and_tell_a_warm_up_from_a_steady_climb():
    warming = [(t, 100, 50 + min(t, 1800) / 60, 20, 60) for t in range(0, 3600, 60)]  # +30 then flat
    restarted = [(t, 200, 10, 5, None) for t in range(3600, 3700, 10)]  # a short second life
    result = slopes(warming + restarted)
    assert result["pid"] == 100 and result["samples"] == 60
    assert result["rss_bytes"]["per_hour"] > 20 and result["rss_bytes"]["second_half_per_hour"] == 0
    assert result["fds"]["per_hour"] == 0 and result["trio_tasks"]["first"] == 60
    assert slopes(restarted)["trio_tasks"] == {"first": None, "last": None, "per_hour": None,
                                               "second_half_per_hour": None}
