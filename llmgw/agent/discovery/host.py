"""The live machine as a :class:`HostSource`: ``/proc``, ``/sys`` and ``/dev`` under an injectable root.

The root (``/`` in production) lets tests lay out a fake sysfs tree. Hostname,
kernel release and architecture come from the running interpreter. The
parsers of sysfs InfiniBand values are shared with the fixture host, so a
recording exercises the same code.
"""

from __future__ import annotations

import os
import platform
import re
import socket
from collections.abc import Sequence
from pathlib import Path

from llmgw import wire

from . import storage
from .topology import normalize_bus_id

IMEX_CHANNEL_DIR = "dev/nvidia-caps-imex-channels"


def parse_ib_state(text: str) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``."""
    return text.strip().split(":", 1)[-1].strip()


def parse_ib_rate(text: str) -> float:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0 (Gb/s); 0 when unreadable."""
    match = re.match(r"\s*([\d.]+)\s*Gb/sec", text)
    return float(match.group(1)) if match else 0.0


def subnet_prefix(gid: str) -> str:
    """The first 64 bits of a port GID, as sysfs writes it: ``"fe80:0000:0000:0000"``."""
    groups = gid.strip().lower().split(":")
    return ":".join(groups[:4]) if len(groups) == 8 else ""


def make_hca(name: str, port: int, *, state: str, rate: str, link_layer: str, gid: str = "",
             pci_bus_id: str = "", numa_node: int = -1) -> wire.Hca:
    """One HCA port from its raw sysfs values."""
    return wire.Hca(name=name, port=port, state=parse_ib_state(state), rate_gbps=parse_ib_rate(rate),
                    link_layer=link_layer.strip(), subnet_prefix=subnet_prefix(gid),
                    pci_bus_id=normalize_bus_id(pci_bus_id), numa_node=numa_node)


class SystemHost:
    """Reads this machine. ``root`` is where ``/`` is (a temporary tree in tests)."""

    def __init__(self, root: str | os.PathLike = "/"):
        self.root = Path(root)

    def _at(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def _read(self, path: str | Path, default: str = "") -> str:
        try:
            return (path if isinstance(path, Path) else self._at(path)).read_text()
        except OSError:
            return default

    def hostname(self) -> str:
        return socket.gethostname()

    def host_info(self) -> wire.HostInfo:
        cpu_model, flags = self._cpuinfo()
        return wire.HostInfo(os=self._os_name(), kernel=platform.release(), arch=platform.machine(),
                             cpu_model=cpu_model, cpu_flags=flags, python_version=platform.python_version())

    def _os_name(self) -> str:
        for line in self._read("/etc/os-release").splitlines():
            key, _, value = line.partition("=")
            if key == "PRETTY_NAME":
                return value.strip().strip('"')
        return platform.system()

    def _cpuinfo(self) -> tuple[str, list[str]]:
        model, flags = "", list[str]()
        for line in self._read("/proc/cpuinfo").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model name") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:  # x86, Arm
                flags = sorted(set(value.split()))
        return model or platform.processor(), flags

    def cpu_count(self) -> int:
        try:
            return len(os.sched_getaffinity(0))  # what this process may use (cpusets, taskset)
        except (AttributeError, OSError):
            return os.cpu_count() or 0

    def memory_bytes(self) -> int:
        for line in self._read("/proc/meminfo").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
        return 0

    def infiniband(self) -> list[wire.Hca]:
        hcas = []
        base = self._at("/sys/class/infiniband")
        for device in sorted(base.glob("*")) if base.is_dir() else ():
            bus_id = self._device_bus_id(device / "device")
            numa = self._int(device / "device" / "numa_node")
            for port_dir in sorted((device / "ports").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
                if not port_dir.name.isdigit():
                    continue
                hcas.append(make_hca(device.name, int(port_dir.name), state=self._read(port_dir / "state"),
                                     rate=self._read(port_dir / "rate"),
                                     link_layer=self._read(port_dir / "link_layer"),
                                     gid=self._read(port_dir / "gids" / "0"), pci_bus_id=bus_id, numa_node=numa))
        return hcas

    def _device_bus_id(self, link: Path) -> str:
        try:
            return os.path.basename(os.path.realpath(link))
        except OSError:
            return ""

    def _int(self, path: Path, default: int = -1) -> int:
        try:
            return int(self._read(path).strip())
        except ValueError:
            return default

    def imex_channels(self) -> list[int]:
        base = self._at(IMEX_CHANNEL_DIR)
        if not base.is_dir():
            return []
        return sorted(int(entry.name[len("channel"):]) for entry in base.iterdir()
                      if entry.name.startswith("channel") and entry.name[len("channel"):].isdigit())

    def pci_numa_node(self, bus_id: str) -> int:
        return self._int(self._at(f"/sys/bus/pci/devices/{normalize_bus_id(bus_id)}/numa_node"))

    def pci_path(self, bus_id: str) -> str:
        device = self._at(f"/sys/bus/pci/devices/{normalize_bus_id(bus_id)}")
        if not bus_id or not device.exists():
            return ""
        real = Path(os.path.realpath(device))
        try:
            return "/" + str(real.relative_to(os.path.realpath(self.root)))
        except ValueError:
            return str(real)

    def storage(self, paths: Sequence[str]) -> list[wire.StorageInfo]:
        return storage.disk_usage(paths)

    def local_weights(self, roots: Sequence[str]) -> list[wire.LocalWeights]:
        return storage.find_local_weights(roots)
