"""The data plane's charge of one request (llmgw/gateway/tenant_gate.py): settled once, on what the answer says."""

from __future__ import annotations

import json

import trio

from llmgw.gateway.tenant_gate import NOTHING, SENT, USAGE, TenancyGate, refusal_response
from llmgw.tenancy.interfaces import RATE_LIMITED, Refusal, Tenancy, UsageRecord
from llmgw.tenancy.model import Limits, Price, PriceList, Team, TenancySettings, Tenant, Usage


class FakeAdmission:
    def __init__(self) -> None:
        self.headers = [(b"x-ratelimit-limit-requests", b"5")]
        self.settled: list[Usage | None] = []

    def settle(self, usage: Usage | None) -> None:
        self.settled.append(usage)


class FakeLimiter:
    def __init__(self, answer) -> None:
        self.answer = answer

    async def admit(self, tenant, model, estimate):
        return self.answer


class FakeSink:
    def __init__(self) -> None:
        self.records: list[UsageRecord] = []
        self.refusals: list[tuple[str, str]] = []

    def record(self, record: UsageRecord) -> None:
        self.records.append(record)

    def refused(self, tenant, model, reason, at=None, priority=None) -> None:
        self.refusals.append((model, reason))


TENANT = Tenant("cfg-web", "web", Team("blue"), limits=Limits(rpm=5))
PRICES = PriceList({"m": Price(input=10, cached_input=1, output=100)})
BODY = {"model": "m", "messages": [], "max_tokens": 50}


def gate(answer, counted: list[str]) -> tuple[TenancyGate, FakeSink]:
    sink = FakeSink()
    tenancy = Tenancy(None, FakeLimiter(answer), sink, PRICES, TenancySettings())  # type: ignore[arg-type]
    return TenancyGate(tenancy, {}, counted.append), sink


def test_an_answer_with_usage_is_settled_on_it_once_and_recorded():
    admission, counted = FakeAdmission(), []
    g, sink = gate(admission, counted)
    charge = g.open(TENANT, "m", "/v1/chat/completions", BODY, 200)
    assert trio.run(g.admit, charge) is None and charge.headers == admission.headers
    usage = {"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 10}}
    charge.answered(200, usage, None)
    charge.answered(200, usage, None)
    charge.unanswered()
    assert admission.settled == [Usage(30, 7, 10, 20 * 10 + 10 * 1 + 7 * 100)] and counted == [USAGE]
    [record] = sink.records
    assert (record.key_id, record.team, record.model, record.status) == ("cfg-web", "blue", "m", 200)


def test_without_usage_the_estimate_prompt_and_what_was_sent():
    admission, counted = FakeAdmission(), []
    g, sink = gate(admission, counted)
    charge = g.open(TENANT, "m", "/v1/chat/completions", BODY, 200)
    trio.run(g.admit, charge)
    charge.answered(499, None, 3)  # a client that left after three tokens
    assert admission.settled == [Usage(200, 3, 0, 200 * 10 + 3 * 100)] and counted == [SENT]
    garbage = g.open(TENANT, "m", "/v1/chat/completions", BODY, 200)
    garbage.answered(200, {"prompt_tokens": "many", "completion_tokens": -1}, 10_000)  # never more than reserved
    assert sink.records[-1].usage == Usage(200, 50, 0, 200 * 10 + 50 * 100)


def test_an_engine_error_costs_nothing_and_no_answer_gives_the_reservation_back():
    admission, counted = FakeAdmission(), []
    g, sink = gate(admission, counted)
    charge = g.open(TENANT, "m", "/v1/chat/completions", BODY, 200)
    trio.run(g.admit, charge)
    charge.answered(400, None, 100)
    assert admission.settled == [Usage(0, 0, 0, 0)] and sink.records[0].status == 400
    second = FakeAdmission()
    g2, sink2 = gate(second, counted)
    charge = g2.open(TENANT, "m", "/v1/chat/completions", BODY, 200)
    trio.run(g2.admit, charge)
    charge.unanswered()
    charge.answered(200, None, 5)
    assert second.settled == [None] and sink2.records == [] and counted[-1] == NOTHING


def test_a_refusal_is_openai_429_with_retry_after_and_counted():
    refusal = Refusal(RATE_LIMITED, "The key 'web' reached its limit", 0.2, [(b"x-ratelimit-remaining-requests", b"0")])
    g, sink = gate(refusal, [])
    response = trio.run(g.admit, g.open(TENANT, "m", "/v1/chat/completions", BODY, 200))
    assert response is not None and response.status == 429
    assert (b"retry-after", b"1") in response.headers and (b"x-ratelimit-remaining-requests", b"0") in response.headers
    error = json.loads(response.body)["error"]
    assert error["type"] == error["code"] == "rate_limit_exceeded" and "limit" in error["message"]
    assert sink.refusals == [("m", RATE_LIMITED)]
    given = refusal_response(Refusal(RATE_LIMITED, "x", 3.5, [(b"retry-after", b"4")]))
    assert [h for h in given.headers if h[0] == b"retry-after"] == [(b"retry-after", b"4")]
