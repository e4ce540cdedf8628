"""``llmgw bench overload``'s pure parts: what an answer counts as, a gateway's queue read from its metrics, the
open loop's arrivals and cap, the per-class numbers and vllm-router's tuning."""

from __future__ import annotations

import random
from collections import Counter
from functools import partial

import httpx
import pytest
import trio

from llmgw.bench import overload
from llmgw.bench.overload_arms import DEFAULT_ARMS, allowance, keys_config, queued, router_tuning, sample_kv
from llmgw.bench.overload_engines import engine_stats, read_engines
from llmgw.bench.overload_report import level_stats, summary
from llmgw.bench.overload_workload import (
    BATCH,
    ERROR,
    EXPIRED,
    INTERACTIVE,
    OK,
    SHED,
    Loop,
    Mix,
    Outcome,
    Picker,
    Tenant,
    kind_of,
    open_loop,
    reason_of,
)
from llmgw.config.loading import parse_config
from llmgw.flow.model import EXPIRED as EXPIRED_REASON, OVERFLOW, UNSERVABLE, PriorityClass, Shed
from llmgw.gateway.flow_gate import shed_response


def test_an_answer_is_ok_shed_expired_or_an_error():
    assert kind_of(200, "") == OK
    assert kind_of(429, '{"error": {"message": "rate limit: rpm"}}') == SHED
    assert kind_of(429, '{"error": {"code": "queue_timeout", "message": "it waited 2.0s"}}') == EXPIRED
    assert kind_of(429, '{"error": {"code": "queue_full", "message": "the queue is full"}}') == SHED
    assert kind_of(408, "Request timed out in queue") == EXPIRED  # vllm-router's queue timeout
    assert kind_of(503, "") == ERROR and kind_of(0, "") == ERROR


def test_a_refusals_reason_is_read_from_llmgws_message():
    for reason, waited, expected in ((EXPIRED_REASON, 2.0, "expired"), (OVERFLOW, 0.0, "overflow"),
                                     (UNSERVABLE, 0.0, "unservable"), (UNSERVABLE, 1.5, "unservable_waiting")):
        response = shed_response(Shed(reason, 2, waited, "detail"), "tiny", PriorityClass("interactive", 0, 2.0))
        assert reason_of(429, response.body.decode()) == expected
    assert reason_of(429, '{"error": {"message": "rate limit: rpm"}}') == "other"
    assert reason_of(200, "") == ""


def test_the_refusals_are_broken_down_by_reason_gateway_and_second_the_slow_ones_counted():
    outcomes = [Outcome("a", INTERACTIVE, 0.2, SHED, 429, 0.0, 0.004, gateway=0, reason="unservable"),
                Outcome("a", INTERACTIVE, 3.5, EXPIRED, 429, 0.0, 2.0, gateway=1, reason="expired"),
                Outcome("a", INTERACTIVE, 3.9, EXPIRED, 429, 0.0, 1.2, gateway=1, reason="expired"),
                Outcome("a", INTERACTIVE, 1.0, OK, 200, 0.1, 0.5, gateway=2)]
    found = level_stats(Loop(outcomes, 1.0, elapsed=2.0), [], {INTERACTIVE: 0.5, BATCH: 30.0}, 2.0)["refusals"]
    assert found["by_reason"]["unservable"] == {"count": 1, "p50_ms": 4.0, "p99_ms": 4.0}
    assert found["by_reason"]["expired"]["count"] == 2 and set(found["by_gateway"]) == {"0", "1"}
    assert found["slow"] == 2 and found["slow_by_reason"] == {"expired": 2} and found["slow_by_second"] == {"3": 2}


def test_a_gateways_queue_is_the_sum_of_its_flow_queued_gauges_and_none_without_them():
    parsed = {'llmgw_flow_queued{model="tiny",class="interactive"}': 2.0,
              'llmgw_flow_queued{model="tiny",class="batch"}': 5.0,
              'llmgw_flow_queued_tokens{model="tiny",class="batch"}': 9000.0,  # another gauge of the same stem
              "llmgw_requests_total": 7.0}
    assert queued(parsed) == 7.0
    assert queued({"llmgw_requests_total": 7.0}) is None
    assert allowance({'llmgw_flow_output_allowance_ratio{model="a"}': 0.5,
                      'llmgw_flow_output_allowance_ratio{model="b"}': 1.0,
                      'llmgw_flow_output_allowance_answers_total{model="a"}': 64.0}) == 0.75
    assert allowance({"llmgw_requests_total": 7.0}) is None


def test_batch_is_most_of_the_tokens_and_the_keys_carry_their_class():
    tenants = Mix().tenants()
    tokens = {c: sum(t.share * (t.prompt_words * 5 + t.max_tokens) for t in tenants if t.priority == c)
              for c in (INTERACTIVE, BATCH)}
    assert tokens[BATCH] > 0.8 * (tokens[BATCH] + tokens[INTERACTIVE])
    assert sum(t.share for t in tenants) == 1.0
    config = parse_config(keys_config(tenants))
    assert [(k.name, k.priority) for k in config.api_keys] == [(t.name, t.priority) for t in tenants]


def test_vllm_routers_bucket_holds_the_knee_and_refills_at_the_capacity():
    tuning = router_tuning(12, 3.4, 100, 2)
    assert tuning.argv() == ("--max-concurrent-requests", "12", "--rate-limit-tokens-per-second", "3",
                             "--queue-size", "100", "--queue-timeout-secs", "2")


async def test_the_open_loop_never_waits_for_answers_and_counts_what_the_cap_kept_out(autojump_clock):
    tenant = Tenant("t", "sk", INTERACTIVE, 1.0, 1, 1)
    answered = []

    async def slow(t: Tenant, rng: random.Random) -> Outcome:
        await trio.sleep(100)  # far longer than the arrivals' window
        answered.append(t)
        return Outcome(t.name, t.priority, 0.0, OK, 200, 0.1, 0.2)

    loop = await open_loop(slow, [tenant], rate=50.0, seconds=10.0, cap=100, seed=3)
    # ~500 arrivals in 10 s whatever the answers take: the first 100 sent at once, the rest kept out by the cap
    assert loop.most_in_flight == 100 and len(answered) == 100
    assert 400 <= loop.over_cap + 100 <= 600


async def test_the_open_loops_arrivals_are_poisson_at_the_rate(autojump_clock):
    sent: list[float] = []

    async def quick(t: Tenant, rng: random.Random) -> Outcome:
        sent.append(trio.current_time())
        return Outcome(t.name, t.priority, 0.0, OK, 200, 0.0, 0.0)

    loop = await open_loop(quick, Mix().tenants(), rate=20.0, seconds=50.0, cap=10, seed=1)
    assert 900 <= len(loop.outcomes) <= 1100 and loop.over_cap == 0
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    mean = sum(gaps) / len(gaps)
    variance = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert abs(mean - 0.05) < 0.005 and 0.8 < variance ** 0.5 / mean < 1.2  # exponential gaps: sd = mean


def test_per_class_numbers_goodput_fairness_and_kv_while_a_queue_waits():
    slo = {INTERACTIVE: 0.5, BATCH: 30.0}
    outcomes = [Outcome("interactive-a", INTERACTIVE, 0, OK, 200, 0.2, 1.0, tokens=100, itl=[0.01, 0.02]),
                Outcome("interactive-a", INTERACTIVE, 0, OK, 200, 0.9, 1.5, tokens=100),  # over the TTFT SLO
                Outcome("interactive-b", INTERACTIVE, 0, OK, 200, 0.1, 0.9, tokens=150),
                Outcome("interactive-b", INTERACTIVE, 0, SHED, 429, 0.0, 0.003, retry_after=True),
                Outcome("batch", BATCH, 0, OK, 200, 2.0, 20.0, tokens=3000),
                Outcome("batch", BATCH, 0, EXPIRED, 429, 0.0, 2.01, retry_after=False)]
    kv = [{"kv": 0.9, "waiting": 0, "queued": 3.0, "preemptions": 4.0, "busy": 0.9},
          {"kv": 0.5, "waiting": 2, "queued": 1.0, "preemptions": None, "busy": 1.0},  # an engine did not answer
          {"kv": 0.1, "waiting": 0, "queued": 0.0, "preemptions": 9.0, "allowance": 0.6}]
    stats = level_stats(Loop(outcomes, 1.0, elapsed=2.0), kv, slo, capacity_rps=2.0)  # 1 s of arrivals, 2 s in all
    inter, batch = stats["classes"][INTERACTIVE], stats["classes"][BATCH]
    assert (inter["sent"], inter["completed"], inter["good"], inter["shed"], inter["expired"]) == (4, 3, 2, 1, 0)
    assert (batch["completed"], batch["good"], batch["expired"]) == (1, 1, 1)
    assert inter["retry_after_share"] == 1.0 and batch["retry_after_share"] == 0.0
    assert inter["rejection_p50_ms"] == 3.0 and batch["rejection_p99_ms"] == pytest.approx(2010.0)
    assert stats["goodput_rps"] == 1.5 and stats["goodput_of_capacity"] == 0.75
    assert stats["fairness"] == 100 / 150  # tokens in answers within the SLO: a's second answer was too late
    assert stats["kv_gateway_queued"] == {"samples": 2, "mean": 0.7, "min": 0.5}
    assert stats["kv_engines_waiting"]["mean"] == 0.5
    assert stats["preemptions"] == 5.0  # the engines' counters rose from 4 to 9 during the run
    assert stats["busy_gateway_queued"] == {"samples": 2, "mean": 0.95, "min": 0.9}
    assert stats["output_allowance"] == 0.6  # the gateways' learnt share of max_tokens at the run's end
    medians = summary([stats, stats])
    assert medians["interactive_shed"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert medians["kv_min_when_gateway_queued"]["median"] == 0.5


def test_the_command_line_reads_lists_and_quick_defaults_and_refuses_unknown_arms(capsys):
    args = overload.parse(["--loads", "0.5,4", "--gateways", "3"])
    assert (args.arms, args.gateways, args.loads, args.ramp) == (list(DEFAULT_ARMS), [3], [0.5, 4.0],
                                                                 [2, 4, 8, 16, 32])
    assert overload.parse(["--arms", "llmgw-flow,llmgw-flow-priority"]).arms == ["llmgw-flow", "llmgw-flow-priority"]
    quick = overload.parse(["--quick"])
    assert (quick.replicas, quick.gateways, quick.loads, quick.repeats) == (2, [1], [0.5, 2.0], 1)
    assert (quick.natural_output, quick.output_quantile) == (None, None)  # answers of max_tokens, the default room
    natural = overload.parse(["--natural-output", "16:256", "--output-quantile", "off"])
    assert (natural.natural_output, natural.output_quantile) == ("16:256", "off")
    with pytest.raises(SystemExit):
        overload.parse(["--output-quantile", "high"])
    with pytest.raises(SystemExit):
        overload.parse(["--arms", "llmgw-flow,nginx"])
    assert "unknown arms: nginx" in capsys.readouterr().err


def test_the_tenants_of_a_class_take_turns_and_the_classes_keep_their_shares():
    pick = Picker(Mix(batch_share=0.3).tenants(), random.Random(5))
    drawn = Counter(pick().name for _ in range(10_000))
    assert abs(drawn["interactive-a"] - drawn["interactive-b"]) <= 1
    assert 0.28 < drawn["batch"] / 10_000 < 0.32


def test_an_engine_full_of_sequences_counts_as_busy_however_little_of_its_cache_it_holds():
    metrics = {"http://e1": "vllm:kv_cache_usage_perc 0.4\nvllm:num_requests_running 8\nvllm:num_requests_waiting 3\n",
               "http://e2": "vllm:kv_cache_usage_perc 0.7\nvllm:num_requests_running 2\nvllm:num_requests_waiting 0\n"}

    async def main() -> list[dict]:
        samples: list[dict] = []
        transport = httpx.MockTransport(
            lambda request: httpx.Response(200, text=metrics[str(request.url).rsplit("/", 1)[0]]))
        async with httpx.AsyncClient(transport=transport) as http, trio.open_nursery() as nursery:
            nursery.start_soon(partial(sample_kv, seats=8), http, ["http://e1", "http://e2"], [], samples)
            while not samples:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return samples

    sample = trio.run(main)[0]
    assert sample["kv"] == 0.55 and sample["waiting"] == 3
    assert sample["busy"] == (1.0 + 0.7) / 2  # e1: 8 of 8 seats; e2: its cache's 70%


def sim_metrics(step: dict[str, float], overrun: dict[str, float], capped: float) -> str:
    """A simulator's /metrics with the histograms the bench reads (cumulative buckets) and its capped chunks."""
    lines = []
    for name, buckets in (("llmgw_sim_step_seconds", step), ("llmgw_sim_step_overrun_seconds", overrun)):
        lines += [f'{name}_bucket{{engine="0",model_name="sim",le="{le}"}} {n}' for le, n in buckets.items()]
    lines.append(f'llmgw_sim_prefill_chunks_capped_total{{engine="0",model_name="sim"}} {capped}')
    return "\n".join(lines) + "\n"


def gateway_wait(interactive: dict[str, float], batch: dict[str, float]) -> str:
    """A gateway's llmgw_flow_wait_seconds of two classes."""
    return "".join(f'llmgw_flow_wait_seconds_bucket{{model="m",class="{name}",le="{le}"}} {n}\n'
                   for name, buckets in (("interactive", interactive), ("batch", batch)) for le, n in buckets.items())


async def test_the_engines_readings_are_summed_and_a_run_is_their_difference():
    """Two simulators' histograms summed bucket by bucket, with the gateway's interactive queue wait (not the batch
    class's); a run's quantiles come from the buckets' rise during it (steps before it do not count) and an engine
    that does not answer makes no reading."""
    texts = {"http://a": sim_metrics({"0.01": 10, "0.05": 10, "+Inf": 10}, {"0.001": 10, "+Inf": 10}, 0),
             "http://b": sim_metrics({"0.01": 0, "0.05": 0, "+Inf": 0}, {"0.001": 0, "+Inf": 0}, 0),
             "http://g": gateway_wait({"0.005": 5, "0.1": 5, "+Inf": 5}, {"0.005": 0, "0.1": 0, "+Inf": 50})}

    def answer(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        return httpx.Response(200, text=texts[base]) if base in texts else httpx.Response(503)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        before = await read_engines(http, ["http://a", "http://b"], ["http://g"])
        texts["http://b"] = sim_metrics({"0.01": 0, "0.05": 100, "+Inf": 100}, {"0.001": 99, "+Inf": 100}, 12)
        texts["http://g"] = gateway_wait({"0.005": 5, "0.1": 15, "+Inf": 15}, {"0.005": 0, "0.1": 0, "+Inf": 90})
        after = await read_engines(http, ["http://a", "http://b"], ["http://g"])
        del texts["http://b"]
        assert await read_engines(http, ["http://a", "http://b"]) is None  # b answers 503: no partial sum
    assert before is not None and after is not None
    assert after.buckets["llmgw_sim_step_seconds"][0.05] == 110 and after.capped_chunks == 12
    run = engine_stats(before, after)
    assert run is not None
    assert run["steps"] == 100 and run["capped_chunks"] == 12
    assert run["step_p50_ms"] == pytest.approx(30.0)  # within (10, 50] ms: every new step, linear in the bucket
    assert run["step_p99_ms"] == pytest.approx(49.6)
    assert run["overrun_p50_ms"] == pytest.approx(50 / 99)  # 99 of 100 steps within 1 ms: the 50th at 50/99 of it
    assert run["gateway_wait_p50_ms"] == pytest.approx(5 + 95 * 0.5)  # 10 interactive waits, all within (5, 100]
    assert engine_stats(None, after) is None and engine_stats(before, None) is None
