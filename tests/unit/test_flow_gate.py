"""The data plane's side of overload control (llmgw/gateway/flow_gate.py): a request's class from its key, team and
header; its deadline from its class and the client's headers; the 429 of a shed request; a pass released once."""

from __future__ import annotations

import json
import time

import pytest
import trio
from hypothesis import given, strategies as st

from llmgw.flow.model import ANONYMOUS, EXPIRED, OVERFLOW, UNSERVABLE, Admitted, FlowRequest, FlowSettings, Shed
from llmgw.gateway.dataplane import DataPlane, Exchange
from llmgw.gateway.flow_gate import OPEN, FlowGate, FlowTrace, shed_response
from llmgw.http.messages import Request, Response
from llmgw.tenancy.estimate import Estimator
from llmgw.tenancy.model import PriceList, Team, TenancySettings, Tenant


class Recording:
    """A FlowControl that answers what it is told and records what it was asked."""

    def __init__(self, outcome: Admitted | Shed):
        self.outcome = outcome
        self.entered: list[FlowRequest] = []
        self.released: list[Admitted] = []

    async def enter(self, request: FlowRequest) -> Admitted | Shed:
        self.entered.append(request)
        return self.outcome

    def release(self, admitted: Admitted) -> None:
        self.released.append(admitted)


def request(*headers: tuple[str, str]) -> Request:
    return Request("POST", "/v1/chat/completions", [(k.encode(), v.encode()) for k, v in headers], b"{}")


AT_ONCE = Admitted(0.0)


def gate(outcome: Admitted | Shed = AT_ONCE) -> FlowGate:
    return FlowGate(FlowSettings(), Recording(outcome), None)


batch_key = Tenant("cfg-b", "b", priority="batch")
team = Team("search", priority="interactive")
team_key = Tenant("cfg-s", "s", team=team)
raiser = Tenant("cfg-r", "r", priority="batch", priority_header=True)


@pytest.mark.parametrize("tenant, headers, expected", [
    (None, (), "standard"),  # no key: default_class
    (batch_key, (), "batch"),  # the key's own
    (team_key, (), "interactive"),  # its team's
    (Tenant("cfg-o", "o", team=team, priority="batch"), (), "batch"),  # the key's own before its team's
    (team_key, (("x-llmgw-priority", "best-effort"),), "best-effort"),  # the header lowers
    (batch_key, (("x-llmgw-priority", "interactive"),), "batch"),  # and may not raise
    (None, (("x-llmgw-priority", "interactive"),), "standard"),  # nor without a key
    (raiser, (("x-llmgw-priority", "interactive"),), "interactive"),  # unless the key allows it
    (Tenant("cfg-t", "t", team=Team("t", priority="batch", priority_header=True)),
     (("x-llmgw-priority", "interactive"),), "interactive"),  # or its team
    (Tenant("cfg-g", "g", priority="gone"), (), "standard"),  # a class a reload removed: the default
])
def test_a_requests_class_comes_from_its_key_its_team_and_the_header(tenant, headers, expected):
    priority = gate().priority_of(tenant, request(*headers))
    assert not isinstance(priority, Response)
    assert priority.name == expected


def test_a_header_naming_no_class_is_a_400_naming_it():
    answer = gate().priority_of(None, request(("x-llmgw-priority", "urgent")))
    assert isinstance(answer, Response) and answer.status == 400
    error = json.loads(answer.body)["error"]
    assert error["code"] == "unknown_priority_class" and "'urgent'" in error["message"]
    assert error["param"] == "x-llmgw-priority"


async def test_the_deadline_is_the_classes_max_wait_shortened_by_the_clients_headers():
    flow = gate()
    interactive = FlowSettings().by_name()["interactive"]  # max_wait 2s
    now = trio.current_time()
    assert flow.deadline(interactive, request()) == pytest.approx(now + 2.0, abs=0.05)
    soon = flow.deadline(interactive, request(("x-request-deadline", str(time.time() + 0.5))))
    assert soon == pytest.approx(now + 0.5, abs=0.05)
    later = flow.deadline(interactive, request(("x-request-deadline", str(time.time() + 100))))
    assert later == pytest.approx(now + 2.0, abs=0.05)  # never lengthened
    assert flow.deadline(interactive, request(("x-stainless-timeout", "1"))) == pytest.approx(now + 1.0, abs=0.05)
    assert flow.deadline(interactive, request(("x-stainless-timeout", "soon"))) == pytest.approx(now + 2.0, abs=0.05)
    passed = flow.deadline(interactive, request(("x-request-deadline", "1")))
    assert passed == pytest.approx(now, abs=0.05)  # long past: no wait at all


@given(st.text(max_size=80))
def test_a_deadline_header_is_a_number_or_a_400(text):
    async def main():
        answer = gate().deadline(FlowSettings().classes[0], request(("x-request-deadline", text)))
        if isinstance(answer, Response):
            assert answer.status == 400 and json.loads(answer.body)["error"]["code"] == "invalid_deadline"
        else:
            assert answer <= trio.current_time() + FlowSettings().classes[0].max_wait
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return
    trio.run(main)


async def test_enter_asks_the_queue_with_the_flow_cost_and_class_and_its_pass_releases_once():
    admitted = Admitted(0.25)
    flow = gate(admitted)
    control = flow.control
    assert isinstance(control, Recording)
    passed = await flow.enter(request(), team_key, "m", 1234, "req-1", output=1000)
    queued = control.entered[-1]
    assert (queued.model, queued.flow, queued.priority.name, queued.cost, queued.output) == \
        ("m", "search", "interactive", 1234, 1000)
    assert not isinstance(passed, Response)
    passed.release()
    passed.release()
    assert control.released == [admitted]
    assert flow.outcomes.get("req-1") is not None  # it waited: kept for /admin/explain
    await flow.enter(request(), batch_key, "m", 1, "req-2")
    assert control.entered[-1].flow == "b"  # a key without a team: its name
    await flow.enter(request(), None, "m", 1, "req-3")
    assert control.entered[-1].flow == ANONYMOUS


async def test_a_request_admitted_at_once_is_not_kept():
    flow = gate(Admitted(0.0))
    await flow.enter(request(), None, "m", 1, "req-1")
    assert flow.outcomes.get("req-1") is None


@pytest.mark.parametrize("reason, code", [(EXPIRED, "queue_timeout"), (UNSERVABLE, "queue_timeout"),
                                          (OVERFLOW, "queue_full")])
async def test_a_shed_request_is_a_429_with_retry_after_and_is_kept_for_explain(reason, code):
    flow = gate(Shed(reason, retry_after=7, waited=1.5, detail="12 requests ahead"))
    answer = await flow.enter(request(), batch_key, "m", 10, "req-9")
    assert isinstance(answer, Response) and answer.status == 429
    assert (b"retry-after", b"7") in answer.headers
    error = json.loads(answer.body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", code)
    assert "12 requests ahead" in error["message"]
    kept = flow.outcomes.get("req-9")
    assert kept is not None and kept.to_json()["reason"] == reason and kept.to_json()["retry_after"] == 7


async def test_flow_control_off_admits_everything_without_asking():
    flow = FlowGate(FlowSettings(enabled=False), Recording(Shed(OVERFLOW, 1, 0.0)), None)
    assert flow.control is None
    assert await flow.enter(request(), None, "m", 1, "r") is OPEN


def test_the_shed_message_names_the_model_and_class():
    answer = shed_response(Shed(EXPIRED, 3, 2.0), "llama", FlowSettings().by_name()["batch"])
    assert "'llama'" in json.loads(answer.body)["error"]["message"]
    assert "'batch'" in json.loads(answer.body)["error"]["message"]


def test_the_bench_of_the_gate_runs_and_reports_each_case():
    from llmgw.bench import flow_gate

    report = flow_gate.run(rounds=2, calls=50)
    assert set(report["us"]) == {"a keyed request", "with the priority header and a deadline"}
    assert all(us["min"] <= us["median"] <= us["max"] for us in report["us"].values())


async def test_the_trace_tells_the_access_log_a_requests_class_wait_and_shed_reason():
    trace = FlowTrace()
    await gate(Admitted(0.25)).enter(request(), batch_key, "m", 100, "r-1", trace)
    assert (trace.priority, trace.waited, trace.shed) == ("batch", 0.25, None)
    trace = FlowTrace()
    await gate(Shed(UNSERVABLE, 3, 0.0)).enter(request(), None, "m", 100, "r-2", trace)
    assert (trace.priority, trace.waited, trace.shed) == ("standard", 0.0, UNSERVABLE)


def test_a_requests_cost_without_a_keys_charge_is_the_tenancy_estimate_not_its_bytes():
    """The queue counts a request of no key (or of a gateway without keys) as the tenancy's estimate counts a
    key's: its prompt (the body's bytes, at most max_prompt_estimate) and most output (max_tokens, else the
    config's default_max_tokens), within the model's max_model_len; the two apart, for the room scales the prompt
    alone."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 700}
    raw = json.dumps(body).encode()
    chat = Request("POST", "/v1/chat/completions", [], raw)
    default = gate()
    cost = DataPlane._cost(default, Exchange(0.0, model="m"), chat, body)
    assert (cost.prompt_tokens, cost.max_output_tokens) == (len(raw), 700)
    no_limit = {k: v for k, v in body.items() if k != "max_tokens"}
    cost = DataPlane._cost(default, Exchange(0.0, model="m"), chat, no_limit)
    assert (cost.prompt_tokens, cost.max_output_tokens) == (len(raw), TenancySettings().default_max_tokens)
    short = FlowGate(FlowSettings(), Recording(AT_ONCE), None,
                     estimator=Estimator(TenancySettings(), PriceList(), {"m": 300}))
    cost = DataPlane._cost(short, Exchange(0.0, model="m"), chat, body)
    assert (cost.prompt_tokens, cost.max_output_tokens) == (300, 300)  # each within max_model_len
