"""Discovery: the NVML provider over every recorded fixture, tolerance of what NVML cannot answer,
the CPU provider on this machine, sysfs parsing under a fake root, and the spec dispatch."""

from __future__ import annotations

import copy
import json
import os
import platform
import sys
from pathlib import Path

import pytest

from llmgw import wire
from llmgw.agent.discovery import (
    CpuProvider,
    DiscoveryError,
    FakeNvml,
    NvmlProvider,
    NvmlUnavailable,
    RecordedHost,
    SystemHost,
    discover,
    load_fixture,
)
from llmgw.agent.discovery.host import parse_ib_rate, parse_ib_state, subnet_prefix
from llmgw.agent.discovery.nvml import mig_index, mig_profile
from llmgw.agent.discovery.topology import NvlinkEnds, normalize_bus_id, nvlink_peers, pci_link

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
MiB = 1024 ** 2
GiB = 1024 ** 3


def fixture_doc(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def discover_doc(doc: dict, nvml: FakeNvml | None = None, **kwargs) -> wire.Register:
    """The NVML provider over a (possibly edited) fixture document."""
    provider = NvmlProvider(nvml=nvml or FakeNvml(doc["nvml"]), host=RecordedHost(doc["host"]))
    return provider.discover(node_id=kwargs.pop("node_id", "n1"), address=kwargs.pop("address", "10.9.9.9"), **kwargs)


def discover_fixture(name: str, **kwargs) -> wire.Register:
    return discover(f"fixture:{FIXTURES / name}.json", node_id=kwargs.pop("node_id", name),
                    address=kwargs.pop("address", "10.9.9.9"), **kwargs)


@pytest.fixture
def no_pynvml(monkeypatch):
    """Make ``import pynvml`` fail, whatever is installed."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


# -- every fixture through the NVML provider ------------------------------------------------------------------------


def test_every_fixture_discovers_and_round_trips_on_the_wire():
    names = sorted(path.stem for path in FIXTURES.glob("*.json"))
    assert {"dgx-h100-8gpu", "a100-mig", "l4-2gpu", "gb200-nvl-rack-node", "cpu-only", "tiny-2gpu-a",
            "tiny-2gpu-b"} <= set(names)
    for name in names:
        register = discover_fixture(name, labels={"extra": "yes"})
        assert register.node_id == name and register.address == "10.9.9.9"
        assert register.labels["extra"] == "yes"
        assert register.token == "" and register.shards == []
        assert register.agent_version
        assert wire.decode(wire.encode(register)) == register, name


def test_dgx_h100_eight_gpus_nvswitch_island_and_four_hcas():
    register = discover_fixture("dgx-h100-8gpu")
    assert register.hostname == "dgx-h100-01"
    assert (register.host.driver_version, register.host.cuda_version) == ("550.54.15", "12.4")
    assert register.host.arch == "x86_64" and "avx512f" in register.host.cpu_flags
    assert register.cpu_count == 224 and register.memory_bytes == 2063 * GiB
    assert register.labels == {"zone": "a", "rack": "r1"}

    gpus = register.gpus
    assert [gpu.index for gpu in gpus] == list(range(8))
    assert len({gpu.uuid for gpu in gpus}) == 8
    for gpu in gpus:
        assert gpu.name == "NVIDIA H100 80GB HBM3"
        assert gpu.memory_total == 81559 * MiB and gpu.memory_used == 530 * MiB
        assert gpu.compute_capability == "9.0"
        assert (gpu.driver_version, gpu.cuda_version) == ("550.54.15", "12.4")
        assert gpu.mig is None and gpu.health.problems == []
        # NVLink all-to-all through the NVSwitches: every other GPU is a peer.
        assert sorted(gpu.nvlink_peers) == sorted(other.uuid for other in gpus if other is not gpu)
        assert gpu.fabric == wire.GpuFabric(state="completed", status="success", cluster_uuid="", clique_id=0,
                                            bandwidth_gbps=18 * 400.0)
    assert [gpu.numa_node for gpu in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gpus[0].pci_bus_id == "0000:18:00.0"  # NVML's 00000000:18:00.0, normalised to sysfs' form
    assert gpus[3].health.temperature_c == 34.0
    # GPU 0 shares a PCIe switch with mlx5_0, the host bridge with nothing, the socket with mlx5_1.
    assert [(path.nic, path.link) for path in gpus[0].nic_paths] == [
        ("mlx5_0", "PIX"), ("mlx5_1", "NODE"), ("mlx5_2", "SYS"), ("mlx5_3", "SYS")]
    assert gpus[7].nic_paths[0] == wire.NicPath(nic="mlx5_3", link="PIX")

    (fabric,) = register.fabrics
    assert (fabric.kind, fabric.name) == ("infiniband", "fe80:0000:0000:0000")
    assert [(hca.name, hca.port, hca.state, hca.rate_gbps, hca.link_layer) for hca in fabric.hcas] == [
        (f"mlx5_{n}", 1, "ACTIVE", 400.0, "InfiniBand") for n in range(4)]
    assert [hca.numa_node for hca in fabric.hcas] == [0, 0, 1, 1]
    assert register.imex == wire.ImexInfo()
    assert register.storage[0].path == "/raid"
    assert register.local_weights[0].name == "Llama-3.1-70B-Instruct"


def test_a100_mig_instances_are_gpus_of_their_own():
    register = discover_fixture("a100-mig")
    by_index = {gpu.index: gpu for gpu in register.gpus}
    assert sorted(by_index) == [0, 1, 1000, 1001, 1002, 1003]
    parent, whole = by_index[0], by_index[1]
    assert parent.mig is None and parent.health.problems == []
    assert parent.nvlink_peers == [whole.uuid] and whole.nvlink_peers == [parent.uuid]
    assert parent.fabric == wire.GpuFabric(state="not_supported", bandwidth_gbps=12 * 400.0)
    expected = [(1000, "3g.20gb", 1, 19968), (1001, "2g.10gb", 5, 9856), (1002, "1g.5gb", 13, 4864),
                (1003, "1g.5gb", 14, 4864)]
    for index, profile, gpu_instance, memory in expected:
        instance = by_index[index]
        assert instance.uuid.startswith("MIG-")
        assert instance.name == f"NVIDIA A100-SXM4-40GB MIG {profile}"
        assert instance.mig == wire.MigInfo(parent_uuid=parent.uuid, profile=profile, gpu_instance_id=gpu_instance,
                                            compute_instance_id=0)
        assert instance.memory_total == memory * MiB
        assert (instance.compute_capability, instance.numa_node, instance.pci_bus_id) == ("8.0", 0, "0000:07:00.0")
        assert instance.nvlink_peers == [] and instance.fabric is None
    assert register.fabrics == [] and register.imex == wire.ImexInfo()


def test_l4_pcie_gpus_take_numa_from_sysfs_when_nvml_cannot_say():
    register = discover_fixture("l4-2gpu")
    first, second = register.gpus
    assert (first.name, first.compute_capability) == ("NVIDIA L4", "8.9")
    assert (first.numa_node, second.numa_node) == (0, 1)  # nvmlDeviceGetNumaNodeId is unsupported here
    assert first.nvlink_peers == [] and first.fabric is None and first.mig is None
    assert (first.utilization, second.utilization) == (0.0, 35.0)
    assert second.memory_used == 17000 * MiB
    assert first.health.problems == [] and first.nic_paths == []


def test_gb200_fabric_clique_imex_and_nvlink_fabric():
    register = discover_fixture("gb200-nvl-rack-node")
    cluster = "5b8f4a2c-9d3e-4f61-8a7b-2c1d0e9f8a76"
    assert register.host.arch == "aarch64" and register.host.cuda_version == "12.8"
    assert len(register.gpus) == 4
    for gpu in register.gpus:
        assert gpu.compute_capability == "10.0"
        assert gpu.fabric == wire.GpuFabric(state="completed", status="success", cluster_uuid=cluster,
                                            clique_id=32766, bandwidth_gbps=18 * 800.0)
        # Remote PCI info is unsupported (the switches are in other trays): the clique makes them peers.
        assert len(gpu.nvlink_peers) == 3 and gpu.uuid not in gpu.nvlink_peers
    assert register.imex == wire.ImexInfo(state="ready", channels=[0])
    assert [(f.kind, f.name, len(f.hcas)) for f in register.fabrics] == [
        ("infiniband", "fe80:0000:0000:0000", 4), ("nvlink", f"{cluster}/32766", 0)]


def test_cpu_only_fixture_falls_back_to_the_cpu_provider():
    register = discover_fixture("cpu-only")
    assert register.gpus == [] and register.hostname == "cpu-01"
    assert register.host.driver_version == "" and register.cpu_count == 16 and register.memory_bytes == 64 * GiB


def test_tiny_fixtures_have_two_l4_gpus_each_with_distinct_uuids():
    a, b = discover_fixture("tiny-2gpu-a"), discover_fixture("tiny-2gpu-b")
    for register in (a, b):
        assert [gpu.name for gpu in register.gpus] == ["L4", "L4"]
        assert [gpu.index for gpu in register.gpus] == [0, 1]
    assert len({gpu.uuid for gpu in a.gpus + b.gpus}) == 4
    assert load_fixture(FIXTURES / "tiny-2gpu-a.json").node_id == "tiny-2gpu-a"


# -- tolerance ------------------------------------------------------------------------------------------------------


class SparseNvml(FakeNvml):
    """A driver that answers only identity: everything else is NotSupported."""

    ANSWERED = {"nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID",
                "nvmlDeviceGetName"}

    def __getattribute__(self, name):
        attribute = super().__getattribute__(name)
        if name.startswith("nvml") and name not in SparseNvml.ANSWERED:
            def unsupported(*args):
                raise self.NVMLError_NotSupported()
            return unsupported
        return attribute


def test_unsupported_nvml_calls_leave_defaults_and_no_problems():
    doc = fixture_doc("dgx-h100-8gpu")
    register = discover_doc(doc, nvml=SparseNvml(doc["nvml"]))
    assert len(register.gpus) == 8
    gpu = register.gpus[0]
    assert gpu.uuid.startswith("GPU-") and gpu.name == "NVIDIA H100 80GB HBM3"
    assert (gpu.memory_total, gpu.compute_capability, gpu.pci_bus_id, gpu.utilization) == (0, "", "", 0.0)
    assert gpu.numa_node == -1 and gpu.nvlink_peers == [] and gpu.fabric is None and gpu.mig is None
    assert gpu.health == wire.GpuHealth()
    assert register.host.driver_version == "" and register.host.cuda_version == ""


def test_function_not_found_and_functions_missing_from_the_module_are_tolerated():
    doc = fixture_doc("gb200-nvl-rack-node")
    doc["nvml"]["missing"] = ["nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetNumaNodeId"]  # an older driver

    class OldModule(FakeNvml):
        nvmlDeviceGetRemappedRows = None  # an old pynvml without the function

        def __getattribute__(self, name):
            if name in ("nvmlDeviceGetRemappedRows", "nvmlDeviceGetMigMode"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    register = discover_doc(doc, nvml=OldModule(doc["nvml"]))
    gpu = register.gpus[0]
    # The older nvmlDeviceGetGpuFabricInfo still answers; NUMA comes from sysfs.
    assert gpu.fabric.state == "completed" and gpu.fabric.clique_id == 32766
    assert gpu.numa_node == 0
    assert gpu.health.problems == []


def test_other_nvml_failures_become_health_problems():
    doc = fixture_doc("l4-2gpu")

    class LostGpu(FakeNvml):
        def nvmlDeviceGetTemperature(self, handle, sensor):
            if handle.device["uuid"] == doc["nvml"]["devices"][1]["uuid"]:
                raise self.NVMLError_GpuIsLost()
            return super().nvmlDeviceGetTemperature(handle, sensor)

    first, second = discover_doc(doc, nvml=LostGpu(doc["nvml"])).gpus
    assert first.health.problems == []
    assert second.health.problems == ["nvmlDeviceGetTemperature: GpuIsLost"]


def test_hardware_trouble_is_reported_as_problems():
    doc = fixture_doc("dgx-h100-8gpu")
    devices = doc["nvml"]["devices"]
    devices[1]["ecc"]["uncorrected_volatile"] = 2
    devices[2]["retired_pages_pending"] = True
    devices[3]["remapped_rows"]["pending"] = 1
    devices[4]["fabric"]["state"] = 2  # in progress: the fabric manager has not finished
    devices[5]["fabric"]["status"] = 3  # completed, but failed
    devices[6]["mig"] = {"current": 1, "pending": 1, "devices": []}
    devices[7]["mig"] = {"current": 0, "pending": 1, "devices": []}
    gpus = discover_doc(doc).gpus
    assert gpus[0].health.problems == []
    assert gpus[1].health.problems == ["2 uncorrected ECC errors since the driver loaded: reset the GPU"]
    assert gpus[2].health.problems == ["retired pages pending: reset the GPU"]
    assert gpus[3].health.problems == ["row remapping pending: reset the GPU"]
    assert gpus[4].health.problems == ["NVLink fabric registration in progress"]
    assert gpus[5].health.problems == ["NVLink fabric registration failed: NotSupported"]
    assert gpus[6].health.problems == ["MIG mode is enabled but no MIG instance exists"]
    assert gpus[7].health.problems == []  # enabling is pending, not in effect: still a whole GPU


def test_pending_mig_change_marks_the_parent_and_its_instances():
    doc = fixture_doc("a100-mig")
    doc["nvml"]["devices"][0]["mig"]["pending"] = 0
    gpus = discover_doc(doc).gpus
    assert all(gpu.health.problems == ["MIG mode change pending: reset the GPU"]
               for gpu in gpus if gpu.index == 0 or gpu.mig is not None)


def test_nvml_is_shut_down_after_discovery():
    doc = fixture_doc("tiny-2gpu-a")
    nvml = FakeNvml(doc["nvml"])
    discover_doc(doc, nvml=nvml)
    assert nvml.initialized == 0


def test_nvml_that_does_not_start_falls_back_to_cpu_under_auto_and_fails_under_nvml(tmp_path):
    doc = fixture_doc("tiny-2gpu-a")
    doc["nvml"]["init_error"] = "DriverNotLoaded"
    path = tmp_path / "no-driver.json"
    path.write_text(json.dumps(doc))
    register = discover(f"fixture:{path}", node_id="x", address="a")
    assert register.gpus == [] and register.hostname == "tiny-2gpu-a"
    with pytest.raises(NvmlUnavailable, match="DriverNotLoaded"):
        discover_doc(doc)


# -- specs and the live machine ---------------------------------------------------------------------------------------


def test_nvml_spec_without_pynvml_is_an_error_and_auto_falls_back(no_pynvml):
    with pytest.raises(DiscoveryError, match="nvidia-ml-py"):
        discover("nvml", node_id="x", address="a")
    register = discover("auto", node_id="me", address="127.0.0.1")
    assert register.gpus == [] and register.cpu_count > 0


@pytest.mark.parametrize("spec", ["gpu", "fixture:", "FIXTURE:x.json", ""])
def test_unknown_specs_are_refused(spec):
    with pytest.raises(DiscoveryError, match="unknown discovery"):
        discover(spec, node_id="x", address="a")


def test_unreadable_fixtures_are_refused(tmp_path):
    with pytest.raises(DiscoveryError, match="cannot read"):
        discover(f"fixture:{tmp_path / 'absent.json'}", node_id="x", address="a")
    (tmp_path / "other.json").write_text('{"devices": []}')
    with pytest.raises(DiscoveryError, match="not a node fixture"):
        discover(f"fixture:{tmp_path / 'other.json'}", node_id="x", address="a")


def test_cpu_provider_on_this_machine(tmp_path):
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text("{}")
    (models / "tiny" / "model.safetensors").write_bytes(b"\0" * 1000)
    (models / "tiny" / "nested").mkdir()
    (models / "tiny" / "nested" / "config.json").write_text("{}")  # inside a model: not another one
    snapshot = models / "hub" / "models--acme--small" / "snapshots" / "abc123"
    blobs = models / "hub" / "models--acme--small" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "b1").write_bytes(b"\0" * 500)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "weights.bin").symlink_to(blobs / "b1")
    (models / "empty").mkdir()

    register = CpuProvider().discover(node_id="me", address="127.0.0.1", labels={"zone": "z"},
                                      storage_paths=[str(tmp_path), str(tmp_path / "absent")],
                                      weight_roots=[str(models), str(tmp_path / "absent")])
    assert register.gpus == [] and register.labels == {"zone": "z"}
    assert register.hostname == platform.node()
    assert register.host.arch == platform.machine() and register.host.kernel == platform.release()
    assert register.host.os and register.host.python_version == platform.python_version()
    assert register.cpu_count == len(os.sched_getaffinity(0))
    assert register.memory_bytes > 0
    if platform.machine() in ("x86_64", "AMD64"):
        assert "sse2" in register.host.cpu_flags
    (disk,) = register.storage
    assert disk.path == str(tmp_path) and 0 < disk.free_bytes <= disk.total_bytes
    assert [(w.name, w.size_bytes) for w in register.local_weights] == [("acme/small", 502), ("tiny", 1004)]
    assert wire.decode(wire.encode(register)) == register


# -- sysfs under a fake root ------------------------------------------------------------------------------------------


def make_sysfs(root: Path) -> None:
    """A node with one GPU and two HCA ports behind one PCIe switch, plus IMEX channels 0 and 3."""
    devices = root / "sys" / "devices" / "pci0000:15" / "0000:15:01.0" / "0000:16:00.0"
    gpu = devices / "0000:17:00.0" / "0000:18:00.0"
    nic = devices / "0000:17:01.0" / "0000:19:00.0"
    for device, numa in ((gpu, 1), (nic, 1)):
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{numa}\n")
    bus = root / "sys" / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    (bus / "0000:18:00.0").symlink_to(gpu)
    (bus / "0000:19:00.0").symlink_to(nic)
    hca = root / "sys" / "class" / "infiniband" / "mlx5_0"
    hca.mkdir(parents=True)
    (hca / "device").symlink_to(nic)
    for port, state, rate in ((1, "4: ACTIVE", "400 Gb/sec (4X NDR)"), (2, "1: DOWN", "10 Gb/sec (4X SDR)")):
        port_dir = hca / "ports" / str(port)
        (port_dir / "gids").mkdir(parents=True)
        (port_dir / "state").write_text(state + "\n")
        (port_dir / "rate").write_text(rate + "\n")
        (port_dir / "link_layer").write_text("InfiniBand\n")
        (port_dir / "gids" / "0").write_text("fe80:0000:0000:0001:a088:c203:0012:3456\n")
    imex = root / "dev" / "nvidia-caps-imex-channels"
    imex.mkdir(parents=True)
    for name in ("channel3", "channel0", "README"):
        (imex / name).write_text("")


def test_system_host_reads_infiniband_imex_and_pci_from_sysfs(tmp_path):
    make_sysfs(tmp_path)
    host = SystemHost(tmp_path)
    assert host.infiniband() == [
        wire.Hca(name="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0, link_layer="InfiniBand",
                 subnet_prefix="fe80:0000:0000:0001", pci_bus_id="0000:19:00.0", numa_node=1),
        wire.Hca(name="mlx5_0", port=2, state="DOWN", rate_gbps=10.0, link_layer="InfiniBand",
                 subnet_prefix="fe80:0000:0000:0001", pci_bus_id="0000:19:00.0", numa_node=1)]
    assert host.imex_channels() == [0, 3]
    assert host.pci_numa_node("00000000:18:00.0") == 1
    assert host.pci_path("0000:18:00.0") == (
        "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0")
    assert host.pci_numa_node("0000:99:00.0") == -1 and host.pci_path("0000:99:00.0") == ""


def test_nvml_provider_over_a_fake_sysfs_root(tmp_path):
    make_sysfs(tmp_path)
    doc = copy.deepcopy(fixture_doc("tiny-2gpu-a")["nvml"])
    doc["devices"] = doc["devices"][:1]
    doc["devices"][0]["pci_bus_id"] = "00000000:18:00.0"
    del doc["devices"][0]["numa_node"]
    register = NvmlProvider(nvml=FakeNvml(doc), host=SystemHost(tmp_path)).discover(node_id="n", address="a")
    (gpu,) = register.gpus
    assert gpu.numa_node == 1
    assert gpu.nic_paths == [wire.NicPath(nic="mlx5_0", link="PIX")]
    assert register.imex == wire.ImexInfo(state="ready", channels=[0, 3])
    assert [(f.kind, f.name, [h.port for h in f.hcas]) for f in register.fabrics] == [
        ("infiniband", "fe80:0000:0000:0001", [1, 2])]


# -- pure helpers -----------------------------------------------------------------------------------------------------


def test_sysfs_value_parsers():
    assert parse_ib_state("4: ACTIVE\n") == "ACTIVE"
    assert parse_ib_rate("400 Gb/sec (4X NDR)") == 400.0 and parse_ib_rate("2.5 Gb/sec (1X SDR)") == 2.5
    assert parse_ib_rate("garbage") == 0.0
    assert subnet_prefix("FE80:0000:0000:0000:0c42:a103:0072:9a5c") == "fe80:0000:0000:0000"
    assert subnet_prefix("") == ""


def test_bus_ids_mig_names_and_indices():
    assert normalize_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_bus_id(b"00000001:C1:00.0") == "0001:c1:00.0"
    assert normalize_bus_id("18:00.0") == "0000:18:00.0"
    assert normalize_bus_id("") == ""
    assert mig_profile("NVIDIA A100-SXM4-40GB MIG 1g.5gb") == "1g.5gb" and mig_profile("NVIDIA L4") == ""
    assert (mig_index(0, 0), mig_index(1, 6)) == (1000, 2006)


def test_pci_link_classes():
    root = "/sys/devices/pci0000:15/0000:15:01.0"
    switch = f"{root}/0000:16:00.0"
    assert pci_link(f"{switch}/0000:17:00.0/0000:18:00.0", f"{switch}/0000:17:01.0/0000:19:00.0") == "PIX"
    deeper = f"{switch}/0000:17:00.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0"
    assert pci_link(deeper, f"{switch}/0000:17:01.0/0000:1b:00.0") == "PXB"
    assert pci_link(f"{root}/0000:18:00.0", "/sys/devices/pci0000:15/0000:15:03.0/0000:20:00.0") == "PHB"
    assert pci_link(f"{root}/0000:18:00.0", "/sys/devices/pci0000:48/0000:48:01.0/0000:49:00.0", 0, 0) == "NODE"
    assert pci_link(f"{root}/0000:18:00.0", "/sys/devices/pci0000:97/0000:97:01.0/0000:98:00.0", 0, 1) == "SYS"
    assert pci_link("", "", -1, -1) == ""


def test_nvlink_peers_direct_through_switches_and_by_clique():
    direct = nvlink_peers([NvlinkEnds("a", "0000:01:00.0", ["0000:02:00.0"]),
                           NvlinkEnds("b", "0000:02:00.0", ["0000:01:00.0"]), NvlinkEnds("c", "0000:03:00.0", [])])
    assert direct == {"a": ["b"], "b": ["a"], "c": []}
    switched = nvlink_peers([NvlinkEnds("a", "0000:01:00.0", ["0000:05:00.0"]),
                             NvlinkEnds("b", "0000:02:00.0", ["0000:06:00.0"]),
                             NvlinkEnds("c", "0000:03:00.0", ["0000:05:00.0", "0000:06:00.0"])])
    assert switched == {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}
    cliques = nvlink_peers([NvlinkEnds("a", "1", [""], clique="u/1"), NvlinkEnds("b", "2", [""], clique="u/1"),
                            NvlinkEnds("c", "3", [""], clique="u/2")])
    assert cliques == {"a": ["b"], "b": ["a"], "c": []}
