"""The prediction rule of :mod:`llmgw.kv.predictions`, written plainly, for the property tests to compare with.

A prediction holds its keys until it expires or is dropped; a store of any of its keys settles it; a removal of a
key takes it from every live prediction holding it on that replica when all of them are settled; a drop (a reset,
a lost stream, the replica gone) takes everything of the replica. Used by the state machines of
``tests/unit/test_kv_predictions.py`` (the overlay alone) and ``tests/unit/test_kv_index.py`` (through
``KvIndex``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelPrediction:
    replica: str
    keys: set[int]
    expiry: float
    handle: Any = None  # what the code under test returned for it
    held: set[int] = field(default_factory=set)
    settled: bool = False
    live: bool = True

    def __post_init__(self) -> None:
        self.held = set(self.keys)


class PredictionModel:
    def __init__(self, ttl: float):
        self.ttl = ttl
        self.predictions: list[ModelPrediction] = []

    def live(self, now: float, replica: str | None = None) -> list[ModelPrediction]:
        return [p for p in self.predictions if p.live and p.expiry > now and (replica is None or p.replica == replica)]

    def held(self, now: float, replica: str | None = None) -> set[int]:
        """The keys live predictions hold (on ``replica``, or anywhere)."""
        return set().union(*(p.held for p in self.live(now, replica)))

    def predict(self, replica: str, keys: Iterable[int], now: float, ttl: float | None, handle: Any) -> None:
        self.predictions.append(ModelPrediction(replica, set(keys), now + (self.ttl if ttl is None else ttl), handle))

    def stored(self, replica: str, keys: Iterable[int], now: float) -> None:
        stored = set(keys)
        for p in self.live(now, replica):
            if p.keys & stored:
                p.settled = True

    def evicted(self, replica: str, keys: Iterable[int], now: float) -> None:
        mine = self.live(now, replica)
        for key in keys:
            holding = [p for p in mine if key in p.held]
            if all(p.settled for p in holding):
                for p in holding:
                    p.held.discard(key)

    def drop(self, replica: str, now: float) -> None:
        for p in self.live(now, replica):
            p.held.clear()
            p.settled = True

    def settle(self, prediction: ModelPrediction, now: float) -> None:
        if prediction.live and prediction.expiry > now:
            prediction.settled = True

    def unpredict(self, prediction: ModelPrediction) -> None:
        prediction.live = False
