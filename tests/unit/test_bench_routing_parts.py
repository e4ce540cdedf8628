"""The routing benchmark's pure parts: its knee rule, trace parser, ideal cache, workloads, command line, the
spreading of requests over several gateways and the load balance's coefficient of variation."""

from __future__ import annotations

import json

import pytest
import trio
from hypothesis import given, settings, strategies as st

from llmgw import cli
from llmgw.bench import routing
from llmgw.bench.chat_workloads import ChatResult
from llmgw.bench.routing_arms import Oracle, Spread, Target
from llmgw.bench.routing_workloads import Session, TraceError, Turn, build, load_trace
from llmgw.sim.timing import ConstantTiming


def point(p90: float, tok_s: float) -> dict:
    return {"ttft_p90_ms": p90, "output_tokens_per_s": tok_s}


def test_the_knee_is_the_last_load_before_latency_doubles_without_throughput():
    points = {4: point(300, 100), 8: point(400, 180), 16: point(900, 190), 32: point(3000, 195)}
    assert routing.knee(points) == {"concurrency": 8, "reached": True, "output_tokens_per_s": 180}
    # latency doubling while throughput still grows 10% or more is no knee
    assert routing.knee({8: point(400, 180), 16: point(900, 200)})["reached"] is False
    assert routing.knee({8: point(400, 180)}) == {"concurrency": 8, "reached": False, "output_tokens_per_s": 180}


def test_the_ideal_cache_serves_leading_blocks_seen_before_and_never_the_last_token():
    cache = routing.IdealCache(4)
    assert cache.lookup(list(range(12))) == 0
    cache.add(list(range(12)))
    assert cache.lookup(list(range(12))) == 8  # 3 blocks held, the last token is always computed
    assert cache.lookup(list(range(8)) + [99] * 8) == 8
    assert cache.lookup([99] + list(range(1, 16))) == 0  # a different first block: nothing after it counts


def test_workloads_are_the_same_for_a_seed_and_ids_are_unique():
    for name in ("grouped", "multiturn", "zipf", "low-sharing"):
        sessions = build(name, 7, quick=True)
        again = build(name, 7, quick=True)
        assert [[(t.id, t.messages) for t in s.turns] for s in sessions] == \
               [[(t.id, t.messages) for t in s.turns] for s in again]
        ids = [t.id for s in sessions for t in s.turns]
        assert len(ids) == len(set(ids))
    grouped = build("grouped", 7)
    assert len(grouped) == 32 and all(len(s.turns) == 4 for s in grouped)
    systems = {s.turns[0].messages[0]["content"] for s in grouped}
    assert len(systems) == 8 and all(6000 <= len(text) <= 8000 for text in systems)


def test_the_oracle_estimates_prefill_ahead_plus_its_own_in_engine_steps():
    state = {"pending_prefill_tokens": 2048, "prompt_tokens": 4096, "cached_tokens": 2048, "running": 0,
             "max_num_batched_tokens": 2048, "prefill_tokens_per_s": 8000.0, "decode_ms_per_step": 30.0}
    # the constant model: 4096 tokens in 3 steps (not rounded) of a 1365-token chunk and the fixed step cost
    assert Oracle.estimate(state, ConstantTiming(8000.0, 30.0)) == pytest.approx(3 * (1365 / 8000 + 0.030))


def test_a_trace_keeps_sessions_in_file_order_and_errors_name_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    message = [{"role": "user", "content": "hi"}]
    path.write_text("\n".join(json.dumps(x) for x in (
        {"session": "a", "messages": message, "id": "a1"}, {"messages": message, "max_tokens": 5},
        {"session": "a", "messages": message, "id": "a2"})) + "\n\n")
    sessions = load_trace(path)
    assert [[t.id for t in s.turns] for s in sessions] == [["a1", "a2"], ["line-2"]]
    assert sessions[1].turns[0].max_tokens == 5 and not sessions[0].carry
    path.write_text(json.dumps({"messages": message}) + "\n" + '{"messages": "hi"}\n')
    with pytest.raises(TraceError, match="line 2: needs 'messages'"):
        load_trace(path)
    path.write_text(json.dumps({"messages": message, "max_tokens": 0}) + "\n")
    with pytest.raises(TraceError, match="line 1: 'max_tokens'"):
        load_trace(path)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=80), st.builds(lambda v: json.dumps(v).encode(), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["messages", "session", "max_tokens", "id", "role", "content"]), inner, max_size=4),
    max_leaves=12))), max_size=6))
def test_any_trace_file_is_read_or_refused_with_a_trace_error(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    try:
        sessions = load_trace(path)
    except TraceError:
        return
    assert sessions and all(turn.messages and 1 <= turn.max_tokens <= 65536 for s in sessions for turn in s.turns)


def test_llmgw_bench_lists_routing_and_its_help_names_the_options(capsys):
    assert cli.main(["bench"]) == 0
    assert "  routing  " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "routing", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: llmgw bench routing")
    assert all(flag in text for flag in ("--workload", "--arms", "--arm-options", "--concurrency", "--gateways",
                                         "--repeats", "--quick", "--json", "--plots", "--seed", "--replicas"))


def test_arm_options_reach_only_llmgw_arms_and_bad_ones_are_refused():
    args = routing.build_parser().parse_args(["--arms", "kv_index,oracle", "--arm-options",
                                              'kv_index={"predicted_ttl": "1s"}'])
    plan = routing._plan(args)
    assert [(a.name, a.options) for a in plan.arms] == [("kv_index", {"predicted_ttl": "1s"}), ("oracle", {})]
    for bad in ("oracle={}", "kv_index=[1]", "kv_index={nope", "nope={}"):
        with pytest.raises(SystemExit, match="--arm-options"):
            routing._plan(routing.build_parser().parse_args(["--arm-options", bad]))
    with pytest.raises(SystemExit, match="unknown or repeated arm"):
        routing._plan(routing.build_parser().parse_args(["--arms", "best"]))


def test_a_variant_of_an_llmgw_arm_runs_beside_it_with_its_own_options():
    args = routing.build_parser().parse_args(["--arms", "kv_index,kv_index@greedy", "--arm-options",
                                              'kv_index@greedy={"cost_others_weight": 0}'])
    plan = routing._plan(args)
    assert [(a.name, a.policy, a.options) for a in plan.arms] == [
        ("kv_index", "kv_index", {}), ("kv_index@greedy", "kv_index", {"cost_others_weight": 0})]
    for arms in ("kv_index@", "oracle@x", "vllm-router-cache_aware@x", "kv_index,kv_index"):
        with pytest.raises(SystemExit, match="unknown or repeated arm"):
            routing._plan(routing.build_parser().parse_args(["--arms", arms]))


def test_baseline_arms_name_the_other_checkout_and_need_one(tmp_path):
    (tmp_path / "llmgw").mkdir()
    (tmp_path / "llmgw" / "__main__.py").write_text("")
    parse = routing.build_parser().parse_args
    # no NAME@baseline given: every llmgw arm gets its twin right after it, the others none
    plan = routing._plan(parse(["--arms", "round_robin,oracle,kv_index@greedy", "--baseline", str(tmp_path)]))
    assert [(a.name, a.source) for a in plan.arms] == [("round_robin", None), ("round_robin@baseline", tmp_path),
                                                       ("oracle", None), ("kv_index@greedy", None)]
    # as given when some are, each with its own options
    plan = routing._plan(parse(["--arms", "kv_index@baseline,kv_index", "--baseline", str(tmp_path),
                                "--arm-options", 'kv_index@baseline={"predicted_ttl": "1s"}']))
    assert [(a.name, a.policy, a.options, a.source) for a in plan.arms] == [
        ("kv_index@baseline", "kv_index", {"predicted_ttl": "1s"}, tmp_path), ("kv_index", "kv_index", {}, None)]
    with pytest.raises(SystemExit, match="kv_index@baseline need --baseline DIR"):
        routing._plan(parse(["--arms", "kv_index,kv_index@baseline"]))
    with pytest.raises(SystemExit, match="no llmgw checkout there"):
        routing._plan(parse(["--arms", "kv_index", "--baseline", str(tmp_path / "nowhere")]))
    with pytest.raises(SystemExit, match="unknown or repeated arm"):
        routing._plan(parse(["--arms", "oracle@baseline", "--baseline", str(tmp_path)]))


def test_requests_spread_over_gateways_round_robin_in_sending_order_whatever_their_conversation():
    spread = Spread(3)
    assert [spread.next() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [Spread(1).next() for _ in range(3)] == [0, 0, 0]
    with pytest.raises(ValueError):
        Spread(0)


async def test_run_sessions_sends_request_i_through_gateway_i_mod_n_and_records_it():
    sent: list[tuple[int, str]] = []

    def through(gateway: int):
        async def send(client, messages, max_tokens):
            sent.append((gateway, messages[-1]["content"]))
            await trio.sleep(0)
            return ChatResult(f"sim-{gateway}", 200, 10, 0, 0.01, 0.02, "ok", 1)
        return send

    target = Target([through(g) for g in range(3)], [], [])
    sessions = [Session([Turn(f"s{s}-t{t}", [{"role": "user", "content": f"s{s} t{t}"}], 4) for t in range(3)])
                for s in range(2)]
    records = await routing.run_sessions(target, sessions, 2, 16)
    assert [g for g, _ in sent] == [0, 1, 2, 0, 1, 2]  # by sending order: the turns of a session move around
    assert {r.id: r.gateway for r in records} == {f"s{content[1]}-t{content[4]}": g for g, content in sent}
    assert routing.summarize(records, 1.0, 3)["per_gateway"] == [2, 2, 2]


def test_load_balance_is_the_coefficient_of_variation_of_the_engines_counts_across_replicas():
    assert routing.cov([25, 25, 25, 25]) == 0.0
    assert routing.cov([30, 20, 30, 20]) == pytest.approx(0.2)  # population sd 5 over mean 25
    assert routing.cov([0, 0]) is None and routing.cov([]) is None
    metrics = ('vllm:request_success_total{engine="0",model_name="tiny",finished_reason="length"} 7.0\n'
               'vllm:request_success_total{engine="0",model_name="tiny",finished_reason="stop"} 3.0\n'
               'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 900.0\n'
               'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 400.0\n')
    assert routing.counter(metrics, "vllm:request_success_total") == 10
    assert routing.counter(metrics, "vllm:prompt_tokens_total") == 900
    balance = routing.load_balance({"per_replica": [10, 30], "prefill_per_replica": [500, 500]})
    assert balance["load_cov"] == pytest.approx(0.5) and balance["prefill_cov"] == 0.0


def test_gateways_n_are_rows_of_their_own_beside_n_1_with_ratios():
    plan = routing._plan(routing.build_parser().parse_args(["--gateways", "4,1", "--arms", "kv_index"]))
    assert plan.gateways == [1, 4] and [(a.name, n) for a, n in plan.units()] == [("kv_index", 1), ("kv_index", 4)]
    assert plan.key(plan.arms[0], 4) == "kv_index N=4"
    default = routing._plan(routing.build_parser().parse_args(["--gateways", "1,4"]))
    assert [a.name for a in default.arms] == list(routing.GATEWAY_ARMS)
    alone = routing._plan(routing.build_parser().parse_args(["--arms", "kv_index"]))
    assert alone.gateways == [1] and alone.key(alone.arms[0], 1) == "kv_index"  # the report as before
    for bad in ("0", "x", "1,99"):
        with pytest.raises(SystemExit, match="--gateways"):
            routing._plan(routing.build_parser().parse_args(["--gateways", bad]))

    def row(n: int, hit: float, p90: float) -> dict:
        return {"arm": "kv_index", "arm_label": "kv_index", "label": f"kv_index, N={n}", "gateways": n,
                "knee": {"concurrency": 8, "reached": False},
                "by_concurrency": {"8": {"hit_rate": hit, "ideal_hit_rate": 0.9, "ttft_p50_ms": 50, "ttft_p90_ms": p90,
                                         "ttft_mean_ms": 60, "output_tokens_per_s": 200, "cold_requests": 0,
                                         "errors": 0, "per_replica": [8, 8], "load_cov": 0.0, "prefill_cov": 0.05,
                                         "per_gateway": [16] if n == 1 else [4] * n, "router_cpu_percent": 3.0,
                                         "repeats": 1}}}
    text = routing.markdown({"workloads": {"zipf": {"requests": 16, "arms": {
        "kv_index N=1": row(1, 0.8, 100), "kv_index N=4": row(4, 0.76, 110)}}}})
    assert "| kv_index | 8 | 4 | 0.760 | 0.05 s | 0.11 s | 200 | 0.000 | 0.050 | 0.950x | 1.10x | 4/4/4/4 |" in text
