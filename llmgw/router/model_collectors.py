"""Prometheus collectors of one object per model (a tier's tree, its decode model), read at scrape time.

One collector of each kind per metrics registry, registered the first time an
object is tracked (so re-configuring a model never registers a series twice).
It holds weak references: an object whose tier was replaced or dropped
disappears from the exposition. Nothing is updated per request; the numbers
are the objects' own, read when ``/metrics`` is rendered.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

T = TypeVar("T")

_collectors: "weakref.WeakKeyDictionary[CollectorRegistry, dict[type, PerModelCollector[Any]]]" = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


class PerModelCollector(Generic[T]):
    """Subclasses name their metric families (:meth:`families`) and add one model's samples to them (:meth:`add`)."""

    def __init__(self) -> None:
        self._objects: dict[str, weakref.ref[T]] = {}

    def track(self, model: str, obj: T) -> None:
        self._objects[model] = weakref.ref(obj)

    def families(self) -> Sequence[Metric]:
        raise NotImplementedError

    def add(self, families: Sequence[Any], model: str, obj: T) -> None:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return self.families()

    def collect(self) -> Iterable[Metric]:
        families = self.families()
        for model, ref in list(self._objects.items()):
            obj = ref()
            if obj is None:
                self._objects.pop(model, None)
                continue
            self.add(families, model, obj)
        return list(families)


def track(registry: CollectorRegistry, kind: type[PerModelCollector[T]], model: str, obj: T) -> None:
    """Report ``obj`` as model ``model``'s in ``registry``'s collector of ``kind`` (registered once)."""
    with _lock:
        kinds = _collectors.setdefault(registry, {})
        collector = kinds.get(kind)
        if collector is None:
            collector = kinds[kind] = kind()
            registry.register(collector)
    collector.track(model, obj)
