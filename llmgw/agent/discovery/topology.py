"""Topology from raw facts: PCI bus ids, GPU-to-NIC paths, NVLink islands, fabrics and IMEX.

Pure functions over values NVML and sysfs return, so the live and the recorded
paths share them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmgw import wire

# NVML's nvmlNvlinkVersion_t -> Gb/s of one link, both directions added (NVLink 4: 18 links x 400 = 7200 Gb/s,
# the 900 GB/s of an H100 SXM). Unknown versions count 0.
NVLINK_GBPS_PER_LINK = {1: 320.0, 2: 400.0, 3: 400.0, 4: 400.0, 5: 400.0, 6: 400.0, 7: 800.0}

# How close a NIC is to a GPU, nearest first, with nvidia-smi topo's names.
PCI_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's ``00000000:18:00.0`` or sysfs' ``0000:18:00.0`` -> ``0000:18:00.0`` (lower case)."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    bus_id = bus_id.strip().lower()
    if not bus_id:
        return ""
    parts = bus_id.split(":")
    if len(parts) == 2:  # bus:device.function without a domain
        parts.insert(0, "0")
    domain = parts[0][-8:].lstrip("0").rjust(4, "0")
    return ":".join([domain, *parts[1:]])


def pci_link(gpu_path: str, nic_path: str, gpu_numa: int = -1, nic_numa: int = -1) -> str:
    """The path class between two PCI devices, as ``nvidia-smi topo -m`` names it ("" when unknown).

    From their sysfs device paths: under the same PCIe switch ``PIX``, behind
    several bridges of one root port ``PXB``, sharing only the host bridge
    ``PHB``; otherwise ``NODE`` on one NUMA node, ``SYS`` across sockets.
    """
    gpu_parts, nic_parts = _pci_chain(gpu_path), _pci_chain(nic_path)
    if gpu_parts and nic_parts and gpu_parts[0] == nic_parts[0]:
        gpu_bridges, nic_bridges = gpu_parts[1:-1], nic_parts[1:-1]
        common = 0
        for a, b in zip(gpu_bridges, nic_bridges):
            if a != b:
                break
            common += 1
        if common == 0:
            return "PHB"
        hops = len(gpu_bridges) + len(nic_bridges) - 2 * common
        return "PIX" if hops <= 2 else "PXB"
    if gpu_numa >= 0 and nic_numa >= 0:
        return "NODE" if gpu_numa == nic_numa else "SYS"
    return ""


def _pci_chain(path: str) -> list[str]:
    """``/sys/devices/pci0000:15/0000:15:01.0/0000:18:00.0`` -> ``["pci0000:15", "0000:15:01.0", "0000:18:00.0"]``."""
    parts = [part for part in path.split("/") if part]
    for i, part in enumerate(parts):
        if part.startswith("pci"):
            return parts[i:]
    return []


def nic_paths(gpu_path: str, gpu_numa: int, hcas: Sequence[wire.Hca], path_of) -> list[wire.NicPath]:
    """The path from a GPU to each HCA (one entry per HCA, not per port), nearest first."""
    paths = {}
    for hca in hcas:
        if hca.name in paths:
            continue
        link = pci_link(gpu_path, path_of(hca.pci_bus_id) if hca.pci_bus_id else "", gpu_numa, hca.numa_node)
        if link:
            paths[hca.name] = wire.NicPath(nic=hca.name, link=link)
    return sorted(paths.values(), key=lambda p: (PCI_LINKS.index(p.link), p.nic))


@dataclass
class NvlinkEnds:
    """What one GPU's NVLinks reach: remote PCI bus ids of active links, and its fabric clique if any."""

    uuid: str
    bus_id: str
    remote_bus_ids: list[str]
    clique: str = ""  # "cluster-uuid/clique-id" when the GPU joined an NVLink fabric


def nvlink_peers(ends: Sequence[NvlinkEnds]) -> dict[str, list[str]]:
    """For each GPU, the other GPUs it reaches over NVLink (directly, through a shared NVSwitch, or in
    the same fabric clique), in input order.

    A remote bus id that is another local GPU links the two; any other remote
    (an NVSwitch) joins every GPU wired to it.
    """
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        parent.setdefault(key, key)
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    def union(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    gpu_by_bus = {normalize_bus_id(end.bus_id): end.uuid for end in ends if end.bus_id}
    for end in ends:
        me = f"gpu:{end.uuid}"
        find(me)
        for remote in filter(None, map(normalize_bus_id, end.remote_bus_ids)):
            union(me, f"gpu:{gpu_by_bus[remote]}" if remote in gpu_by_bus else f"switch:{remote}")
        if end.clique:
            union(me, f"clique:{end.clique}")
    return {end.uuid: [other.uuid for other in ends
                       if other.uuid != end.uuid and find(f"gpu:{other.uuid}") == find(f"gpu:{end.uuid}")]
            for end in ends}


def nvlink_bandwidth_gbps(link_versions: Iterable[int]) -> float:
    """Total bandwidth of a GPU's active NVLinks (both directions, Gb/s) from their NVML versions."""
    return sum(NVLINK_GBPS_PER_LINK.get(version, 0.0) for version in link_versions)


def fabric_kind(link_layer: str) -> str:
    return {"infiniband": "infiniband", "ethernet": "roce"}.get(link_layer.lower(), link_layer.lower() or "unknown")


def fabrics_of(hcas: Sequence[wire.Hca], gpus: Sequence[wire.GpuInfo]) -> list[wire.FabricInfo]:
    """Fabrics this node is on: HCAs grouped by link layer and subnet prefix, then NVLink fabric cliques."""
    fabrics: dict[tuple[str, str], wire.FabricInfo] = {}
    for hca in hcas:
        key = (fabric_kind(hca.link_layer), hca.subnet_prefix)
        fabrics.setdefault(key, wire.FabricInfo(kind=key[0], name=key[1])).hcas.append(hca)
    for gpu in gpus:
        clique = fabric_clique(gpu.fabric)
        if clique:
            fabrics.setdefault(("nvlink", clique), wire.FabricInfo(kind="nvlink", name=clique))
    return [fabrics[key] for key in sorted(fabrics)]


def fabric_clique(fabric: wire.GpuFabric | None) -> str:
    """``"cluster-uuid/clique-id"`` of a GPU registered in a multi-node NVLink fabric, else ""."""
    if fabric is None or fabric.state != "completed" or fabric.status != "success" or not fabric.cluster_uuid:
        return ""
    return f"{fabric.cluster_uuid}/{fabric.clique_id}"


def imex_of(channels: Sequence[int], gpus: Sequence[wire.GpuInfo]) -> wire.ImexInfo:
    """IMEX: ``ready`` when channels exist, ``not_configured`` when GPUs are in an NVLink fabric without them."""
    if channels:
        return wire.ImexInfo(state="ready", channels=list(channels))
    if any(fabric_clique(gpu.fabric) for gpu in gpus):
        return wire.ImexInfo(state="not_configured")
    return wire.ImexInfo()
