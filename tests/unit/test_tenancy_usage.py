"""The in-memory usage sink: rows per key, team, model and UTC hour, refusals counted per key."""

from __future__ import annotations

import pytest

from llmgw.tenancy.interfaces import OUT_OF_QUOTA, RATE_LIMITED, UsageRecord, UsageSink
from llmgw.tenancy.model import Team, Tenant, Usage
from llmgw.tenancy.usage import FIELDS, MODEL_NOT_ALLOWED, UsageAggregator, UsageRow, hour_of

HOUR_START = 1_796_000_400  # a UTC hour's first second (a multiple of 3600)
TEAM = Team("search")
ALICE = Tenant("cfg-alice", "alice", team=TEAM)
LONE = Tenant("k-0011", "lone")


def answer(tenant: Tenant, at: float, *, prompt=10, cached=0, completion=5, nano=0, status=200, model="tiny"):
    return UsageRecord(tenant.key_id, tenant.name, tenant.team.name if tenant.team else None, model,
                       Usage(prompt, completion, cached, nano), status, at)


def as_dict(counts) -> dict[str, int]:
    return dict(zip(FIELDS, counts))


def test_the_aggregator_is_a_usage_sink():
    sink: UsageSink = UsageAggregator()
    assert sink is not None


def test_answers_of_one_key_model_and_hour_add_up_in_one_row():
    sink = UsageAggregator()
    sink.record(answer(ALICE, HOUR_START + 1, prompt=100, cached=40, completion=7, nano=1234))
    sink.record(answer(ALICE, HOUR_START + 3599, prompt=50, cached=0, completion=3, nano=66, status=500))
    rows = sink.take()
    assert list(rows) == [UsageRow("cfg-alice", "alice", "search", "tiny", HOUR_START)]
    counts = as_dict(rows[UsageRow("cfg-alice", "alice", "search", "tiny", HOUR_START)])
    assert counts == {**dict.fromkeys(FIELDS, 0), "requests": 2, "input_tokens": 150, "cached_tokens": 40,
                      "output_tokens": 10, "nano_usd": 1300, "answers_2xx": 1, "answers_5xx": 1}


def test_an_hour_boundary_starts_a_new_row():
    sink = UsageAggregator()
    sink.record(answer(ALICE, HOUR_START - 0.001))
    sink.record(answer(ALICE, HOUR_START))
    hours = sorted(row.hour for row in sink.take())
    assert hours == [HOUR_START - 3600, HOUR_START]


def test_keys_models_and_teams_are_rows_of_their_own():
    sink = UsageAggregator()
    sink.record(answer(ALICE, HOUR_START))
    sink.record(answer(ALICE, HOUR_START, model="big"))
    sink.record(answer(LONE, HOUR_START))
    rows = sink.take()
    assert {(r.key_id, r.team, r.model) for r in rows} == {("cfg-alice", "search", "tiny"),
                                                          ("cfg-alice", "search", "big"), ("k-0011", "", "tiny")}


def test_status_classes_are_counted_apart():
    sink = UsageAggregator()
    for status in (200, 201, 400, 429, 502, 302):
        sink.record(answer(LONE, HOUR_START, status=status))
    (counts,) = sink.take().values()
    assert as_dict(counts)["answers_2xx"] == 2
    assert as_dict(counts)["answers_4xx"] == 2
    assert as_dict(counts)["answers_5xx"] == 1
    assert as_dict(counts)["answers_other"] == 1
    assert as_dict(counts)["requests"] == 6


def test_cached_tokens_never_exceed_the_prompt():
    sink = UsageAggregator()
    sink.record(answer(LONE, HOUR_START, prompt=10, cached=50))
    (counts,) = sink.take().values()
    assert as_dict(counts)["cached_tokens"] == 10


def test_refusals_are_counted_per_key_by_reason_and_are_not_requests():
    now = [HOUR_START + 10.0]
    sink = UsageAggregator(clock=lambda: now[0])
    sink.refused(ALICE, "tiny", RATE_LIMITED)
    sink.refused(ALICE, "tiny", RATE_LIMITED)
    sink.refused(ALICE, "tiny", OUT_OF_QUOTA)
    sink.refused(ALICE, "tiny", MODEL_NOT_ALLOWED)
    now[0] += 3600
    sink.refused(ALICE, "tiny", RATE_LIMITED)
    rows = sink.take()
    first = as_dict(rows[UsageRow("cfg-alice", "alice", "search", "tiny", HOUR_START)])
    assert (first["refused_rate"], first["refused_quota"], first["refused_model"], first["requests"]) == (2, 1, 1, 0)
    assert as_dict(rows[UsageRow("cfg-alice", "alice", "search", "tiny", HOUR_START + 3600)])["refused_rate"] == 1


def test_an_unknown_refusal_reason_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown refusal reason"):
        UsageAggregator().refused(ALICE, "tiny", "because")


def test_take_empties_the_aggregator_and_hooks_see_every_row():
    seen = []
    sink = UsageAggregator()
    sink.on_row.append(lambda row, counts: seen.append((row.key_id, counts[0])))
    sink.record(answer(ALICE, HOUR_START))
    assert sink.pending_rows == 1
    assert len(sink.take()) == 1
    assert sink.take() == {}
    assert seen == [("cfg-alice", 1)]


def test_hour_of_is_the_utc_hour():
    assert hour_of(HOUR_START + 3599.999) == HOUR_START
    assert hour_of(HOUR_START) == HOUR_START


def test_the_counters_are_labelled_by_team_and_model_capped_and_published_per_interval():
    from prometheus_client import CollectorRegistry

    from llmgw.tenancy.usage_metrics import UsageMetrics

    registry = CollectorRegistry()
    metrics = UsageMetrics(registry, max_label_values=2)
    sink = UsageAggregator(clock=lambda: HOUR_START)
    sink.on_row.append(metrics.note)
    for team in ("a", "b", "c", "d"):
        sink.record(answer(Tenant(f"k-{team}", team, team=Team(team)), HOUR_START, nano=2_000_000_000))
    sink.record(answer(LONE, HOUR_START, status=503))
    sink.refused(LONE, "tiny", RATE_LIMITED)

    def value(name, **labels):
        return registry.get_sample_value(name, labels) or 0

    assert value("llmgw_tenant_requests_total", team="a", model="tiny", code="2xx") == 0  # not yet published
    metrics.publish()
    assert value("llmgw_tenant_requests_total", team="a", model="tiny", code="2xx") == 1
    assert value("llmgw_tenant_requests_total", team="other", model="tiny", code="2xx") == 2  # c, d: past the cap
    assert value("llmgw_tenant_requests_total", team="other", model="tiny", code="5xx") == 1  # none: the cap too
    assert value("llmgw_tenant_spend_usd_total", team="b", model="tiny") == 2.0
    assert value("llmgw_tenant_tokens_total", team="a", model="tiny", kind="output") == 5
    assert value("llmgw_tenant_refused_total", team="other", reason="rate_limit_exceeded") == 1
    assert not any("key" in sample.labels for family in registry.collect() for sample in family.samples)
