"""Reading the engines' queue gauges out of their Prometheus text."""

from __future__ import annotations

from hypothesis import given, strategies as st

from llmgw.router.load_scraper import RUNNING, WAITING, parse_block_size, parse_gauge_sum

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


def test_the_block_size_is_read_from_vllms_cache_config_info():
    info = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="2000"} 1.0\n')
    assert parse_block_size(VLLM_TEXT + info) == 32
    assert parse_block_size(VLLM_TEXT) is None
    assert parse_block_size('vllm:cache_config_info{engine="0",block_size="16"} 1.0\n') == 16
    assert parse_block_size('vllm:cache_config_info{xblock_size="16"} 1.0\n') is None  # another label
    for bad in ('"0"', '"-1"', '"abc"', '"99999999999"', '"16'):
        assert parse_block_size(f'vllm:cache_config_info{{block_size={bad}}} 1.0\n') is None


@given(st.text(max_size=300))
def test_any_exposition_text_gives_a_block_size_or_none(text):
    size = parse_block_size(text)
    assert size is None or 0 < size <= 1 << 16
    size = parse_block_size("vllm:cache_config_info{" + text)
    assert size is None or 0 < size <= 1 << 16
