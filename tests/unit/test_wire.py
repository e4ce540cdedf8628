"""Every wire message round-trips; unknown values decode to the safe side; bad frames are WireErrors."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from llmgw import wire
from llmgw.wire import (
    FabricInfo,
    GpuFabric,
    GpuHealth,
    GpuInfo,
    Hca,
    ImexInfo,
    KvChangeKind,
    KvChanges,
    LoraModule,
    MigInfo,
    NicPath,
    Register,
    ShardProfile,
    ShardReport,
    ShardState,
    ShardStatus,
    StartShard,
    UnknownMessage,
    WireError,
)

REPORT = ShardReport(shard_id="r1/0", replica_id="r1", rank=0, node_count=2, state=ShardState.READY, reason="ok",
                     pid=4242, http_port=9000, endpoint="http://10.0.0.1:9000", fingerprint="abc", generation=3,
                     gpu_indices=[0, 1], restarts=1, model="tiny", started_at=12.5, log_tail=["line"])

SAMPLES = [
    Register(node_id="n1", token="s3cret", hostname="h", address="10.0.0.1", labels={"zone": "a"},
             agent_version="0.1.0", features=["kv_events"], engine_versions={"vllm": "0.32.0"},
             host=wire.HostInfo(os="Linux", arch="x86_64", cpu_flags=["avx2"]), cpu_count=64, memory_bytes=1 << 40,
             gpus=[GpuInfo(index=0, uuid="GPU-0", name="H100", memory_total=80 << 30, compute_capability="9.0",
                           numa_node=0, pci_bus_id="0000:18:00.0", nvlink_peers=["GPU-1"],
                           nic_paths=[NicPath("mlx5_0", "PIX")],
                           fabric=GpuFabric("completed", "success", "uuid", 7, 900.0),
                           health=GpuHealth(0, 41.0, []), mig=MigInfo("GPU-P", "1g.10gb", 1, 0))],
             imex=ImexInfo("ready", [0]),
             fabrics=[FabricInfo("infiniband", "ib0", [Hca("mlx5_0", 1, "ACTIVE", 400.0)])],
             storage=[wire.StorageInfo("/", 100, 50)], local_weights=[wire.LocalWeights("/m", "m", 10)],
             shards=[REPORT]),
    wire.Registered(accepted=False, reason="bad token", node_id="n1", heartbeat_interval=5.0),
    wire.Heartbeat(seq=7, sent_at=1.5, gpu_utilization={"GPU-0": 93.0}, gpu_memory_used={"GPU-0": 1 << 30}),
    StartShard(shard_id="r1/1", replica_id="r1", rank=1, node_count=2, leader_address="10.0.0.1", leader_port=29500,
               gpu_indices=[0, 1], gpu_uuids=["GPU-0", "GPU-1"], hcas=["mlx5_0"], http_port=0,
               profile=ShardProfile(name="p", engine="vllm", model_path="/m", served_model_name="tiny", tp=2, pp=2,
                                    args=["--x"], env={"A": "1"}, lora_adapters=[LoraModule("sql", "/l")],
                                    kv_events=True, startup_timeout=3600.0),
               pool="default", fabric="ib0", fingerprint="f", generation=4, engine_api_key="k", cpu_threads=8),
    wire.StopShard(shard_id="s", reason="unwanted", grace=5.0),
    wire.DrainShard(shard_id="s", reason="scale down", timeout=60.0, grace=10.0),
    wire.SleepShard(shard_id="s", reason="scaled down with keep_warm", level=1, timeout=120.0),
    wire.WakeShard(shard_id="s", reason="wanted again", timeout=600.0),
    ShardStatus(shard=REPORT),
    KvChanges(shard_id="s", replica_id="r", data_parallel_rank=1, kind=KvChangeKind.FULL, block_size=16,
              stored=[1, 2**64 - 1], removed=[3], reason="reconnect"),
    wire.KvResync(shard_id="s", replica_id="r", data_parallel_rank=0, mode="reset", reason="drift"),
    wire.ErrorMessage(code="not_yours", message="shard s is placed on node n2", about="s"),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert wire.decode(wire.encode(message)) == message


def test_every_message_type_has_a_sample():
    assert {type(m).__name__ for m in SAMPLES} == set(wire.Message.TYPES)


def test_an_unknown_shard_state_decodes_to_failed_never_ready():
    frame = msgpack.packb({"v": 1, "t": "ShardStatus", "shard": {"shard_id": "s", "state": "warming-up"}})
    assert wire.decode(frame).shard.state is ShardState.FAILED


def test_an_unknown_kv_change_kind_decodes_to_reset():
    frame = msgpack.packb({"v": 1, "t": "KvChanges", "kind": "sparkles", "stored": [1]})
    assert wire.decode(frame).kind is KvChangeKind.RESET


def test_unknown_fields_are_ignored_and_missing_ones_default():
    frame = msgpack.packb({"v": 1, "t": "StopShard", "shard_id": "s", "from_the_future": {"x": 1}})
    assert wire.decode(frame) == wire.StopShard(shard_id="s")


def test_an_unknown_message_type_is_kept_for_counting():
    decoded = wire.decode(msgpack.packb({"v": 1, "t": "Teleport", "to": "mars"}))
    assert decoded == UnknownMessage("Teleport", {"to": "mars"})


@pytest.mark.parametrize("frame, match", [
    (b"\xc1", "msgpack"),
    (msgpack.packb([1, 2]), "map"),
    (msgpack.packb({"v": 2, "t": "StopShard"}), "version"),
    (msgpack.packb({"v": 1, "t": "StopShard", "grace": "soon"}), "StopShard.grace"),
    (msgpack.packb({"v": 1, "t": "StartShard", "gpu_indices": [0, "one"]}), r"gpu_indices\[1\]"),
    (msgpack.packb({"v": 1, "t": "ShardStatus", "shard": [1]}), "ShardStatus.shard"),
    (msgpack.packb({"v": 1, "t": "KvChanges", "stored": [True]}), "stored"),
])
def test_bad_frames_raise_wire_errors_naming_the_field(frame, match):
    with pytest.raises(WireError, match=match):
        wire.decode(frame)


def test_secrets_stay_out_of_repr():
    assert "s3cret" not in repr(SAMPLES[0])
    assert "engine_api_key='k'" not in repr(SAMPLES[3])


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
                    | st.text() | st.binary(),
                    lambda children: st.lists(children) | st.dictionaries(st.text(), children), max_leaves=20),
       st.sampled_from(sorted(wire.Message.TYPES)))
def test_fuzzed_frames_decode_or_raise_wire_error(payload, type_name):
    fields = payload if isinstance(payload, dict) else {"shard": payload, "gpus": payload, "stored": payload}
    frame = msgpack.packb({"v": 1, "t": type_name, **fields}, use_bin_type=True)
    try:
        decoded = wire.decode(frame)
    except WireError:
        return
    assert dataclasses.is_dataclass(decoded)


def test_node_secrets_and_placement_proofs_round_trip_and_stay_out_of_repr():
    report = ShardReport(shard_id="s", placement_proof="proof-1")
    messages = [Register(node_id="n", node_secret="secret-1", shards=[report]),
                wire.Registered(node_id="n", node_secret="secret-2"),
                StartShard(shard_id="s", placement_proof="proof-2"), ShardStatus(shard=report)]
    for message in messages:
        assert wire.decode(wire.encode(message)) == message
        assert "secret-" not in repr(message) and "proof-" not in repr(message)
    older = wire.encode(Register(node_id="n"))  # an agent from before node identities: no secret, no proof
    assert wire.decode(older).node_secret == ""
    assert wire.decode(wire.encode(ShardStatus(shard=ShardReport()))).shard.placement_proof == ""
