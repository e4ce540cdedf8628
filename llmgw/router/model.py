"""The model a routing tier is built for: one type, whether its replicas are static or deployed.

A tier never sees a config object: :class:`TierModel` carries what routing may use (the name,
the tier and its options, the weights directory for a local tokenizer, the LoRA adapters, the
engine's command-line arguments) and nothing else, so a profile's ``env`` (which often holds
tokens) never reaches a third-party tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A LoRA adapter the model's replicas serve: the name clients use and where its files are."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class TierModel:
    """What a routing tier knows about its model."""

    name: str
    routing: str = "round_robin"
    routing_options: Mapping[str, Any] = field(default_factory=dict)
    model_path: str | None = None  # a deployed profile's weights (and tokenizer files); None for static replicas
    lora_adapters: tuple[LoraRef, ...] = ()
    engine_args: tuple[str, ...] = ()  # a deployed profile's engine arguments (e.g. --block-size); () for static

    @classmethod
    def of(cls, name: str, routing: str, routing_options: Mapping[str, Any] | None = None, *,
           model_path: str | None = None, lora_adapters: Iterable[Any] = (),
           engine_args: Iterable[str] = ()) -> "TierModel":
        """Build one from config values; ``lora_adapters`` are anything with ``name`` and ``path``."""
        return cls(name=name, routing=routing, routing_options=dict(routing_options or {}), model_path=model_path,
                   lora_adapters=tuple(LoraRef(a.name, a.path) for a in lora_adapters),
                   engine_args=tuple(str(arg) for arg in engine_args))
