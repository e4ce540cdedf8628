"""Every hook llmgw calls, with what it must return.

Plugins implement these with ``@llmgw.hookimpl`` (or their own
``pluggy.HookimplMarker("llmgw")``, so they need not import llmgw at all) and
are found through the ``llmgw`` entry-point group. llmgw's own routing tiers,
engines, decoders and key functions are plugins too, registered the same way
(see ``[project.entry-points.llmgw]`` in ``pyproject.toml``).

Each ``register_*`` hook returns a mapping of *name* -> *factory*. The config
file selects an implementation by name (``routing: round_robin``,
``engine: sim``...). Hooks are called once when the configuration is loaded,
never per request: the resolved factories are kept in a
:class:`llmgw.plugins_manager.Registry`.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("llmgw")
hookimpl = pluggy.HookimplMarker("llmgw")


@hookspec
def register_routing_tiers():
    """Return ``{name: factory}`` of routing tiers.

    ``factory(model, services)`` builds one tier instance for one model, where
    ``model`` is the model's :class:`llmgw.config.ModelConfig` (its
    ``routing_options`` hold the tier's own settings) and ``services`` is the
    :class:`llmgw.router.tier.TierServices` the router offers (registry,
    metrics, the model's name and replica list, a clock). The instance
    implements :class:`llmgw.router.tier.RoutingTier` (optionally its
    ``explain`` and ``first_token``).
    """


@hookspec
def register_scorers():
    """Return ``{name: factory}`` of replica scorers used by scoring tiers.

    ``factory(options)`` builds a :class:`llmgw.router.tier.Scorer`, where
    ``options`` is the model's whole ``routing_options`` mapping (a scorer
    reads its own keys from it and lists them in the factory's
    ``option_keys``, so config checks accept them); a model or profile
    weights scorers by name in ``routing_options.scorers``. Built-in:
    ``prefix`` and ``load`` (:mod:`llmgw.plugins.scorers`).
    """


@hookspec
def register_block_key_functions():
    """Return ``{name: factory}`` of block-key functions.

    ``factory(**options)`` builds a :class:`llmgw.kv.keys.BlockKeyFunction`
    that turns token ids into one 64-bit key per full block.
    """


@hookspec
def register_event_decoders():
    """Return ``{name: factory}`` of KV-event payload decoders.

    ``factory()`` builds a callable ``decode(payload: bytes) -> EventBatch``
    (see :mod:`llmgw.kv.events`) that raises
    :class:`llmgw.kv.codec.EventDecodeError` on bad input.
    """


@hookspec
def register_tokenizer_sources():
    """Return ``{name: factory}`` of tokenizer sources for the KV-index tier.

    ``factory(options)`` builds an object whose ``async tokenize(replica,
    body)`` returns the token ids a replica would compute for a request.
    ``options`` is the model's ``routing_options`` with ``tokenizer_path``
    (the model's tokenizer files, when known) and ``base_models`` added.
    """


@hookspec
def register_engines():
    """Return ``{name: factory}`` of engines an agent can run.

    ``factory()`` builds an :class:`llmgw.agent.engine.Engine`: how to build a
    shard's command line and environment, probe it, and configure its KV
    events.
    """
