"""Simulator settings: vLLM's --kv-events-config, endpoint rules, CLI flags."""

from __future__ import annotations

import msgpack
import pytest

from llmgw.kv.codec import encode_batch
from llmgw.kv.events import BlockRemoved, BlockStored, EventBatch
from llmgw.sim.cli import _strip_ignored, build_parser, config_from_args
from llmgw.sim.config import KVEventsConfig, SimArgumentError, SimConfig, binds, offset_endpoint, parse_drop_seqs
from llmgw.sim.publisher import connectable, layout_trimmer


def test_kv_events_config_defaults_and_publisher_resolution():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.topic) == \
        ("zmq", "tcp://*:5557", None, 10000, 100000, "")
    assert KVEventsConfig.from_json("{}").publisher == "null"
    for bad in ("[]", "{", '{"bogus": 1}', '{"publisher": "kafka"}', '{"hwm": -1}'):
        with pytest.raises(SimArgumentError):
            KVEventsConfig.from_json(bad)


@pytest.mark.parametrize("endpoint,expected", [
    ("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv", True), ("inproc://kv", True),
    ("tcp://127.0.0.1:5557", False), ("tcp://agent.local:5557", False)])
def test_bind_or_connect(endpoint, expected):
    assert binds(endpoint) is expected


def test_data_parallel_offsets():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(SimArgumentError):
        offset_endpoint("ipc:///tmp/kv", 1)


def test_drop_seqs():
    every = parse_drop_seqs("every:3")
    assert [s for s in range(10) if every(s)] == [3, 6, 9]
    listed = parse_drop_seqs("1, 4")
    assert [s for s in range(10) if listed(s)] == [1, 4]
    for bad in ("every:0", "x"):
        with pytest.raises(SimArgumentError):
            parse_drop_seqs(bad)


def test_max_model_len_follows_the_cache():
    assert SimConfig(num_blocks=65, block_size=16).resolve().max_model_len == 1024
    assert SimConfig().resolve().max_model_len == 8192
    with pytest.raises(SimArgumentError):
        SimConfig(num_blocks=65, max_model_len=2048).resolve()


def test_cli_flags_and_ignored_vllm_flags():
    argv = ["/models/llama", "--tensor-parallel-size", "2", "--enforce-eager", "--dtype=bfloat16",
            "--served-model-name", "a", "b", "--kv-events-config", '{"enable_kv_cache_events": true}',
            "--no-enable-prefix-caching", "--num-gpu-blocks-override", "99", "--lora-modules", "sql=/p/sql",
            "--output-tokens", "2:3", "--engine-id", "1"]
    kept, ignored = _strip_ignored(argv)
    assert ignored == ["--enforce-eager", "--dtype"]  # -tp is read: GPU profiles split the model over it
    config = config_from_args(build_parser().parse_args(kept)).resolve()
    assert config.tensor_parallel_size == 2 and config.profile == "h100-llama-3.1-8b"  # the default: a GPU
    assert config.model == "/models/llama" and config.served_model_names == ["a", "b"]
    assert config.kv_events.publishing and not config.enable_prefix_caching
    assert config.num_blocks == 99 and config.output_tokens == (2, 3) and config.data_parallel_rank == 1
    assert [(m.name, m.path, m.lora_id) for m in config.lora_modules] == [("sql", "/p/sql", 1)]
    assert config.prefix_caching_hash_algo == "sha256" and config.event_fields == 14


@pytest.mark.parametrize("layout,fields,stored_len,removed_len", [
    ("array", 5, 6, 2), ("array", 6, 7, 3), ("array", 8, 9, 3), ("array", 9, 10, 4), ("array", 11, 12, 4)])
def test_older_array_layouts_publish_only_their_fields(layout, fields, stored_len, removed_len):
    SimConfig(event_layout=layout, event_fields=fields).resolve()
    stored = BlockStored([1], None, list(range(16)), 16, None, "GPU", None, [None], 0, "full_attention")
    batch = EventBatch(1.0, [stored, BlockRemoved([1], medium="GPU", group_idx=0)], 0)
    trim = layout_trimmer(layout, fields)
    payload = encode_batch(trim(batch) if trim else batch, layout=layout, fields=fields)
    _, (ev_stored, ev_removed), _ = msgpack.unpackb(payload)
    assert (len(ev_stored), len(ev_removed)) == (stored_len, removed_len)


def test_bad_event_fields():
    with pytest.raises(SimArgumentError):
        SimConfig(event_layout="map", event_fields=9).resolve()


def test_connectable_endpoints():
    assert connectable("tcp://0.0.0.0:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert connectable("tcp://[::]:5557", "h") == "tcp://h:5557"
    assert connectable("tcp://127.0.0.1:5557", "h") == "tcp://127.0.0.1:5557"
    assert connectable("ipc:///tmp/kv", "h") == "ipc:///tmp/kv"


def test_chunked_prefill_budget_defaults_as_vllm():
    assert SimConfig().resolve().max_num_batched_tokens == 2048
    whole = SimConfig(enable_chunked_prefill=False, max_model_len=4096).resolve()
    assert whole.max_num_batched_tokens == 4096
    with pytest.raises(SimArgumentError, match="without chunked prefill every prompt must fit in one step"):
        SimConfig(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=1024).resolve()


def test_the_default_profile_is_a_gpu_and_the_constant_rates_need_the_constant_profile():
    default = config_from_args(build_parser().parse_args([])).resolve()
    assert default.profile == "h100-llama-3.1-8b" and default.gpu_profile is not None
    assert default.num_blocks == default.gpu_profile.num_blocks(16, 0.9) > 20_000  # what an H100's memory holds
    with pytest.raises(SimArgumentError, match="--profile constant"):
        config_from_args(build_parser().parse_args(["--decode-ms-per-step", "30"])).resolve()
    constant = config_from_args(build_parser().parse_args(["--profile", "constant", "--decode-ms-per-step", "30"]))
    assert constant.resolve().gpu_profile is None and constant.num_blocks == 1024 and constant.decode_ms_per_step == 30


def test_the_demo_runs_its_engines_on_the_default_gpu_profile(tmp_path):
    from llmgw.commands.serve import demo_config_text
    from llmgw.config import parse_config

    config = parse_config(demo_config_text(2, str(tmp_path)))
    (profile,) = config.profiles
    assert profile.engine == "sim" and profile.args == ["--profile", "h100-llama-3.1-8b"]
    demo = config_from_args(build_parser().parse_args(profile.args)).resolve()
    assert demo.gpu_profile is not None and demo.decode_ms_per_step is None  # a GPU's step, not the constant one


def test_suppress_events_names_known_event_types_only():
    args = build_parser().parse_args(["--suppress-events", "AllBlocksCleared, BlockRemoved"])
    assert config_from_args(args).resolve().suppress_events == ("AllBlocksCleared", "BlockRemoved")
    assert config_from_args(build_parser().parse_args([])).resolve().suppress_events == ()
    with pytest.raises(SimArgumentError, match="BlockEvicted"):
        config_from_args(build_parser().parse_args(["--suppress-events", "BlockEvicted"])).resolve()
