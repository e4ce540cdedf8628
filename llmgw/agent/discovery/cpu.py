"""The CPU-only provider: a node described from its host facts alone, with no GPUs.

Also the base every provider builds on: :func:`host_register` fills the
host part of a Register (hostname, OS, CPU, memory, InfiniBand fabrics, IMEX,
storage, local weights) that the NVML provider then adds GPUs to.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw import __version__, wire

from .host import SystemHost
from .provider import HostSource
from .topology import fabrics_of, imex_of


def host_register(host: HostSource, *, node_id: str, address: str, labels: dict[str, str] | None,
                  weight_roots: Sequence[str], storage_paths: Sequence[str]) -> wire.Register:
    """A Register describing the host, without GPUs (nor token and shards, which are the caller's)."""
    return wire.Register(
        node_id=node_id, hostname=host.hostname(), address=address, labels=dict(labels or {}),
        agent_version=__version__, host=host.host_info(), cpu_count=host.cpu_count(),
        memory_bytes=host.memory_bytes(), imex=imex_of(host.imex_channels(), []),
        fabrics=fabrics_of(host.infiniband(), []), storage=host.storage(storage_paths),
        local_weights=host.local_weights(weight_roots),
    )


class CpuProvider:
    """A node without GPUs (or without a usable NVIDIA driver)."""

    def __init__(self, host: HostSource | None = None):
        self.host = host if host is not None else SystemHost()

    def discover(self, *, node_id: str, address: str, labels: dict[str, str] | None = None,
                 weight_roots: Sequence[str] = (), storage_paths: Sequence[str] = ()) -> wire.Register:
        return host_register(self.host, node_id=node_id, address=address, labels=labels,
                             weight_roots=weight_roots, storage_paths=storage_paths)
