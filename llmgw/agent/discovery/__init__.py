"""Hardware discovery: what an agent tells the control plane about its node.

``discover(spec, node_id=..., address=...)`` returns the node's
:class:`llmgw.wire.Register` (``token`` and ``shards`` left for the caller).
``spec`` picks the provider:

- ``auto``: NVML (``nvidia-ml-py``) when a driver answers, else CPU-only;
- ``nvml``: NVML or :class:`DiscoveryError`;
- ``cpu``: CPU-only, even on a GPU machine;
- ``fixture:PATH``: a recorded node (``tests/fixtures/nodes/*.json``) run through the NVML provider.

Discovery is synchronous and may block in the driver: call it through
``trio.to_thread.run_sync``. Providers and the fixture format are described in
``docs/placement.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw import wire

from .auto import AutoProvider
from .cpu import CpuProvider
from .fixture import FakeNvml, FixtureProvider, NodeFixture, RecordedHost, load_fixture
from .host import SystemHost
from .nvml import NvmlProvider
from .provider import DiscoveryError, DiscoveryProvider, HostSource, NvmlUnavailable

FIXTURE_PREFIX = "fixture:"
SPECS = ("auto", "nvml", "cpu", f"{FIXTURE_PREFIX}PATH")


def provider_for(spec: str) -> DiscoveryProvider:
    """The provider a discovery spec names; :class:`DiscoveryError` for an unknown one."""
    if spec == "auto":
        return AutoProvider()
    if spec == "nvml":
        return NvmlProvider()
    if spec == "cpu":
        return CpuProvider()
    if spec.startswith(FIXTURE_PREFIX) and spec[len(FIXTURE_PREFIX):]:
        return FixtureProvider(spec[len(FIXTURE_PREFIX):])
    raise DiscoveryError(f"unknown discovery {spec!r}: expected one of {', '.join(SPECS)}")


def discover(spec: str = "auto", *, node_id: str, address: str, labels: dict[str, str] | None = None,
             weight_roots: Sequence[str] = (), storage_paths: Sequence[str] = ()) -> wire.Register:
    """Describe this node (or a recorded one) as a Register message, without token and shards."""
    return provider_for(spec).discover(node_id=node_id, address=address, labels=labels,
                                       weight_roots=list(weight_roots), storage_paths=list(storage_paths))


__all__ = [
    "AutoProvider", "CpuProvider", "DiscoveryError", "DiscoveryProvider", "FakeNvml", "FixtureProvider",
    "HostSource", "NodeFixture", "NvmlProvider", "NvmlUnavailable", "RecordedHost", "SystemHost", "discover",
    "load_fixture", "provider_for",
]
