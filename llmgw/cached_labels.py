"""A labelled Prometheus metric whose children are cached per label values (used by every metric set)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from prometheus_client.metrics import MetricWrapperBase

_Metric = TypeVar("_Metric", bound=MetricWrapperBase)


class CachedLabels(Generic[_Metric]):
    """A labelled metric whose children are kept per label values: ``.labels(*values)`` is a dict lookup.

    Anything else (``collect``, ``describe``, ...) is the wrapped metric's; ``remove`` and
    ``clear`` also forget the cached children. The wrapped metric is ``.metric``.
    """

    __slots__ = ("metric", "_children")

    def __init__(self, metric: _Metric):
        self.metric = metric
        self._children: dict[tuple[Any, ...], _Metric] = {}

    def labels(self, *values: Any, **labelkwargs: Any) -> _Metric:
        if labelkwargs:
            return self.metric.labels(*values, **labelkwargs)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: Any) -> None:
        wanted = tuple(str(v) for v in values)
        self._children = {k: v for k, v in self._children.items() if tuple(str(x) for x in k) != wanted}
        self.metric.remove(*values)

    def clear(self) -> None:
        self._children.clear()
        self.metric.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)
