"""The NVML provider: a node's GPUs as the NVIDIA driver reports them.

``NvmlProvider(nvml=module)`` takes the ``pynvml`` module of ``nvidia-ml-py``,
or any object with the same function names (the recorded
:class:`~llmgw.agent.discovery.fixture.FakeNvml`), so the same code reads a
real driver and a fixture. Per GPU it reads identity, memory, compute
capability, NUMA node (sysfs when NVML cannot say), PCI bus id, utilisation,
NVLink links, fabric registration, health and MIG instances; every MIG
instance becomes a schedulable GPU of its own. A call the driver or GPU does
not support leaves the field at its default; any other NVML failure also
leaves the default but is recorded as a health problem of that GPU.
"""

from __future__ import annotations

import ctypes
import logging
import uuid as uuid_module
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmgw import wire

from .cpu import host_register
from .host import SystemHost
from .provider import HostSource, NvmlUnavailable
from .topology import (
    NvlinkEnds,
    fabric_clique,
    fabrics_of,
    imex_of,
    nic_paths,
    normalize_bus_id,
    nvlink_bandwidth_gbps,
    nvlink_peers,
)

log = logging.getLogger(__name__)

# NVML ABI values, stable across driver releases; a stand-in module need not define them.
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_NVLINK_CONNECTED_STATES = (1, 2)  # active, sleeping (low power but wired)
NVML_DEVICE_MIG_ENABLE = 1
DEFAULT_NVLINK_MAX_LINKS = 18
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
# Errors that mean "this GPU or driver cannot answer that": the field keeps its default, silently.
TOLERATED_ERRORS = {
    2,  # invalid argument (e.g. an NVLink index past the GPU's last link)
    3,  # not supported
    4,  # no permission
    6,  # not found (e.g. an empty MIG slot)
    13,  # function not found (an older driver)
}
# The newer call first; each with the structure it fills.
FABRIC_CALLS = (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"))
MIG_INDEX_BASE = 1000

_FAILED = object()


def mig_index(parent_index: int, slot: int) -> int:
    """The schedulable index of MIG slot ``slot`` of GPU ``parent_index``: GPU 0's are 1000, 1001...

    Stable while other GPUs' MIG layouts change, and never equal to a whole GPU's index.
    """
    return (parent_index + 1) * MIG_INDEX_BASE + slot


def mig_profile(name: str) -> str:
    """``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"`` -> ``"1g.5gb"``."""
    _, found, profile = name.rpartition(" MIG ")
    return profile.strip() if found else ""


def cuda_version_text(version: int) -> str:
    """NVML's 12040 -> ``"12.4"``."""
    return f"{version // 1000}.{version % 1000 // 10}" if version else ""


def load_pynvml():
    """The ``pynvml`` module of nvidia-ml-py, or :class:`NvmlUnavailable`."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable("nvidia-ml-py (pynvml) is not installed") from exc
    return pynvml


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return "" if value is None else str(value)


class _Calls:
    """Calls into an NVML module that return ``default`` instead of raising.

    Unsupported calls (see :data:`TOLERATED_ERRORS`, and functions an old
    ``pynvml`` lacks) are silent; other NVML errors are appended to ``problems``.
    """

    def __init__(self, nvml: Any, problems: list[str]):
        self.nvml = nvml
        self.problems = problems
        error = getattr(nvml, "NVMLError", None)
        self.errors = error if isinstance(error, type) and issubclass(error, BaseException) else ()

    def __call__(self, name: str, *args: Any, default: Any = None) -> Any:
        function = getattr(self.nvml, name, None)
        if function is None:
            return default
        try:
            return function(*args)
        except self.errors as exc:
            if getattr(exc, "value", None) not in TOLERATED_ERRORS:
                self.problems.append(f"{name}: {exc}")
            return default


@dataclass
class _Link:
    remote_bus_id: str
    version: int


@dataclass
class _PhysicalGpu:
    """A whole GPU as read, with what the second pass (NVLink peers, MIG instances) needs."""

    gpu: wire.GpuInfo
    handle: Any = None
    ends: NvlinkEnds | None = None
    mig_mode: Any = None  # [current, pending] from nvmlDeviceGetMigMode


class NvmlProvider:
    """Describes a node with NVIDIA GPUs. ``nvml``: the ``pynvml`` module or a stand-in (default: import it)."""

    def __init__(self, nvml: Any = None, host: HostSource | None = None):
        self.nvml = nvml if nvml is not None else load_pynvml()
        self.host = host if host is not None else SystemHost()

    def discover(self, *, node_id: str, address: str, labels: dict[str, str] | None = None,
                 weight_roots: Sequence[str] = (), storage_paths: Sequence[str] = ()) -> wire.Register:
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # no library, no driver, driver/library mismatch...
            raise NvmlUnavailable(f"NVML could not start: {exc}") from exc
        try:
            register = host_register(self.host, node_id=node_id, address=address, labels=labels,
                                     weight_roots=weight_roots, storage_paths=storage_paths)
            self._add_gpus(register)
            return register
        finally:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # shutting down is best effort
                log.debug("nvmlShutdown failed", exc_info=True)

    def _add_gpus(self, register: wire.Register) -> None:
        system_problems: list[str] = []
        call = _Calls(self.nvml, system_problems)
        register.host.driver_version = _text(call("nvmlSystemGetDriverVersion", default=""))
        register.host.cuda_version = cuda_version_text(call("nvmlSystemGetCudaDriverVersion", default=0) or 0)
        count = call("nvmlDeviceGetCount", default=None)
        if count is None:
            raise NvmlUnavailable(f"NVML cannot count GPUs: {'; '.join(system_problems) or 'not supported'}")
        hcas = [hca for fabric in register.fabrics for hca in fabric.hcas]
        register.gpus = self._gpus(count, register.host, hcas)
        register.fabrics = fabrics_of(hcas, register.gpus)
        register.imex = imex_of(register.imex.channels, register.gpus)

    def _gpus(self, count: int, host: wire.HostInfo, hcas: list[wire.Hca]) -> list[wire.GpuInfo]:
        physical = [self._read_gpu(index, host, hcas) for index in range(count)]
        peers = nvlink_peers([read.ends for read in physical if read.ends is not None])
        gpus: list[wire.GpuInfo] = []
        for read in physical:
            read.gpu.nvlink_peers = peers.get(read.gpu.uuid, [])
            gpus.append(read.gpu)
            gpus.extend(self._mig_instances(read))
        return gpus

    def _read_gpu(self, index: int, host: wire.HostInfo, hcas: list[wire.Hca]) -> _PhysicalGpu:
        problems: list[str] = []
        call = _Calls(self.nvml, problems)
        handle = call("nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            return _PhysicalGpu(wire.GpuInfo(index=index, health=wire.GpuHealth(
                problems=problems or ["NVML cannot open this GPU"])))
        pci = call("nvmlDeviceGetPciInfo", handle)
        bus_id = normalize_bus_id(getattr(pci, "busId", b"")) if pci is not None else ""
        numa = call("nvmlDeviceGetNumaNodeId", handle)
        if numa is None or numa < 0:
            numa = self.host.pci_numa_node(bus_id) if bus_id else -1
        memory = call("nvmlDeviceGetMemoryInfo", handle)
        capability = call("nvmlDeviceGetCudaComputeCapability", handle)
        utilization = call("nvmlDeviceGetUtilizationRates", handle)
        links = self._nvlinks(call, handle)
        gpu = wire.GpuInfo(
            index=index, uuid=_text(call("nvmlDeviceGetUUID", handle, default="")),
            name=_text(call("nvmlDeviceGetName", handle, default="")),
            memory_total=int(getattr(memory, "total", 0)), memory_used=int(getattr(memory, "used", 0)),
            compute_capability=f"{capability[0]}.{capability[1]}" if capability else "",
            numa_node=int(numa), pci_bus_id=bus_id, driver_version=host.driver_version,
            cuda_version=host.cuda_version, utilization=float(getattr(utilization, "gpu", 0)),
            nic_paths=nic_paths(self.host.pci_path(bus_id) if bus_id else "", int(numa), hcas, self.host.pci_path),
            fabric=self._fabric(call, handle, links), health=self._health(call, handle, problems),
        )
        ends = NvlinkEnds(uuid=gpu.uuid, bus_id=bus_id, remote_bus_ids=[link.remote_bus_id for link in links],
                          clique=fabric_clique(gpu.fabric))
        return _PhysicalGpu(gpu, handle, ends, call("nvmlDeviceGetMigMode", handle))

    def _nvlinks(self, call: _Calls, handle: Any) -> list[_Link]:
        links = []
        for link in range(getattr(self.nvml, "NVML_NVLINK_MAX_LINKS", DEFAULT_NVLINK_MAX_LINKS)):
            state = call("nvmlDeviceGetNvLinkState", handle, link)
            if state is None:
                break  # no NVLink, or past the GPU's last link
            if state not in NVML_NVLINK_CONNECTED_STATES:
                continue
            remote = call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            links.append(_Link(remote_bus_id=normalize_bus_id(getattr(remote, "busId", b"")) if remote else "",
                               version=int(call("nvmlDeviceGetNvLinkVersion", handle, link, default=0) or 0)))
        return links

    def _fabric(self, call: _Calls, handle: Any, links: list[_Link]) -> wire.GpuFabric | None:
        bandwidth = nvlink_bandwidth_gbps(link.version for link in links)
        info = self._fabric_info(call, handle)
        if info is None or int(info.state) == 0:
            return wire.GpuFabric(state="not_supported", bandwidth_gbps=bandwidth) if links else None
        state = FABRIC_STATES.get(int(info.state), f"unknown ({int(info.state)})")
        status = int(info.status)
        fabric = wire.GpuFabric(state=state, status="success" if status == 0 else self._error_text(status),
                                cluster_uuid=_cluster_uuid(bytes(info.clusterUuid)),
                                clique_id=int(info.cliqueId), bandwidth_gbps=bandwidth)
        if state in ("not_started", "in_progress"):
            call.problems.append(f"NVLink fabric registration {state.replace('_', ' ')}")
        elif state == "completed" and status != 0:
            call.problems.append(f"NVLink fabric registration failed: {fabric.status}")
        return fabric

    def _fabric_info(self, call: _Calls, handle: Any) -> Any:
        for function, structure in FABRIC_CALLS:
            make = getattr(self.nvml, structure, None)
            if make is None or not hasattr(self.nvml, function):
                continue
            info = make()
            reference = ctypes.byref(info) if isinstance(info, ctypes.Structure) else info
            if call(function, handle, reference, default=_FAILED) is not _FAILED:
                return info
        return None

    def _error_text(self, code: int) -> str:
        try:
            return str(self.nvml.NVMLError(code))
        except Exception:
            return f"NVML error {code}"

    def _health(self, call: _Calls, handle: Any, problems: list[str]) -> wire.GpuHealth:
        lifetime = call("nvmlDeviceGetTotalEccErrors", handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC)
        recent = call("nvmlDeviceGetTotalEccErrors", handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        if recent:
            problems.append(f"{recent} uncorrected ECC errors since the driver loaded: reset the GPU")
        if call("nvmlDeviceGetRetiredPagesPendingStatus", handle, default=0):
            problems.append("retired pages pending: reset the GPU")
        rows = call("nvmlDeviceGetRemappedRows", handle)
        if rows is not None:
            _corrected, _uncorrected, pending, failed = rows
            if pending:
                problems.append("row remapping pending: reset the GPU")
            if failed:
                problems.append("row remapping failed")
        temperature = call("nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU, default=0)
        return wire.GpuHealth(ecc_errors=int(lifetime if lifetime is not None else recent or 0),
                              temperature_c=float(temperature or 0), problems=problems)

    def _mig_instances(self, read: _PhysicalGpu) -> list[wire.GpuInfo]:
        parent, handle, mode = read.gpu, read.handle, read.mig_mode
        if not mode or mode[0] != NVML_DEVICE_MIG_ENABLE:
            return []
        if mode[1] != mode[0]:
            parent.health.problems.append("MIG mode change pending: reset the GPU")
        call = _Calls(self.nvml, parent.health.problems)
        instances = []
        for slot in range(call("nvmlDeviceGetMaxMigDeviceCount", handle, default=0) or 0):
            problems = list(parent.health.problems)
            mig_call = _Calls(self.nvml, problems)
            mig_handle = mig_call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if mig_handle is None:
                continue  # an empty slot
            name = _text(mig_call("nvmlDeviceGetName", mig_handle, default=""))
            memory = mig_call("nvmlDeviceGetMemoryInfo", mig_handle)
            mig = wire.MigInfo(parent_uuid=parent.uuid, profile=mig_profile(name),
                               gpu_instance_id=int(mig_call("nvmlDeviceGetGpuInstanceId", mig_handle, default=0)),
                               compute_instance_id=int(mig_call("nvmlDeviceGetComputeInstanceId", mig_handle,
                                                                default=0)))
            instances.append(wire.GpuInfo(
                index=mig_index(parent.index, slot), uuid=_text(mig_call("nvmlDeviceGetUUID", mig_handle, default="")),
                name=name, memory_total=int(getattr(memory, "total", 0)), memory_used=int(getattr(memory, "used", 0)),
                compute_capability=parent.compute_capability, numa_node=parent.numa_node,
                pci_bus_id=parent.pci_bus_id, driver_version=parent.driver_version, cuda_version=parent.cuda_version,
                nic_paths=list(parent.nic_paths),
                health=wire.GpuHealth(ecc_errors=parent.health.ecc_errors, temperature_c=parent.health.temperature_c,
                                      problems=problems),
                mig=mig))
        if not instances:
            parent.health.problems.append("MIG mode is enabled but no MIG instance exists")
        return instances


def _cluster_uuid(raw: bytes) -> str:
    """A fabric cluster UUID as text; "" for the all-zero UUID of a GPU in no cluster."""
    return str(uuid_module.UUID(bytes=raw[:16].ljust(16, b"\0"))) if raw.strip(b"\0") else ""


