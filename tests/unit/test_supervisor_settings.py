"""The agent's supervisor defaults that bound how soon a started engine serves (llmgw/agent/supervisor.py)."""

from __future__ import annotations

from llmgw.agent.supervisor import SupervisorSettings


def test_a_loading_engine_is_probed_every_tenth_of_a_second():
    # A replica enters routing when its agent's probe sees /health answer: a scale-up or a start from zero serves
    # up to one loading interval after its engine is ready (0.5 s was 5 fleet seconds in `llmgw bench autoscale`).
    loading, ready = SupervisorSettings().probe_interval
    assert loading <= 0.1
    assert ready == 2.0  # a ready engine is not probed any more often than before
