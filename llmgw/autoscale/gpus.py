"""The free GPUs a scaling step may use, as :meth:`~llmgw.autoscale.scaler.TargetScaler.decide` reads them."""

from __future__ import annotations

from typing import Sequence

from ..config import Config
from ..control.placement import NodeView, class_matches


def free_gpus_of(nodes: Sequence[NodeView], config: Config) -> dict[str | None, int]:
    """The GPUs no replica holds on schedulable nodes: in all (key None) and of each autoscaled profile's
    ``gpu_class`` (a GPU is of a class as placement matches it)."""
    free = [gpu for node in nodes if node.schedulable for gpu in node.gpus if gpu.index not in node.used_gpus]
    counts: dict[str | None, int] = {None: len(free)}
    for deployment in config.deployments:
        gpu_class = config.profile(deployment.profile).gpu_class
        if deployment.autoscaled and gpu_class is not None:
            counts[gpu_class] = sum(1 for gpu in free if class_matches(gpu_class, gpu))
    return counts
