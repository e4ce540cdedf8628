"""The routing benchmark's pure parts: its knee rule, trace parser, ideal cache, workloads and command line."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from llmgw import cli
from llmgw.bench import routing
from llmgw.bench.routing_arms import Oracle
from llmgw.bench.routing_workloads import TraceError, build, load_trace


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
    state = {"pending_prefill_tokens": 2048, "prompt_tokens": 4096, "cached_tokens": 2048,
             "max_num_batched_tokens": 2048, "prefill_tokens_per_s": 8000.0, "decode_ms_per_step": 30.0}
    assert Oracle.estimate(state) == pytest.approx(4096 / 8000 + 3 * 0.030)


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
    assert all(flag in text for flag in ("--workload", "--arms", "--arm-options", "--concurrency", "--repeats",
                                         "--quick", "--json", "--plots", "--seed", "--replicas"))


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
