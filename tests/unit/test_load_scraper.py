"""Reading the engines' queue gauges out of their Prometheus text."""

from __future__ import annotations

from llmgw.router.load_scraper import RUNNING, WAITING, parse_gauge_sum

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 100.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1e1
"""


def test_samples_of_every_engine_are_summed_and_longer_names_are_not_confused():
    assert parse_gauge_sum(VLLM_TEXT, RUNNING) == 5.0
    assert parse_gauge_sum(VLLM_TEXT, WAITING) == 17.0


def test_a_missing_metric_or_a_bad_value_is_none_not_zero():
    assert parse_gauge_sum("# nothing here\n", RUNNING) is None
    assert parse_gauge_sum("vllm:num_requests_running NaNx\n", RUNNING) is None
    assert parse_gauge_sum("vllm:num_requests_running 4\n", RUNNING) == 4.0
