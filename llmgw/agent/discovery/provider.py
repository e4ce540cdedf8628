"""The interfaces of discovery: a provider describes a node, a host source answers about the machine.

A :class:`DiscoveryProvider` turns a machine into the :class:`llmgw.wire.Register`
an agent sends (``token`` and ``shards`` are left for the caller). The NVML
provider and the CPU provider read the machine's own facts (CPU, memory,
InfiniBand, IMEX, PCI topology, disks) through a :class:`HostSource`, so a
recorded fixture can stand in for the real ``/proc``, ``/sys`` and ``/dev``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from llmgw import wire


class DiscoveryError(RuntimeError):
    """Discovery was asked for something it cannot do (a bad spec, NVML demanded but missing)."""


class NvmlUnavailable(DiscoveryError):
    """NVML cannot be used here: no ``pynvml``, no driver, or ``nvmlInit`` failed."""


class DiscoveryProvider(Protocol):
    """One way of describing a node. Synchronous and possibly slow: run it in a worker thread."""

    def discover(self, *, node_id: str, address: str, labels: dict[str, str] | None = None,
                 weight_roots: Sequence[str] = (), storage_paths: Sequence[str] = ()) -> wire.Register:
        """The node's Register message, without token and shards."""
        ...


class HostSource(Protocol):
    """The machine facts discovery needs besides NVML: the live system, or a recorded fixture."""

    def hostname(self) -> str: ...

    def host_info(self) -> wire.HostInfo:
        """OS, kernel, architecture, CPU model and flags, Python version (driver fields left empty)."""
        ...

    def cpu_count(self) -> int: ...

    def memory_bytes(self) -> int: ...

    def infiniband(self) -> list[wire.Hca]:
        """One entry per HCA port, sorted by HCA name and port."""
        ...

    def imex_channels(self) -> list[int]: ...

    def pci_numa_node(self, bus_id: str) -> int:
        """The NUMA node of a PCI device (``0000:18:00.0``), -1 when unknown."""
        ...

    def pci_path(self, bus_id: str) -> str:
        """The device's place in the PCI tree (``/sys/devices/pci0000:15/.../0000:18:00.0``), "" when unknown."""
        ...

    def storage(self, paths: Sequence[str]) -> list[wire.StorageInfo]: ...

    def local_weights(self, roots: Sequence[str]) -> list[wire.LocalWeights]: ...
