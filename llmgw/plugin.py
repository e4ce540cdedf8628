"""llmgw's public plugin API: everything a plugin implements, receives or raises, in one module.

A plugin imports from here and nowhere else in llmgw (``from llmgw.plugin
import RoutingTier, Decision, hookimpl``); the modules these names come from
may move, this one keeps them. The hooks themselves, with what each returned
factory must build, are in :mod:`llmgw.hookspecs`; a walkthrough of a complete
tier (package, entry point, test) is in ``docs/plugins.md``.

Routing tiers (hook ``register_routing_tiers``): ``factory(model, services)``

- :class:`TierModel` ``model``: the model the tier routes (name, ``routing_options``, LoRA adapters...);
- :class:`TierServices` ``services``: the plugin registry, :class:`Metrics`, the model's replicas, a clock, the
  router's :class:`KvIndex`;
- builds a :class:`RoutingTier`. Subclass it: ``pick`` is the one method to write, and every other hook
  (``routed``, ``first_token``, ``attempt_failed``, ``finished``, ``explain``, ``check_options``) has a
  no-op default. A duck-typed class with ``name`` and ``pick`` (:class:`TierProtocol`) works too.
- per request it gets a :class:`RouteRequest` and the candidate :class:`Replica` views, and returns a
  :class:`Decision` (or None to defer to ``round_robin``).

Scorers (``register_scorers``): ``factory(options)`` builds a :class:`Scorer` rating candidates from a
:class:`ScoreContext`. KV routing: :class:`BlockKeyFunction` (``register_block_key_functions``),
:data:`EventDecoder` (``register_event_decoders``, raising :class:`EventDecodeError`),
:class:`TokenizerSource` (``register_tokenizer_sources``, raising :class:`TokenizeError`). Engines
(``register_engines``): :class:`Engine`, given a :class:`StartShard` and a :class:`LaunchContext`, returning a
:class:`Launch` and a :class:`Readiness`, raising :class:`EngineError`.

:class:`PluginError` is what ``registry.get(kind, name)`` raises for a name no plugin registers. The testing
helper for tiers is :class:`llmgw.testing.plugins.TierHarness`.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

from .agent.engine import Engine, EngineError, Launch, LaunchContext, Readiness
from .engines.probe import VLLM_GAUGES, EngineGauges, EngineLoad
from .hookspecs import hookimpl
from .kv.codec import EventDecodeError
from .kv.events import EventBatch
from .kv.index import IndexState, KvIndex, KvIndexView
from .kv.keys import BlockKeyFunction, ExtraKeys
from .kv.tokenize import TokenizeError
from .metrics import Metrics
from .plugins_manager import PluginError, Registry
from .router.model import LoraRef, TierModel
from .router.replica import ReplicaState
from .router.tier import (
    Decision,
    Explanation,
    ReplicaView as Replica,
    RouteRequest,
    RoutingTier,
    ScoreContext,
    Scorer,
    TierProtocol,
    TierServices,
)
from .wire import StartShard

EventDecoder = Callable[[bytes], EventBatch]
"""What an event-decoder factory builds: ``decode(payload) -> EventBatch``, raising :class:`EventDecodeError`."""


@runtime_checkable
class TokenizerSource(Protocol):
    """What a tokenizer-source factory builds: the prompt token ids a replica would compute for a request.

    ``body`` is the ``/tokenize`` JSON (bytes) :func:`llmgw.kv.tokenize.plan` built for the request;
    ``replica`` the candidate to ask when the source asks engines (the least loaded one). Raises
    :class:`TokenizeError` (``kind`` ``timeout`` when too slow): the tier then routes by its prefix tree.

    Optional: a source with attributes ``observe`` and ``count_source`` set to None gets them set by the tier,
    to ``observe(seconds)`` of each ``/tokenize`` call and ``count_source(name)`` of where each answer came from
    (``llmgw_kv_tokenize_seconds``, ``llmgw_kv_tokenize_source_total``).
    """

    async def tokenize(self, replica: Replica, body: bytes) -> Sequence[int]: ...


__all__ = [
    "BlockKeyFunction", "Decision", "Engine", "EngineError", "EngineGauges", "EngineLoad", "EventBatch",
    "EventDecodeError", "EventDecoder", "Explanation", "ExtraKeys", "IndexState", "KvIndex", "KvIndexView", "Launch",
    "LaunchContext", "LoraRef", "Metrics", "PluginError", "Readiness", "Registry", "Replica", "ReplicaState",
    "RouteRequest", "RoutingTier", "ScoreContext", "Scorer", "StartShard", "TierModel", "TierProtocol",
    "TierServices", "TokenizeError", "TokenizerSource", "VLLM_GAUGES", "hookimpl",
]
