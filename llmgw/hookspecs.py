"""Every hook llmgw calls, with its arguments and what the factories it returns must build.

Plugins implement these with ``@llmgw.plugin.hookimpl`` (or their own
``pluggy.HookimplMarker("llmgw")``) and are found through the ``llmgw``
entry-point group. llmgw's own routing tiers, engines, decoders and key
functions are plugins too, registered the same way (see
``[project.entry-points.llmgw]`` in ``pyproject.toml``). Every type named
below is importable from :mod:`llmgw.plugin`, the public API.

Each ``register_*`` hook takes no argument and returns a mapping of *name* ->
*factory* (an empty mapping or None adds nothing). The config file selects an
implementation by name (``routing: round_robin``, ``engine: sim``...). Hooks
are called once per process, when the configuration is first loaded, never per
request: the resolved factories are kept in a :class:`llmgw.plugin.Registry`
(``registry.get(kind, name)`` raises :class:`llmgw.plugin.PluginError` for a
name nobody registers). Two plugins registering one name in one hook is an
error at start-up that names both.

Factories are called when a model (or a profile's served model) is configured
(at start and on a reload that changes it), or, for engines, when an agent
starts a shard; an exception from a factory is a configuration error.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("llmgw")
hookimpl = pluggy.HookimplMarker("llmgw")


@hookspec
def register_routing_tiers():
    """Return ``{name: factory}`` of routing tiers: the names ``routing:`` of a model or profile may take.

    ``factory(model, services)`` builds one tier for one model:

    - ``model``: a :class:`~llmgw.plugin.TierModel`: ``name``, ``routing`` (this name),
      ``routing_options`` (the tier's own settings, free-form), ``model_path`` (a deployed profile's weights),
      ``lora_adapters`` and ``engine_args``; never the profile's ``env``;
    - ``services``: a :class:`~llmgw.plugin.TierServices`: ``registry``, ``metrics`` (add series to
      ``metrics.registry``), ``replicas`` (the model's, live), ``model``, ``clock``, ``kv_index``.

    It must build a :class:`~llmgw.plugin.RoutingTier` (subclass it; or any object with ``name`` and
    ``async pick(request, candidates)``, :class:`~llmgw.plugin.TierProtocol`). Per attempt the router calls
    ``pick`` -> ``routed`` -> (``first_token``) -> (``attempt_failed``) -> ``finished``; see
    :class:`~llmgw.plugin.RoutingTier` for each. A factory that is a class may have a
    ``check_options(options, registry) -> list[str]`` class method: its problems with ``routing_options``
    are config errors (``llmgw config check``, ``serve``, reloads), reported with the config line.
    """


@hookspec
def register_scorers():
    """Return ``{name: factory}`` of replica scorers, for scoring tiers (``prefix_tree``, ``kv_index``).

    ``factory(options)`` builds a :class:`~llmgw.plugin.Scorer`, where ``options`` is the model's whole
    ``routing_options`` mapping. A scorer reads its own keys from it and lists them in the factory's
    ``option_keys`` attribute, so config checks accept them. ``scorer.score(request, candidates, context)``
    returns one float in [0, 1] per candidate (``context``: a :class:`~llmgw.plugin.ScoreContext`). A model
    weights scorers by name in ``routing_options.scorers``. Built-in: ``prefix`` and ``load``
    (:mod:`llmgw.plugins.scorers`).
    """


@hookspec
def register_block_key_functions():
    """Return ``{name: factory}`` of block-key functions (``routing_options.key_function`` of ``kv_index``).

    ``factory(**options)`` (``routing_options.key_function_options``; the ``vllm`` one also gets ``algo`` and
    ``seed``) builds a :class:`~llmgw.plugin.BlockKeyFunction`: ``keys(token_ids, block_size, extra_keys)``
    turns token ids into one unsigned 64-bit key per full block, equal to the keys the engine's KV events
    carry. Built-in: ``vllm`` and ``content``.
    """


@hookspec
def register_event_decoders():
    """Return ``{name: factory}`` of KV-event payload decoders.

    ``factory()`` builds a :data:`~llmgw.plugin.EventDecoder`: ``decode(payload: bytes) ->
    EventBatch`` (:class:`~llmgw.plugin.EventBatch`), raising :class:`~llmgw.plugin.EventDecodeError` on
    bad input. It runs in the agent, per event message: keep it fast. Built-in: ``vllm``.
    """


@hookspec
def register_tokenizer_sources():
    """Return ``{name: factory}`` of tokenizer sources (``routing_options.tokenizer`` of ``kv_index``).

    ``factory(options)`` builds a :class:`~llmgw.plugin.TokenizerSource`, whose ``async tokenize(replica,
    body)`` returns the token ids a replica would compute for a request, raising
    :class:`~llmgw.plugin.TokenizeError` (``kind="timeout"`` when too slow). ``options`` holds
    ``tokenize_timeout``, ``tokenize_timeout_per_kb``, ``tokenize_cache_tokens``, ``tokenizer_path`` (the
    model's tokenizer files, when known) and ``base_models`` (the names the base model is served under).
    Built-in: ``auto``, ``local`` and ``replica``.
    """


@hookspec
def register_engines():
    """Return ``{name: factory}`` of engines an agent can run: the names ``engine:`` of a profile may take.

    ``factory()`` builds an :class:`~llmgw.plugin.Engine`: ``command(spec, ctx) -> Launch`` (the command line
    and environment of one shard, given a :class:`~llmgw.plugin.StartShard` and a
    :class:`~llmgw.plugin.LaunchContext`; :class:`~llmgw.plugin.EngineError` when impossible),
    ``readiness(spec) -> Readiness`` (how to probe it) and ``inflight_metric_names()`` (the ``/metrics``
    gauges whose sum is its requests in flight, for draining). It never spawns processes itself.
    Built-in: ``vllm`` and ``sim``.
    """
