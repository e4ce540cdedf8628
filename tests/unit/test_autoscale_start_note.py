"""How a step up's replicas start, as its reason and /admin/autoscale's ``start`` say (llmgw/autoscale/actuator.py):
the sleeping replicas woken first, then those kept warm awake adopted, the rest cold."""

from __future__ import annotations

import re

from hypothesis import given, strategies as st

from llmgw.autoscale.actuator import decision_json, start_note
from llmgw.autoscale.model import ScaleDecision


def test_a_step_up_says_woke_when_a_replica_sleeps_else_a_cold_start():
    assert start_note(1, sleeping=0, parked=0) == "a cold start"
    assert start_note(2, sleeping=0, parked=0) == "2 cold starts"
    assert start_note(1, sleeping=1, parked=1) == "woke 1 sleeping replica (a hot start)"
    assert start_note(1, sleeping=0, parked=1) == "adopted 1 replica kept warm (a hot start)"
    assert start_note(4, sleeping=2, parked=3) == ("woke 2 sleeping replicas (a hot start) and adopted 1 replica "
                                                   "kept warm (a hot start) and 1 cold start")


@given(st.integers(1, 20), st.integers(0, 20), st.integers(0, 20))
def test_every_replica_of_a_step_is_accounted_for_once(added, sleeping, awake):
    note = start_note(added, sleeping=sleeping, parked=sleeping + awake)
    counted = sum(int(started or cold) for started, cold in re.findall(r"(?:woke|adopted) (\d+)|(\d+) cold start",
                                                                       note))
    counted += note == "a cold start"
    assert counted == added, note


def test_admin_autoscale_shows_the_start_beside_the_scalers_reason():
    decision = ScaleDecision("chat", "chat", 12.0, 0, 1, "from_zero", "1 request waiting")
    shown = decision_json(decision, "woke 1 sleeping replica (a hot start)")
    assert (shown["reason"], shown["start"]) == ("1 request waiting; woke 1 sleeping replica (a hot start)",
                                                 "woke 1 sleeping replica (a hot start)")
    assert decision_json(decision)["reason"] == "1 request waiting" and decision_json(decision)["start"] is None
