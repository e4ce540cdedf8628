"""Recorded nodes: an NVML stand-in and a host backed by a JSON document, run through the real providers.

``fixture:PATH`` discovery reads a document shaped like what NVML and sysfs
return on a real machine (see ``docs/placement.md`` for the format) and runs
the very same :class:`~llmgw.agent.discovery.nvml.NvmlProvider` over it, with
:class:`FakeNvml` in place of ``pynvml`` and :class:`RecordedHost` in place of
the live ``/proc`` and ``/sys``. A document whose ``nvml`` is null is a node
without a driver: NVML fails to start, exactly as it would, and the CPU
provider describes the host.
"""

from __future__ import annotations

import json
import platform
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from llmgw import wire

from .auto import AutoProvider
from .host import SystemHost, make_hca
from .provider import DiscoveryError
from .topology import normalize_bus_id

FORMAT = "llmgw-node-fixture/1"

# NVML return codes and the pynvml class-name suffixes of the errors FakeNvml raises.
ERROR_NAMES = {1: "Uninitialized", 2: "InvalidArgument", 3: "NotSupported", 4: "NoPermission", 6: "NotFound",
               9: "DriverNotLoaded", 12: "LibraryNotFound", 13: "FunctionNotFound", 15: "GpuIsLost",
               999: "Unknown"}


class NVMLError(Exception):
    """pynvml's error type: ``value`` is the NVML return code; ``NVMLError(3)`` is a ``NVMLError_NotSupported``."""

    code = 999
    _by_code: dict[int, type[NVMLError]] = {}

    def __new__(cls, value: int | None = None):
        if cls is NVMLError and value in NVMLError._by_code:
            cls = NVMLError._by_code[value]
        return super().__new__(cls)

    def __init__(self, value: int | None = None):
        self.value = type(self).code if value is None else value
        super().__init__(self.value)

    def __str__(self) -> str:
        return ERROR_NAMES.get(self.value, f"NVML error {self.value}")


def _error_class(code: int, name: str) -> type[NVMLError]:
    cls = type(f"NVMLError_{name}", (NVMLError,), {"code": code})
    NVMLError._by_code[code] = cls
    return cls


ERRORS = {name: _error_class(code, name) for code, name in ERROR_NAMES.items()}


class FabricInfoRecord:
    """Stands for pynvml's ``c_nvmlGpuFabricInfoV_t``: the structure the fabric call fills."""

    def __init__(self):
        self.version, self.clusterUuid, self.status = 0, bytes(16), 0
        self.cliqueId, self.state, self.healthMask = 0, 0, 0


@dataclass(eq=False)
class _Handle:
    device: dict[str, Any]
    parent: dict[str, Any] | None = None  # set for a MIG instance


class FakeNvml:
    """The pynvml functions :class:`NvmlProvider` calls, answering from a recorded ``nvml`` document.

    A value missing from a device's record answers ``NotSupported``, as NVML
    does for a GPU that lacks the feature; names listed in ``unsupported``
    (document or device) do too, and names in ``missing`` answer
    ``FunctionNotFound`` (an older driver). ``None`` as the document is a
    machine without a driver: ``nvmlInit`` raises ``LibraryNotFound``.
    """

    NVMLError = NVMLError
    c_nvmlGpuFabricInfoV_t = FabricInfoRecord
    c_nvmlGpuFabricInfo_t = FabricInfoRecord
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, document: dict[str, Any] | None):
        self.document = document
        self.devices: list[dict[str, Any]] = list((document or {}).get("devices", []))
        self.initialized = 0

    def __getattr__(self, name: str):
        if name.startswith("NVMLError_") and name[len("NVMLError_"):] in ERRORS:
            return ERRORS[name[len("NVMLError_"):]]
        raise AttributeError(name)

    # -- plumbing --

    def _check(self, function: str, handle: _Handle | None = None) -> None:
        if not self.initialized:
            raise ERRORS["Uninitialized"]()
        for record in (self.document, handle.device if handle else None, handle.parent if handle else None):
            if record and function in record.get("missing", ()):
                raise ERRORS["FunctionNotFound"]()
            if record and function in record.get("unsupported", ()):
                raise ERRORS["NotSupported"]()

    def _value(self, function: str, handle: _Handle, key: str) -> Any:
        self._check(function, handle)
        if key not in handle.device:
            raise ERRORS["NotSupported"]()
        return handle.device[key]

    def _whole_gpu(self, function: str, handle: _Handle) -> dict[str, Any]:
        self._check(function, handle)
        if handle.parent is not None:
            raise ERRORS["NotSupported"]()
        return handle.device

    # -- library and system --

    def nvmlInit(self) -> None:
        if self.document is None:
            raise ERRORS["LibraryNotFound"]()
        if self.document.get("init_error"):
            raise ERRORS[self.document["init_error"]]()
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return (self.document or {}).get("driver_version", "")

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        return int((self.document or {}).get("cuda_driver_version", 0))

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise ERRORS["InvalidArgument"]()
        return _Handle(self.devices[index])

    # -- one device (whole GPU or MIG instance) --

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._value("nvmlDeviceGetUUID", handle, "uuid")

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._value("nvmlDeviceGetName", handle, "name")

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        memory = self._value("nvmlDeviceGetMemoryInfo", handle, "memory")
        return SimpleNamespace(total=memory["total"], used=memory["used"], free=memory["total"] - memory["used"])

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        major, minor = self._value("nvmlDeviceGetCudaComputeCapability", handle, "cuda_compute_capability")
        return major, minor

    def nvmlDeviceGetNumaNodeId(self, handle: _Handle) -> int:
        return self._value("nvmlDeviceGetNumaNodeId", handle, "numa_node")

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        return SimpleNamespace(busId=self._value("nvmlDeviceGetPciInfo", handle, "pci_bus_id").encode())

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        rates = self._value("nvmlDeviceGetUtilizationRates", handle, "utilization")
        return SimpleNamespace(gpu=rates["gpu"], memory=rates["memory"])

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        return self._value("nvmlDeviceGetTemperature", handle, "temperature")

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter_type: int) -> int:
        ecc = self._value("nvmlDeviceGetTotalEccErrors", handle, "ecc")
        key = f"{'uncorrected' if error_type == 1 else 'corrected'}_{'volatile' if counter_type == 0 else 'aggregate'}"
        if key not in ecc:
            raise ERRORS["NotSupported"]()
        return ecc[key]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: _Handle) -> int:
        return int(bool(self._value("nvmlDeviceGetRetiredPagesPendingStatus", handle, "retired_pages_pending")))

    def nvmlDeviceGetRemappedRows(self, handle: _Handle) -> tuple[int, int, int, int]:
        rows = self._value("nvmlDeviceGetRemappedRows", handle, "remapped_rows")
        return rows.get("corrected", 0), rows.get("uncorrected", 0), int(rows.get("pending", 0)), \
            int(rows.get("failed", 0))

    def _link(self, function: str, handle: _Handle, link: int) -> dict[str, Any]:
        links = self._value(function, handle, "nvlink")
        if not 0 <= link < len(links):
            raise ERRORS["InvalidArgument"]()
        return links[link]

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        return self._link("nvmlDeviceGetNvLinkState", handle, link)["state"]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._link("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
                               ["remote_pci_bus_id"].encode())

    def nvmlDeviceGetNvLinkVersion(self, handle: _Handle, link: int) -> int:
        return self._link("nvmlDeviceGetNvLinkVersion", handle, link)["version"]

    def _fill_fabric(self, function: str, handle: _Handle, info: FabricInfoRecord) -> int:
        fabric = self._value(function, handle, "fabric")
        info.state, info.status = fabric["state"], fabric.get("status", 0)
        info.clusterUuid = uuid.UUID(fabric["cluster_uuid"]).bytes if fabric.get("cluster_uuid") else bytes(16)
        info.cliqueId = fabric.get("clique_id", 0)
        return 0

    def nvmlDeviceGetGpuFabricInfoV(self, handle: _Handle, info: FabricInfoRecord) -> int:
        return self._fill_fabric("nvmlDeviceGetGpuFabricInfoV", handle, info)

    def nvmlDeviceGetGpuFabricInfo(self, handle: _Handle, info: FabricInfoRecord) -> int:
        return self._fill_fabric("nvmlDeviceGetGpuFabricInfo", handle, info)

    # -- MIG --

    def _mig(self, function: str, handle: _Handle) -> dict[str, Any]:
        device = self._whole_gpu(function, handle)
        if "mig" not in device:
            raise ERRORS["NotSupported"]()
        return device["mig"]

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        mig = self._mig("nvmlDeviceGetMigMode", handle)
        return [mig["current"], mig.get("pending", mig["current"])]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        return self._mig("nvmlDeviceGetMaxMigDeviceCount", handle).get("max_devices", 7)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, slot: int) -> _Handle:
        for instance in self._mig("nvmlDeviceGetMigDeviceHandleByIndex", handle).get("devices", []):
            if instance["slot"] == slot:
                return _Handle(instance, parent=handle.device)
        raise ERRORS["NotFound"]()

    def _instance(self, function: str, handle: _Handle, key: str) -> int:
        self._check(function, handle)
        if handle.parent is None:
            raise ERRORS["InvalidArgument"]()  # not a MIG device handle
        return handle.device[key]

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        return self._instance("nvmlDeviceGetGpuInstanceId", handle, "gpu_instance_id")

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        return self._instance("nvmlDeviceGetComputeInstanceId", handle, "compute_instance_id")


class RecordedHost:
    """A :class:`HostSource` answering from a recorded ``host`` document.

    Storage and local weights are the recorded ones plus, for paths the
    caller gives, those measured on this machine (``system``).
    """

    def __init__(self, document: dict[str, Any], system: SystemHost | None = None):
        self.document = document
        self.system = system if system is not None else SystemHost()
        self.pci = {normalize_bus_id(bus): facts for bus, facts in document.get("pci", {}).items()}

    def hostname(self) -> str:
        return self.document.get("hostname", "")

    def host_info(self) -> wire.HostInfo:
        doc = self.document
        return wire.HostInfo(os=doc.get("os", ""), kernel=doc.get("kernel", ""), arch=doc.get("arch", ""),
                             cpu_model=doc.get("cpu_model", ""), cpu_flags=list(doc.get("cpu_flags", [])),
                             python_version=platform.python_version())

    def cpu_count(self) -> int:
        return int(self.document.get("cpu_count", 0))

    def memory_bytes(self) -> int:
        return int(self.document.get("memory_bytes", 0))

    def infiniband(self) -> list[wire.Hca]:
        return [make_hca(**port) for port in self.document.get("infiniband", [])]

    def imex_channels(self) -> list[int]:
        return sorted(self.document.get("imex_channels", []))

    def pci_numa_node(self, bus_id: str) -> int:
        return int(self.pci.get(normalize_bus_id(bus_id), {}).get("numa_node", -1))

    def pci_path(self, bus_id: str) -> str:
        return self.pci.get(normalize_bus_id(bus_id), {}).get("path", "")

    def storage(self, paths: Sequence[str]) -> list[wire.StorageInfo]:
        recorded = [wire.StorageInfo(**entry) for entry in self.document.get("storage", [])]
        return recorded + self.system.storage(paths)

    def local_weights(self, roots: Sequence[str]) -> list[wire.LocalWeights]:
        recorded = [wire.LocalWeights(**entry) for entry in self.document.get("local_weights", [])]
        return recorded + self.system.local_weights(roots)


@dataclass
class NodeFixture:
    """A recorded node: who it says it is, its NVML stand-in and its host."""

    path: str
    node_id: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)
    nvml: FakeNvml = field(default_factory=lambda: FakeNvml(None))
    host: RecordedHost = field(default_factory=lambda: RecordedHost({}))


def load_fixture(path: str | Path) -> NodeFixture:
    """Read a recorded node; its node id defaults to the file's stem, its address to its hostname."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DiscoveryError(f"{path}: cannot read the node fixture: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise DiscoveryError(f"{path}: not a node fixture (expected \"format\": \"{FORMAT}\")")
    host = document.get("host", {})
    node_id = document.get("node_id") or path.stem
    return NodeFixture(path=str(path), node_id=node_id, address=document.get("address") or host.get("hostname")
                       or node_id, labels=dict(document.get("labels", {})), nvml=FakeNvml(document.get("nvml")),
                       host=RecordedHost(host))


class FixtureProvider:
    """``fixture:PATH`` discovery: the NVML provider over the recording (the CPU provider when it has no driver).

    The fixture's labels are merged under the caller's.
    """

    def __init__(self, fixture: NodeFixture | str | Path):
        self.fixture = fixture if isinstance(fixture, NodeFixture) else load_fixture(fixture)

    def discover(self, *, node_id: str, address: str, labels: dict[str, str] | None = None,
                 weight_roots: Sequence[str] = (), storage_paths: Sequence[str] = ()) -> wire.Register:
        provider = AutoProvider(nvml=self.fixture.nvml, host=self.fixture.host)
        return provider.discover(node_id=node_id, address=address, labels={**self.fixture.labels, **(labels or {})},
                                 weight_roots=weight_roots, storage_paths=storage_paths)
