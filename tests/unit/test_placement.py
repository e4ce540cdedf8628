"""Placement over recorded fixture nodes: GPU choice, every filter's reason, tp x pp fit, gangs,
determinism, spread and binpack, existing placements; the profile fingerprint; ``llmgw plan``."""

from __future__ import annotations

import dataclasses
import http.server
import json
import random
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from llmgw import wire
from llmgw.agent.discovery import AutoProvider, FakeNvml, RecordedHost, discover
from llmgw.config import parse_config
from llmgw.config.schema import Deployment, LoraAdapter, Placement, Profile
from llmgw.control.fingerprint import canonical_profile, profile_fingerprint
from llmgw.control.placement import (
    DEFAULT_LEADER_PORT,
    REPLICA_WIDE,
    GpuDemand,
    NodeView,
    ReplicaPlacement,
    ShardPlacement,
    Unplaced,
    class_matches,
    place,
    plan_all,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nodes"
LLMGW = [sys.executable, "-m", "llmgw"]


# -- helpers ----------------------------------------------------------------------------------------------------------


def fixture_doc(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def register_of(doc: dict, node_id: str, address: str) -> wire.Register:
    provider = AutoProvider(nvml=FakeNvml(doc["nvml"]), host=RecordedHost(doc["host"]))
    return provider.discover(node_id=node_id, address=address, labels=doc.get("labels"))


def node(name: str, node_id: str | None = None, *, used=(), schedulable: bool = True, address: str | None = None,
         edit=None) -> NodeView:
    """A NodeView of fixture ``name``; ``node_id`` other than the name makes a twin with its own GPU UUIDs."""
    doc = fixture_doc(name)
    node_id = node_id or name
    if node_id != name and doc["nvml"]:
        for device in doc["nvml"]["devices"]:
            device["uuid"] = f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, node_id + device['uuid'])}"
    if edit:
        edit(doc)
    register = register_of(doc, node_id, address or f"addr-{node_id}")
    return NodeView.from_register(register, used_gpus=used, schedulable=schedulable)


def profile(name: str = "p", **fields) -> Profile:
    fields.setdefault("engine", "vllm")
    fields.setdefault("model_path", "/models/m")
    fields.setdefault("served_model_name", name)
    fields.setdefault("gpus_per_node", fields.get("tp", 1) * fields.get("pp", 1) // fields.get("nodes", 1))
    return Profile(name=name, **fields)


def deployment(profile_name: str = "p", replicas: int = 1, **placement) -> Deployment:
    return Deployment(profile=profile_name, replicas=replicas, placement=Placement(**placement))


def placed(outcome) -> ReplicaPlacement:
    assert isinstance(outcome, ReplicaPlacement), outcome
    return outcome


def unplaced(outcome) -> Unplaced:
    assert isinstance(outcome, Unplaced), outcome
    return outcome


def as_plain(result) -> dict:
    return dataclasses.asdict(result)


# -- choosing GPUs ----------------------------------------------------------------------------------------------------


def test_a_tp4_shard_takes_one_nvlink_island_and_numa_node():
    shard, = placed(place(profile(gpu_class="H100", tp=4), deployment(), "p-0", [node("dgx-h100-8gpu")])).shards
    assert shard.gpu_indices == [0, 1, 2, 3] and shard.rank == 0
    dgx = node("dgx-h100-8gpu")
    assert shard.gpu_uuids == [gpu.uuid for gpu in dgx.gpus[:4]]
    assert (shard.leader_address, shard.leader_port) == ("addr-dgx-h100-8gpu", 0)

    # GPU 0 taken: NUMA node 0 has 3 left, so the shard moves to NUMA node 1 whole.
    shard, = placed(place(profile(gpu_class="H100", tp=4), deployment(), "p-0",
                          [node("dgx-h100-8gpu", used={0})])).shards
    assert shard.gpu_indices == [4, 5, 6, 7]

    # Neither NUMA node has 4 free: the shard stays inside the NVSwitch island.
    shard, = placed(place(profile(gpu_class="H100", tp=4), deployment(), "p-0",
                          [node("dgx-h100-8gpu", used={0, 4})])).shards
    assert shard.gpu_indices == [1, 2, 3, 5]


def test_a_single_gpu_shard_packs_the_fullest_group():
    shard, = placed(place(profile(gpu_class="H100"), deployment(), "p-0",
                          [node("dgx-h100-8gpu", used={0, 1, 4})])).shards
    assert shard.gpu_indices == [2]  # NUMA node 0 has 2 free, node 1 has 3: best fit


def test_pcie_gpus_without_nvlink_still_fit_a_tp2_shard():
    shard, = placed(place(profile(gpu_class="L4", tp=2), deployment(), "p-0", [node("l4-2gpu")])).shards
    assert shard.gpu_indices == [0, 1]


def test_tp_times_pp_gpus_are_claimed():
    shard, = placed(place(profile(gpu_class="H100", tp=2, pp=2), deployment(), "p-0", [node("dgx-h100-8gpu")])).shards
    assert shard.gpu_indices == [0, 1, 2, 3]
    result = placed(place(profile(gpu_class="H100", tp=4, pp=2, nodes=2), deployment(), "p-0",
                          [node("dgx-h100-8gpu", "dgx-a"), node("dgx-h100-8gpu", "dgx-b")]))
    assert [len(shard.gpu_indices) for shard in result.shards] == [4, 4]


def test_mig_instances_are_placed_only_when_asked_for():
    a100 = node("a100-mig")
    # "A100" means a whole GPU: GPU 0 is split into MIG instances, so only GPU 1 qualifies.
    shard, = placed(place(profile(gpu_class="A100"), deployment(), "p-0", [a100])).shards
    assert shard.gpu_indices == [1]
    why = unplaced(place(profile(gpu_class="A100", tp=2), deployment(), "p-0", [a100])).reasons["a100-mig"]
    assert why == "1 free GPU, needs 2 (1 split into MIG instances)"
    shard, = placed(place(profile(gpu_class="1g.5gb"), deployment(), "p-0", [a100])).shards
    assert shard.gpu_indices == [1002] and shard.gpu_uuids[0].startswith("MIG-")
    shard, = placed(place(profile(gpu_class="A100 MIG 3g.20gb"), deployment(), "p-0", [a100])).shards
    assert shard.gpu_indices == [1000]
    why = unplaced(place(profile(gpu_class="MIG", tp=2), deployment(), "p-0", [a100])).reasons["a100-mig"]
    assert why == "0 free GPUs, needs 2 (4 MIG instances, which cannot be combined)"


def test_gpu_class_matches_whole_words_in_order():
    def gpu(name, mig=None):
        return wire.GpuInfo(name=name, mig=mig)

    assert class_matches("H100", gpu("NVIDIA H100 80GB HBM3"))
    assert class_matches("h100 hbm3", gpu("NVIDIA H100 80GB HBM3"))
    assert class_matches("A100-SXM4", gpu("NVIDIA A100-SXM4-80GB"))
    assert not class_matches("L4", gpu("NVIDIA L40S"))
    assert not class_matches("B200", gpu("NVIDIA GB200"))
    assert not class_matches("HBM3 H100", gpu("NVIDIA H100 80GB HBM3"))
    assert class_matches(None, gpu("anything"))
    mig = gpu("NVIDIA A100-SXM4-40GB MIG 1g.5gb", wire.MigInfo(profile="1g.5gb"))
    assert not class_matches(None, mig) and not class_matches("A100", mig)
    assert class_matches("1g.5gb", mig) and class_matches("mig", mig) and class_matches("A100 MIG", mig)


# -- every filter says why ---------------------------------------------------------------------------------------------


def test_each_filter_gives_its_reason():
    nodes = [node("l4-2gpu", used={1}), node("dgx-h100-8gpu"), node("cpu-only"), node("tiny-2gpu-a", schedulable=False),
             node("tiny-2gpu-b"), node("gb200-nvl-rack-node")]
    result = unplaced(place(profile(gpu_class="L4", tp=2, labels={"zone": "b"}),
                            deployment(node_selector={"rack": "r1"},
                                       nodes=["l4-2gpu", "dgx-h100-8gpu", "cpu-only", "tiny-2gpu-a", "tiny-2gpu-b"]),
                            "p-0", nodes))
    assert result.reasons == {
        "cpu-only": "label rack=r1 required, missing",
        "dgx-h100-8gpu": "label zone=b required, has zone=a",
        "gb200-nvl-rack-node": "not in placement.nodes",
        "l4-2gpu": "label rack=r1 required, missing",
        "tiny-2gpu-a": "not connected",
        "tiny-2gpu-b": "label rack=r1 required, missing",
    }
    assert result.replica_id == "p-0" and result.profile == "p"


def test_reasons_for_gpus_that_do_not_fit():
    nodes = [node("l4-2gpu", used={1}), node("dgx-h100-8gpu"), node("cpu-only"), node("tiny-2gpu-a", schedulable=False)]
    result = unplaced(place(profile(gpu_class="L4", tp=2), deployment(), "p-0", nodes))
    assert result.reasons == {
        "cpu-only": "gpu_class L4 not present (no GPUs)",
        "dgx-h100-8gpu": "gpu_class L4 not present (has 8x NVIDIA H100 80GB HBM3)",
        "l4-2gpu": "1 free GPU, needs 2 (1 in use)",
        "tiny-2gpu-a": "not connected",
    }
    assert unplaced(place(profile(gpu_class="H100", tp=16), deployment(), "p-0", [node("dgx-h100-8gpu")])) \
        .reasons == {"dgx-h100-8gpu": "8 free GPUs, needs 16"}


def test_unhealthy_gpus_are_not_used():
    def break_gpu_zero(doc):
        doc["nvml"]["devices"][0]["ecc"]["uncorrected_volatile"] = 1

    sick = node("l4-2gpu", edit=break_gpu_zero)
    shard, = placed(place(profile(gpu_class="L4"), deployment(), "p-0", [sick])).shards
    assert shard.gpu_indices == [1]
    assert unplaced(place(profile(gpu_class="L4", tp=2), deployment(), "p-0", [sick])).reasons == {
        "l4-2gpu": "1 free GPU, needs 2 (1 unhealthy)"}


def test_no_nodes_at_all():
    assert unplaced(place(profile(), deployment(), "p-0", [])).reasons == {REPLICA_WIDE: "no nodes known"}


# -- GPU demand -------------------------------------------------------------------------------------------------------


def test_a_profile_without_gpu_class_prefers_gpus_and_runs_on_gpu_less_nodes_otherwise():
    cpu, tiny = node("cpu-only"), node("tiny-2gpu-a")
    shard, = placed(place(profile(engine="sim"), deployment(), "p-0", [cpu, tiny])).shards
    assert (shard.node_id, shard.gpu_indices) == ("tiny-2gpu-a", [0])
    full = node("tiny-2gpu-a", used={0, 1})
    shard, = placed(place(profile(engine="sim"), deployment(), "p-0", [cpu, full])).shards
    assert (shard.node_id, shard.gpu_indices, shard.gpu_uuids) == ("cpu-only", [], [])


def test_gpu_class_cpu_never_claims_gpus_and_demand_can_be_overridden():
    shard, = placed(place(profile(gpu_class="cpu"), deployment(), "p-0", [node("tiny-2gpu-a")])).shards
    assert shard.gpu_indices == []
    result = unplaced(place(profile(), deployment(), "p-0", [node("cpu-only")], demand=GpuDemand.REQUIRED))
    assert result.reasons == {"cpu-only": "no GPUs"}


# -- gangs ------------------------------------------------------------------------------------------------------------


def test_a_two_node_profile_is_placed_as_a_gang_with_leader_and_ranks():
    nodes = [node("tiny-2gpu-b", address="10.0.0.2"), node("tiny-2gpu-a", address="10.0.0.1")]
    result = placed(place(profile(gpu_class="L4", tp=2, nodes=2), deployment(), "p-0", nodes))
    assert [(s.node_id, s.rank, s.gpu_indices) for s in result.shards] == [("tiny-2gpu-a", 0, [0]),
                                                                            ("tiny-2gpu-b", 1, [0])]
    assert {(s.leader_address, s.leader_port) for s in result.shards} == {("10.0.0.1", DEFAULT_LEADER_PORT)}
    assert result.leader.node_id == "tiny-2gpu-a" and result.node_ids == ["tiny-2gpu-a", "tiny-2gpu-b"]


def test_a_gang_is_not_placed_at_all_when_only_one_node_fits():
    nodes = [node("tiny-2gpu-a"), node("tiny-2gpu-b", used={0, 1}), node("dgx-h100-8gpu"), node("cpu-only")]
    result = unplaced(place(profile(gpu_class="L4", tp=2, nodes=2), deployment(), "p-0", nodes))
    assert result.reasons == {
        "cpu-only": "gpu_class L4 not present (no GPUs)",
        "dgx-h100-8gpu": "gpu_class L4 not present (has 8x NVIDIA H100 80GB HBM3)",
        "tiny-2gpu-a": "gang needs 2 nodes, 1 fits (fabric tcp, L4)",
        "tiny-2gpu-b": "0 free GPUs, needs 1 (2 in use)",
    }


def test_gang_ranks_share_a_fabric_and_a_gpu_class():
    def other_subnet(doc):
        for hca in doc["host"]["infiniband"]:
            hca["gid"] = "fe80:0000:0000:0002" + hca["gid"][19:]

    nodes = [node("dgx-h100-8gpu", "dgx-a"), node("dgx-h100-8gpu", "dgx-b", edit=other_subnet),
             node("dgx-h100-8gpu", "dgx-c")]
    result = placed(place(profile(gpu_class="H100", tp=8, nodes=2), deployment(), "p-0", nodes))
    assert result.node_ids == ["dgx-a", "dgx-c"]
    result = unplaced(place(profile(gpu_class="H100", tp=8, nodes=2), deployment(), "p-0", nodes[:2]))
    assert result.reasons == {
        "dgx-a": "gang needs 2 nodes, 1 fits (fabric infiniband:fe80:0000:0000:0000, NVIDIA H100 80GB HBM3)",
        "dgx-b": "gang needs 2 nodes, 1 fits (fabric infiniband:fe80:0000:0000:0002, NVIDIA H100 80GB HBM3)",
    }
    # Identical fabrics, different GPUs: no gang either.
    result = unplaced(place(profile(tp=2, nodes=2), deployment(), "p-0", [node("tiny-2gpu-a"), node("l4-2gpu")]))
    assert result.reasons == {"l4-2gpu": "gang needs 2 nodes, 1 fits (fabric tcp, NVIDIA L4)",
                              "tiny-2gpu-a": "gang needs 2 nodes, 1 fits (fabric tcp, L4)"}


def test_gangs_prefer_an_nvlink_clique_and_need_imex_for_it():
    def other_subnet(doc):
        for hca in doc["host"]["infiniband"]:
            hca["gid"] = "fe80:0000:0000:0009" + hca["gid"][19:]

    nodes = [node("gb200-nvl-rack-node", "tray-1"), node("gb200-nvl-rack-node", "tray-2", edit=other_subnet)]
    assert nodes[0].fabrics == ["infiniband:fe80:0000:0000:0000",
                                "nvlink:5b8f4a2c-9d3e-4f61-8a7b-2c1d0e9f8a76/32766"]
    result = placed(place(profile(gpu_class="GB200", tp=8, nodes=2), deployment(), "p-0", nodes))
    assert result.node_ids == ["tray-1", "tray-2"]

    def no_imex(doc):
        other_subnet(doc)
        doc["host"]["imex_channels"] = []

    nodes = [node("gb200-nvl-rack-node", "tray-1"), node("gb200-nvl-rack-node", "tray-2", edit=no_imex)]
    assert nodes[1].fabrics == ["infiniband:fe80:0000:0000:0009"]
    assert isinstance(place(profile(gpu_class="GB200", tp=8, nodes=2), deployment(), "p-0", nodes), Unplaced)


def test_gang_leaders_on_one_node_get_distinct_ports():
    gang = profile("gang", gpu_class="L4", tp=2, nodes=2)
    result = plan_all([gang], [deployment("gang", replicas=2)], [node("tiny-2gpu-a"), node("tiny-2gpu-b")])
    assert [(p.leader.node_id, p.leader.leader_port) for p in result.placed] == [
        ("tiny-2gpu-a", DEFAULT_LEADER_PORT), ("tiny-2gpu-a", DEFAULT_LEADER_PORT + 1)]
    assert [p.shards[1].gpu_indices for p in result.placed] == [[0], [1]]
    custom = placed(place(gang, deployment("gang"), "gang-0", [node("tiny-2gpu-a"), node("tiny-2gpu-b")],
                          leader_port=lambda leader: 40000 + len(leader.node_id)))
    assert custom.leader.leader_port == 40011


# -- plans ------------------------------------------------------------------------------------------------------------


def mixed_cluster() -> tuple[list[Profile], list[Deployment], list[NodeView]]:
    profiles = [profile("h100", gpu_class="H100", tp=4), profile("l4", gpu_class="L4"), profile("sim", engine="sim"),
                profile("gang", gpu_class="L4", tp=2, nodes=2), profile("mig", gpu_class="1g.5gb"),
                profile("big", gpu_class="H100", tp=8, nodes=2)]
    deployments = [deployment("h100", 3), deployment("l4", 2), deployment("sim", 3), deployment("gang", 1),
                   deployment("mig", 3), deployment("big", 1)]
    nodes = [node(name) for name in ("dgx-h100-8gpu", "a100-mig", "l4-2gpu", "gb200-nvl-rack-node", "cpu-only",
                                     "tiny-2gpu-a", "tiny-2gpu-b")]
    return profiles, deployments, nodes


def test_plan_all_places_every_wanted_replica_or_says_why():
    profiles, deployments, nodes = mixed_cluster()
    result = plan_all(profiles, deployments, nodes)
    ids = [p.replica_id for p in result.placed] + [u.replica_id for u in result.unplaced]
    assert sorted(ids) == sorted(["h100-0", "h100-1", "h100-2", "l4-0", "l4-1", "sim-0", "sim-1", "sim-2",
                                  "gang-0", "mig-0", "mig-1", "mig-2", "big-0"])
    assert {u.replica_id for u in result.unplaced} == {"h100-2", "mig-2", "big-0"}
    assert not result.ok
    claimed = [(shard.node_id, index) for p in result.placed for shard in p.shards for index in shard.gpu_indices]
    assert len(claimed) == len(set(claimed))  # no GPU given twice
    assert {u.replica_id: set(u.reasons) for u in result.unplaced}["big-0"] == {n.node_id for n in nodes}
    # The input nodes are not modified.
    assert all(not n.used_gpus and not n.replica_counts for n in nodes)


def test_plans_are_deterministic_whatever_the_node_order():
    profiles, deployments, nodes = mixed_cluster()
    expected = as_plain(plan_all(profiles, deployments, nodes))
    shuffler = random.Random(7)
    for _ in range(10):
        shuffled = list(nodes)
        shuffler.shuffle(shuffled)
        assert as_plain(plan_all(profiles, deployments, shuffled)) == expected


def test_spread_prefers_other_nodes_and_binpack_fills_one():
    nodes = [node("tiny-2gpu-a"), node("tiny-2gpu-b")]
    spread = plan_all([profile("s")], [deployment("s", 2)], nodes)
    assert [p.leader.node_id for p in spread.placed] == ["tiny-2gpu-a", "tiny-2gpu-b"]
    packed = plan_all([profile("s")], [deployment("s", 2, spread=False)], nodes)
    assert [(p.leader.node_id, p.leader.gpu_indices) for p in packed.placed] == [("tiny-2gpu-a", [0]),
                                                                                 ("tiny-2gpu-a", [1])]


def test_existing_placements_are_kept_and_their_gpus_claimed_first():
    nodes = [node("tiny-2gpu-a"), node("tiny-2gpu-b", used={1})]
    b = nodes[1]
    existing = {"s-1": ReplicaPlacement("s-1", "s", [ShardPlacement("tiny-2gpu-b", 0, [1], [b.gpus[1].uuid],
                                                                    b.address, 0)])}
    result = plan_all([profile("s")], [deployment("s", 4)], nodes, existing)
    assert result.kept == ["s-1"] and result.dropped == {} and result.ok
    assert result.placement("s-1") == existing["s-1"]
    shards = {p.replica_id: (p.leader.node_id, p.leader.gpu_indices) for p in result.placed}
    assert shards == {"s-0": ("tiny-2gpu-a", [0]), "s-1": ("tiny-2gpu-b", [1]), "s-2": ("tiny-2gpu-a", [1]),
                      "s-3": ("tiny-2gpu-b", [0])}


def test_existing_placements_on_a_disconnected_node_stay():
    b = node("tiny-2gpu-b", schedulable=False)
    existing = {"s-0": ReplicaPlacement("s-0", "s", [ShardPlacement("tiny-2gpu-b", 0, [0], [b.gpus[0].uuid],
                                                                    b.address, 0)])}
    result = plan_all([profile("s")], [deployment("s", 1)], [b], existing)
    assert result.kept == ["s-0"] and result.ok


def test_existing_placements_that_no_longer_hold_are_dropped_and_replaced():
    a = node("tiny-2gpu-a")

    def on_a(replica_id, indices, uuids=None, profile_name="s"):
        uuids = uuids if uuids is not None else [a.gpus[i].uuid for i in indices]
        return ReplicaPlacement(replica_id, profile_name, [ShardPlacement("tiny-2gpu-a", 0, indices, uuids,
                                                                          a.address, 0)])

    existing = {
        "s-0": on_a("s-0", [0], uuids=["GPU-replaced"]),  # the GPU was swapped
        "s-1": on_a("s-1", [1]),  # fine
        "s-2": ReplicaPlacement("s-2", "s", [ShardPlacement("gone", 0, [0], [], "x", 0)]),
        "s-4": on_a("s-4", []),  # no GPUs on a node that has them
        "s-3": on_a("s-3", [1]),  # claims s-1's GPU
        "s-9": on_a("s-9", [0]),  # beyond the wanted replicas
    }
    result = plan_all([profile("s")], [deployment("s", 5)], [a, node("tiny-2gpu-b")], existing)
    assert result.kept == ["s-1"]
    assert result.dropped == {
        "s-0": "GPU 0 of tiny-2gpu-a is gone",
        "s-2": "node gone is gone",
        "s-3": "GPU 1 of tiny-2gpu-a is claimed by another replica",
        "s-4": "uses 0 GPUs on tiny-2gpu-a, the profile needs 1",
        "s-9": "no longer wanted",
    }
    assert {p.replica_id for p in result.placed} == {"s-0", "s-1", "s-2", "s-3"}
    assert [u.replica_id for u in result.unplaced] == ["s-4"]  # 4 GPUs in all
    # The profile changed shape: tp 2 no longer fits a 1-GPU placement.
    result = plan_all([profile("s", tp=2)], [deployment("s", 1)], [a], {"s-0": on_a("s-0", [0])})
    assert result.dropped == {"s-0": "uses 1 GPU on tiny-2gpu-a, the profile needs 2"}
    assert placed(result.placement("s-0")).leader.gpu_indices == [0, 1]


def test_unknown_profiles_and_duplicate_deployments():
    result = plan_all([profile("s")], [deployment("missing", 1), deployment("s", 1), deployment("s", 1)],
                      [node("tiny-2gpu-a")])
    assert result.unplaced == [Unplaced("missing-0", "missing", {REPLICA_WIDE: "no profile named missing"})]
    assert [p.replica_id for p in result.placed] == ["s-0", "s-1"]


def test_bigger_replicas_are_placed_first():
    # In config order, spread would put one small replica on each node and leave no room for the big one.
    small, big = profile("small", gpu_class="L4"), profile("big", gpu_class="L4", tp=2)
    result = plan_all([small, big], [deployment("small", 2), deployment("big", 1)],
                      [node("tiny-2gpu-a"), node("tiny-2gpu-b")])
    assert result.ok
    assert [p.replica_id for p in result.placed] == ["small-0", "small-1", "big-0"]
    assert placed(result.placement("big-0")).leader.node_id == "tiny-2gpu-a"
    assert {p.leader.node_id for p in result.placed if p.profile == "small"} == {"tiny-2gpu-b"}


def test_node_views_from_registers_and_the_admin_shape():
    register = discover(f"fixture:{FIXTURES / 'gb200-nvl-rack-node.json'}", node_id="t", address="1.2.3.4")
    view = NodeView.from_register(register, used_gpus=[2])
    assert (view.node_id, view.address, view.used_gpus, view.labels) == ("t", "1.2.3.4", {2}, {"rack": "nvl72-a"})
    assert [gpu.index for gpu in view.gpus] == [0, 1, 2, 3]
    assert view.fabrics == ["infiniband:fe80:0000:0000:0000", "nvlink:5b8f4a2c-9d3e-4f61-8a7b-2c1d0e9f8a76/32766"]


# -- fingerprint ------------------------------------------------------------------------------------------------------


def base_profile(**changes) -> Profile:
    fields = dict(name="fp", engine="vllm", model_path="/models/m", served_model_name="m", tp=2, pp=1, nodes=1,
                  gpus_per_node=2, args=["--max-model-len", "4096"], env={"A": "1", "B": "2"},
                  lora_adapters=[LoraAdapter(name="l", path="/l")], kv_events=True, cpu_threads=4, api_key="k1")
    fields.update(changes)
    return Profile(**fields)


@pytest.mark.parametrize("changes", [
    {"engine": "sim"}, {"engine_bin": "/opt/vllm/bin/vllm"}, {"model_path": "/models/other"},
    {"served_model_name": "other"}, {"tp": 4, "gpus_per_node": 4}, {"pp": 2, "gpus_per_node": 4},
    {"nodes": 2, "gpus_per_node": 1}, {"args": ["--max-model-len", "8192"]}, {"args": ["4096", "--max-model-len"]},
    {"env": {"A": "1", "B": "3"}}, {"env": {"A": "1"}}, {"lora_adapters": []},
    {"lora_adapters": [LoraAdapter(name="l", path="/other")]}, {"kv_events": False}, {"cpu_threads": None},
    {"api_key": None}, {"api_key": "k2"},
])
def test_changing_what_shapes_the_engine_changes_the_fingerprint(changes):
    assert profile_fingerprint(base_profile(**changes)) != profile_fingerprint(base_profile())


def test_the_fingerprint_is_stable_short_and_ignores_what_does_not_touch_the_process():
    fingerprint = profile_fingerprint(base_profile())
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert profile_fingerprint(base_profile(env={"B": "2", "A": "1"})) == fingerprint
    assert profile_fingerprint(base_profile(name="renamed", routing="kv_index", labels={"zone": "a"},
                                            gpu_class="H100", startup_timeout=30.0)) == fingerprint
    assert "k1" not in json.dumps(canonical_profile(base_profile()))
    # gpus_per_node defaults the way the loader computes it.
    assert profile_fingerprint(base_profile(gpus_per_node=None)) == fingerprint


def test_the_fingerprint_of_a_loaded_profile():
    config = parse_config(textwrap.dedent("""\
        agents: {embedded: true}
        profiles:
          - {name: tiny-sim, engine: sim, model_path: tiny, env: {X: "1", Y: "2"}}
        """), "conf.yaml", env={})
    reordered = parse_config(textwrap.dedent("""\
        agents: {embedded: true}
        profiles:
          - {name: tiny-sim, engine: sim, model_path: tiny, env: {Y: "2", X: "1"}}
        """), "conf.yaml", env={})
    assert profile_fingerprint(config.profiles[0]) == profile_fingerprint(reordered.profiles[0])


# -- llmgw plan -------------------------------------------------------------------------------------------------------

PLAN_CONFIG = """\
agents:
  token: s3cret
profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
  - name: pair
    engine: vllm
    model_path: /models/pair
    gpu_class: L4
    tp: 2
    nodes: 2
deployments:
  - profile: tiny-sim
    replicas: 2
  - profile: pair
"""


def run_plan(tmp_path: Path, *args: str, config: str = PLAN_CONFIG) -> subprocess.CompletedProcess:
    path = tmp_path / "llmgw.yaml"
    path.write_text(config)
    return subprocess.run([*LLMGW, "plan", "--config", str(path), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def fixture_args(*names: str) -> list[str]:
    return ["--nodes", *(str(FIXTURES / f"{name}.json") for name in names)]


def test_plan_prints_every_placement_and_exits_0(tmp_path):
    done = run_plan(tmp_path, *fixture_args("tiny-2gpu-a", "tiny-2gpu-b"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "3 replicas: 3 placed, 0 not placed (nodes: tiny-2gpu-a, tiny-2gpu-b)"
    assert "pair-0: placed on 2 nodes, leader tiny-2gpu-a 127.0.0.1:29500, profile pair" in lines
    assert "  rank 0  tiny-2gpu-a  GPUs 0" in lines and "  rank 1  tiny-2gpu-b  GPUs 0" in lines
    assert "tiny-sim-0: placed on tiny-2gpu-a (127.0.0.1), profile tiny-sim" in lines
    assert "tiny-sim-1: placed on tiny-2gpu-b (127.0.0.1), profile tiny-sim" in lines
    uuids = {gpu.uuid for name in ("tiny-2gpu-a", "tiny-2gpu-b") for gpu in node(name).gpus}
    assert {word for line in lines for word in line.split() if word.startswith("GPU-")} == uuids


def test_plan_explains_what_it_cannot_place_and_exits_3(tmp_path):
    done = run_plan(tmp_path, *fixture_args("tiny-2gpu-a", "cpu-only"))
    assert done.returncode == 3, done.stderr
    assert "pair-0: NOT PLACED, profile pair" in done.stdout
    assert "  tiny-2gpu-a: gang needs 2 nodes, 1 fits (fabric tcp, L4)" in done.stdout
    assert "  cpu-only: gpu_class L4 not present (no GPUs)" in done.stdout


def test_plan_json(tmp_path):
    done = run_plan(tmp_path, "--json", *fixture_args("tiny-2gpu-a", "tiny-2gpu-b", "cpu-only"))
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["ok"] is True and plan["unplaced"] == []
    assert plan["nodes"] == ["cpu-only", "tiny-2gpu-a", "tiny-2gpu-b"]
    gang = next(p for p in plan["placed"] if p["replica_id"] == "pair-0")
    assert [(s["node_id"], s["rank"], s["leader_port"]) for s in gang["shards"]] == [
        ("tiny-2gpu-a", 0, 29500), ("tiny-2gpu-b", 1, 29500)]


@pytest.mark.parametrize("args, config, message", [
    ([], PLAN_CONFIG, "give the nodes to plan on"),
    (["--nodes", "absent.json"], PLAN_CONFIG, "cannot read the node fixture"),
    (["--nodes", str(FIXTURES / "tiny-2gpu-a.json"), str(FIXTURES / "tiny-2gpu-a.json")], PLAN_CONFIG,
     "already used by another fixture"),
    (["--nodes", str(FIXTURES / "tiny-2gpu-a.json")], "deployments:\n  - profile: nope\n", "no profile named 'nope'"),
    (["--control", "http://127.0.0.1:9"], PLAN_CONFIG, "GET http://127.0.0.1:9/admin/nodes"),
    (["--bogus"], PLAN_CONFIG, "unrecognized arguments"),
])
def test_plan_usage_and_config_errors_exit_2(tmp_path, args, config, message):
    done = run_plan(tmp_path, *args, config=config)
    assert done.returncode == 2 and message in done.stderr, (done.stdout, done.stderr)


class AdminServer:
    """A stand-in control listener answering GET /admin/nodes and /admin/replicas with JSON."""

    def __init__(self, nodes: list, replicas: list):
        answers = {"/admin/nodes": nodes, "/admin/replicas": replicas}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps(answers.get(self.path, {})).encode()
                self.send_response(200 if self.path in answers else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def admin_node(name: str, state: str, used: list[int]) -> dict:
    register = discover(f"fixture:{FIXTURES / name}.json", node_id=name, address=f"10.1.1.{len(name)}")
    return {**wire.to_plain(register), "state": state, "used_gpus": used, "something_new": {"ignored": True}}


def test_plan_from_a_running_control_plane(tmp_path):
    a = admin_node("tiny-2gpu-a", "connected", [1])
    b = admin_node("tiny-2gpu-b", "suspect", [])
    running = {"replica_id": "tiny-sim-0", "profile": "tiny-sim", "model": "tiny", "generation": 2,
               "shards": [{"node": "tiny-2gpu-a", "rank": 0, "gpu_indices": [1],
                           "gpu_uuids": [a["gpus"][1]["uuid"]], "state": "ready", "pid": 1234}]}
    retiring = {**running, "generation": 1, "retiring": "profile changed",
                "shards": [{**running["shards"][0], "gpu_indices": [0], "gpu_uuids": [a["gpus"][0]["uuid"]]}]}
    waiting = {"replica_id": "pair-0", "profile": "pair", "state": "unplaced", "shards": []}
    external = {"name": "127.0.0.1:9001", "model": "tiny", "url": "http://127.0.0.1:9001"}
    with AdminServer([a, b], [external, retiring, running, waiting]) as server:
        done = run_plan(tmp_path, "--control", server.url, "--json")
    assert done.returncode == 3, done.stderr
    plan = json.loads(done.stdout)
    assert plan["kept"] == ["tiny-sim-0"]
    placed_ids = {p["replica_id"]: p["shards"][0] for p in plan["placed"]}
    assert placed_ids["tiny-sim-1"]["node_id"] == "tiny-2gpu-a" and placed_ids["tiny-sim-1"]["gpu_indices"] == [0]
    gang = plan["unplaced"][0]
    assert gang["replica_id"] == "pair-0"
    assert gang["reasons"]["tiny-2gpu-b"] == "not connected (state suspect)"
