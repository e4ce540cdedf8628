"""``auto`` discovery: NVML when a driver answers, otherwise the CPU-only description of the same host."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llmgw import wire

from .cpu import CpuProvider
from .host import SystemHost
from .nvml import NvmlProvider, load_pynvml
from .provider import HostSource, NvmlUnavailable

log = logging.getLogger(__name__)
_reasons_told: set[str] = set()  # discovery runs on every (re)connect: say why there are no GPUs once per process


class AutoProvider:
    """Try NVML (``nvml``: a module or stand-in; default: import ``pynvml``), fall back to the CPU provider."""

    def __init__(self, nvml: Any = None, host: HostSource | None = None):
        self.nvml = nvml
        self.host = host if host is not None else SystemHost()

    def discover(self, *, node_id: str, address: str, labels: dict[str, str] | None = None,
                 weight_roots: Sequence[str] = (), storage_paths: Sequence[str] = ()) -> wire.Register:
        arguments: dict[str, Any] = dict(node_id=node_id, address=address, labels=labels,
                                         weight_roots=weight_roots, storage_paths=storage_paths)
        try:
            nvml = self.nvml if self.nvml is not None else load_pynvml()
            return NvmlProvider(nvml=nvml, host=self.host).discover(**arguments)
        except NvmlUnavailable as exc:
            level = logging.DEBUG if str(exc) in _reasons_told else logging.INFO
            _reasons_told.add(str(exc))
            log.log(level, "no NVIDIA GPUs discovered (%s): describing a CPU-only node", exc)
        return CpuProvider(self.host).discover(**arguments)
