"""The ``kv_index`` routing tier: send a request where the engines' KV caches really hold its leading blocks.

Per request (the rule, also in ``docs/kv-routing.md``):

1. :func:`llmgw.kv.tokenize.plan` decides whether the request can be indexed;
   if not, the prefix tree decides (outcome ``unindexable``).
2. If no candidate's index is healthy (no events yet, or resetting after a
   reset), the prefix tree decides (``index_unhealthy``) without tokenizing.
3. The prompt ids come from the tokenizer source (by default the model's
   ``tokenizer.json`` in the router when it is there, else a replica's
   ``/tokenize``: the candidate the request most likely goes to (the one
   holding the longest match of it in the tree, else the least loaded), so a
   prompt reaches no replica but one it may be routed to; answers cached by
   body) or
   from the request itself (token-id prompts). Too slow: the tree decides
   (``tokenize_timeout``); an error:
   the tree decides (``tokenize_error``). Bounded: a prompt of more than
   ``max_tokenize_chars`` characters is cut to that before it is tokenized
   (the last ``CUT_MARGIN_TOKENS`` ids of its answer dropped), an answer is
   read up to ``max_prompt_tokens`` (plus that margin) ids, and a long
   prompt's blocks are hashed in slices with a checkpoint between them.
4. The ids are hashed into block keys with the block size each candidate's
   events reported, or an assumed one until they do (:meth:`KvIndexTier.assumed_block_size`)
   (once per distinct size), with vLLM's extra keys
   (``cache_salt`` on block 0, a LoRA adapter on every block).
5. Each healthy candidate's share is the fraction of the prompt's blocks it
   holds as a leading run (contiguous from block 0; predicted entries of
   requests just routed count); a candidate whose index is not healthy gets
   the tree's share instead, for this decision.
6. The ``prefix_tree`` tier's rule decides: the cost model with each
   candidate's cached tokens (leading run x block size) and the exact prompt
   tokens, or the scorers with the shares (weights, ties,
   ``max_imbalance``/``load_sigma_k`` override): outcome ``hit``, ``miss``,
   ``cost_override`` or ``load_override``.
7. The chosen replica is predicted to hold the prompt's blocks for
   ``predicted_ttl`` (dropped at once if the attempt fails before the engine
   took it; settled when the response shows every predicted block was a hit:
   :mod:`llmgw.kv.index`) and is inserted into the tree (which stays warm for the
   fallbacks); the decision records its predicted cached tokens (leading
   blocks x block size, never the last prompt token, as vLLM caps hits),
   compared in :meth:`KvIndexTier.finished` with the engine's
   ``usage.prompt_tokens_details.cached_tokens``.
8. That comparison is a drift check (:mod:`llmgw.kv.drift`): ``match``,
   ``over`` (the engine lacks blocks its own events promised) or ``under``;
   ``drift_suspect_after`` ``over`` checks of one replica within
   ``drift_window`` make its index suspect (scored by the tree, as an
   unhealthy index) and ask its owner for a resync.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import trio

from ..kv import drift as kv_drift, tokenize as kv_tokenize
from ..kv.keys import DEFAULT_KEY_FUNCTION, none_hash
from ..kv.metrics import KvMetrics
from ..kv.subscriber import DEFAULT_MAX_MESSAGE_BYTES, message_size_setting
from ..plugin import (
    Decision,
    IndexState,
    KvIndex,
    KvIndexView,
    PluginError,
    Registry,
    Replica,
    RouteRequest,
    RoutingTier,
    TierModel,
    TierServices,
    TokenizeError,
    hookimpl,
)
from .options import count, duration, flag, option_reader
from .prefix_tree import Choice, PrefixTreeTier, prefill_tokens
from .replica_tokenizer import ASKED

log = logging.getLogger(__name__)

TIER_NAME = "kv_index"
PINNED = "tokenize_pinned"  # the outcome of a decision strict_tokenize kept on the replica that tokenized the prompt
VLLM_DEFAULT_BLOCK_SIZE = 16  # vLLM's --block-size default on GPUs (and the simulator's)
SHARE_SCALE = 1 << 20  # shares in [0, 1] handed to the tree's scorers as matched / SHARE_SCALE
EXTRA_KEY_STYLE = {"vllm": "current", "content": "event"}
# Request fields with which the engine's cached tokens say nothing about its cache: with `prompt_logprobs` vLLM
# reads no cached block (it needs every prompt token's logits), `truncate_prompt_tokens` makes it hash another
# (left-truncated) prompt. Such responses are not drift checks, whatever a client sends.
NO_DRIFT_CHECK_FIELDS = ("prompt_logprobs", "truncate_prompt_tokens")
# Attempt failures after which the engine holds nothing of the request (llmgw.router.tier.RoutingTier.attempt_failed)
NEVER_TAKEN = frozenset({"connect", "tls", "closed_before_request", "capacity", "status_502", "status_503",
                         "status_504"})
TOKENIZE_CHARS_PER_TOKEN = 6  # max_tokenize_chars defaults to this x max_prompt_tokens (English: ~4 per token)
HASH_SLICE_BLOCKS = 1024  # a long prompt's blocks are hashed this many at a time, other tasks running between


@dataclass
class KvIndexOptions:
    """The tier's own ``routing_options`` (the others are the ``prefix_tree`` tier's, for scoring and fallback)."""

    tokenizer: str = "auto"
    tokenizer_path: str | None = None  # the model's tokenizer files (default: the profile's model_path)
    tokenize_timeout: float = kv_tokenize.DEFAULT_TOKENIZE_TIMEOUT
    tokenize_timeout_per_kb: float = kv_tokenize.DEFAULT_TOKENIZE_TIMEOUT_PER_KB
    tokenize_cache_tokens: int = kv_tokenize.DEFAULT_CACHE_TOKENS
    strict_tokenize: bool = False  # a prompt sent to a replica's /tokenize is routed to that replica
    key_function: str = DEFAULT_KEY_FUNCTION  # content keys: any engine hash algorithm and seed
    key_function_options: dict[str, Any] = field(default_factory=dict)
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = "0"
    extra_key_style: str | None = None  # default: "current" for vllm keys, "event" for content keys
    predicted_ttl: float = 2.0
    block_size: int | None = None  # a replica's until its own events say (KvIndexTier.assumed_block_size)
    min_match_blocks: int = 1
    max_prompt_tokens: int = 131072
    max_tokenize_chars: int | None = None  # default: TOKENIZE_CHARS_PER_TOKEN x max_prompt_tokens
    lora_adapters: dict[str, str] = field(default_factory=dict)
    drift_suspect_after: int = kv_drift.DEFAULT_SUSPECT_AFTER
    drift_window: float = kv_drift.DEFAULT_WINDOW
    drift_relapse_window: float = kv_drift.DEFAULT_RELAPSE_WINDOW
    drift_resync_retry: float = kv_drift.DEFAULT_RESYNC_RETRY
    max_event_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # ZMQ_MAXMSGSIZE of external replicas' subscriptions

    @property
    def drift_policy(self) -> kv_drift.DriftPolicy:
        return kv_drift.DriftPolicy(self.drift_suspect_after, self.drift_window, self.drift_relapse_window,
                                    self.drift_resync_retry)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> tuple["KvIndexOptions", list[str]]:
        options, problems = cls(), list[str]()

        take = option_reader(options, raw, problems,
                             ("hash_seed", "extra_key_style", "block_size", "tokenizer_path",
                              "max_tokenize_chars"))
        take("tokenizer", _name)
        take("tokenizer_path", _name)
        take("tokenize_timeout", _positive_duration)
        take("tokenize_timeout_per_kb", _non_negative_duration)
        take("tokenize_cache_tokens", count(0))
        take("strict_tokenize", flag)
        take("key_function", _name)
        take("key_function_options", _mapping)
        take("hash_algo", _name)
        take("hash_seed", str)
        take("extra_key_style", _name)
        take("predicted_ttl", _non_negative_duration)
        take("block_size", count(1))
        take("min_match_blocks", count(1))
        take("max_prompt_tokens", count(1))
        take("max_tokenize_chars", count(1))
        take("lora_adapters", _lora_map)
        take("drift_suspect_after", count(0))
        take("drift_window", _positive_duration)
        take("drift_relapse_window", _positive_duration)
        take("drift_resync_retry", _positive_duration)
        take("max_event_message_bytes", message_size_setting)
        return options, problems

    @property
    def tokenize_chars(self) -> int:
        return self.max_tokenize_chars or TOKENIZE_CHARS_PER_TOKEN * self.max_prompt_tokens


KV_KEYS = frozenset(KvIndexOptions.__dataclass_fields__)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a name, got {value!r}")
    return value


def _mapping(value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping, got {value!r}")
    return dict(value)


def _lora_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("expected a mapping of LoRA adapter name to the path the engine loaded it from")
    return dict(value)


_positive_duration = duration()
_non_negative_duration = duration(allow_zero=True)


def split_options(raw: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """``(kv_index options, prefix_tree options)`` of a model's ``routing_options``."""
    raw = dict(raw or {})
    return {k: v for k, v in raw.items() if k in KV_KEYS}, {k: v for k, v in raw.items() if k not in KV_KEYS}


@dataclass
class Fallback:
    outcome: str  # unindexable, index_unhealthy, tokenize_timeout, tokenize_error
    reason: str
    asked: Replica | None = None  # the replica whose /tokenize was sent the prompt on the way (strict_tokenize)


@dataclass
class KvEvaluation:
    """One request scored against the candidates from the index (what :meth:`KvIndexTier.explain` shows)."""

    prompt_tokens: int
    keys: dict[int, list[int]]  # block size -> keys
    block_sizes: list[int | None]
    states: list[str]
    confirmed: list[int]  # leading blocks confirmed by events (0 for replicas scored by the tree)
    matched: list[int]  # leading blocks counting predicted entries
    shares: list[float]
    sources: list[str]  # "index" or "tree" per candidate
    choice: Choice  # the prefix tier's rule applied to the shares, its reason worded for blocks
    text: str | None  # the canonical text, when the tree was consulted
    asked: Replica | None = None  # the replica whose /tokenize was sent the prompt (strict_tokenize)


class KvIndexTier(RoutingTier):
    name = TIER_NAME
    wants_usage = True  # the data plane hands finished() each response's usage (cached_tokens: the accuracy)

    def __init__(self, model: TierModel | None = None, services: TierServices | None = None):
        services = services or TierServices()
        model = model or TierModel("")
        kv_raw, tree_raw = split_options(model.routing_options)
        options, problems = KvIndexOptions.parse(kv_raw)
        self.model = services.model or model.name
        if problems:
            raise ValueError(f"routing_options of model {self.model!r}: " + "; ".join(problems))
        self.options = options
        self.clock = services.clock
        tree_model = TierModel(name=self.model, routing="prefix_tree", routing_options=tree_raw)
        self.tree = PrefixTreeTier(tree_model, services)  # the fallback, and the scorers and load rule
        self.tree.counts_in_chars = False  # the cost model's observations are mostly of exact token counts
        index = services.kv_index
        self.index: KvIndexView = index if index is not None else KvIndex(clock=self.clock)
        self.tree.stored_blocks = self.index.blocks  # the capacity charge's free KV without the usage gauge
        registry = services.registry
        self.base_models = frozenset({self.model, model.name or self.model})
        self.tokenizer = registry.get("tokenizer_sources", options.tokenizer)(
            {"tokenize_timeout": options.tokenize_timeout, "tokenize_timeout_per_kb": options.tokenize_timeout_per_kb,
             "tokenize_cache_tokens": options.tokenize_cache_tokens, "base_models": self.base_models,
             "max_ids": options.max_prompt_tokens + kv_tokenize.CUT_MARGIN_TOKENS,
             "tokenizer_path": options.tokenizer_path or _local_dir(model.model_path)})
        key_options = dict(options.key_function_options)
        if options.key_function == "vllm":
            key_options.setdefault("algo", options.hash_algo)
            key_options.setdefault("seed", options.hash_seed)
        self.keys = registry.get("block_key_functions", options.key_function)(**key_options)
        self.extra_key_style = options.extra_key_style or EXTRA_KEY_STYLE.get(options.key_function, "current")
        loras = {a.name: a.path for a in model.lora_adapters if a.name and a.path}
        loras.update(options.lora_adapters)
        self.loras = loras
        self.configured_block_size = options.block_size or block_size_arg(model.engine_args)
        self._assumed: dict[str, tuple[int, str]] = {}  # replica -> (block size, where from) while assumed
        self.metrics: KvMetrics | None = None
        if services.metrics is not None:
            self.metrics = KvMetrics.for_registry(services.metrics.registry)
            self.metrics.track_index(self.index)
            if getattr(self.tokenizer, "observe", False) is None:
                self.tokenizer.observe = self.metrics.tokenize_seconds.observe
            if getattr(self.tokenizer, "count_source", False) is None:
                counter, model_name = self.metrics.tokenize_source, self.model
                self.tokenizer.count_source = lambda source: counter.labels(model_name, source).inc()
        self._rng = self.tree.rng
        self._tokenize_turn = 0
        # what finished() saw, for tests and the admin API (the counters carry the same totals)
        self.predicted_cached_total = 0
        self.actual_cached_total = 0
        self.fallbacks: dict[str, int] = {}
        self.drift_policy = options.drift_policy

    @classmethod
    def check_options(cls, raw: Mapping[str, Any] | None, registry: Registry | None = None) -> list[str]:
        kv_raw, tree_raw = split_options(raw)
        options, problems = KvIndexOptions.parse(kv_raw)
        problems += PrefixTreeTier.check_options(tree_raw, registry)
        problems = [p.replace("routing: prefix_tree", "routing: kv_index (or prefix_tree)") for p in problems]
        try:
            if options.key_function == "vllm":
                none_hash(options.hash_algo, options.hash_seed)
            else:  # not used by content keys, but a typo is still one
                none_hash(options.hash_algo, "0")
        except (TypeError, ValueError) as exc:
            problems.append(f"hash_algo/hash_seed: {exc}")
        if registry is not None:
            for kind, name in (("tokenizer_sources", options.tokenizer),
                               ("block_key_functions", options.key_function)):
                try:
                    registry.get(kind, name)
                except PluginError as exc:
                    problems.append(str(exc))
        return problems

    # -- the tier interface ------------------------------------------------------------------------------------------

    async def pick(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        now = self.clock()
        result = await self._evaluate(request, candidates, now, self._rng)
        if isinstance(result, Fallback):
            self.fallbacks[result.outcome] = self.fallbacks.get(result.outcome, 0) + 1
            decision = await self.tree.pick(request, self._only_asked(result.asked, candidates))
            decision.detail = {**decision.detail, "tree_outcome": decision.outcome, "reason": result.reason}
            decision.outcome = result.outcome
            decision.tier = TIER_NAME
            return decision
        ev, i = result, result.choice.chosen
        chosen = candidates[i]
        text = ev.text if ev.text is not None else self.tree.prompt_text(request)
        self.tree.learn(text, chosen.name, ev.choice.outcome, now)
        self.tree.note_pick(ev.choice, now)
        detail: dict[str, Any] = {"prompt_tokens": ev.prompt_tokens, "source": ev.sources[i], "share": ev.shares[i]}
        self.tree.note_cost(detail, ev.choice, i, candidates)
        size = ev.block_sizes[i]
        if ev.sources[i] == "index" and size:
            keys = ev.keys[size]
            if self.options.predicted_ttl > 0:
                detail["prediction"] = self.index.predict(chosen.name, keys, self.options.predicted_ttl)
            reads_cache = request.body.get("prompt_logprobs") is None
            detail.update(block_size=size, blocks=len(keys), matched_blocks=ev.matched[i],
                          confirmed_blocks=ev.confirmed[i],
                          predicted_cached_tokens=predicted_cached_tokens(ev.matched[i], size, ev.prompt_tokens)
                          if reads_cache else 0,
                          drift_check=not any(request.body.get(f) is not None for f in NO_DRIFT_CHECK_FIELDS),
                          block_keys=keys, index_epoch=self.index.epoch(chosen.name))
        return Decision(chosen, outcome=ev.choice.outcome, tier=TIER_NAME, detail=detail,
                        prefill_tokens=prefill_tokens(detail))

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        """Queue its prefill in the cost model (pick() already recorded the predicted entries and the tree insert,
        for concurrent requests)."""
        self.tree.routed(request, decision)

    def first_token(self, request: RouteRequest, decision: Decision, ttft: float) -> None:
        self.tree.first_token(request, decision, ttft)

    def attempt_failed(self, request: RouteRequest, decision: Decision, reason: str) -> None:
        """An attempt the engine never took (or refused) stores nothing: its predicted entries go at once."""
        if reason in NEVER_TAKEN:
            self.index.unpredict(decision.detail.get("prediction"))

    def finished(self, request: RouteRequest, decision: Decision, usage: dict | None) -> None:
        """Count predicted next to actual cached tokens, for decisions the index made and responses with usage."""
        self.tree.finished(request, decision, usage)
        if decision.tier != TIER_NAME or not isinstance(usage, dict):
            return
        predicted = decision.detail.get("predicted_cached_tokens")
        if predicted is None:
            return
        details = usage.get("prompt_tokens_details")
        actual = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(actual) is not int:
            return
        if actual >= predicted:  # every predicted block was a hit: none of them is stored again
            self.index.settle(decision.detail.get("prediction"))
        self.predicted_cached_total += predicted
        self.actual_cached_total += actual
        if self.metrics is not None:
            self.metrics.predicted_cached.labels(self.model).inc(predicted)
            self.metrics.actual_cached.labels(self.model).inc(actual)
        if decision.detail["drift_check"]:
            self._check_drift(decision, predicted, actual)

    def _check_drift(self, decision: Decision, predicted: int, actual: int) -> None:
        """Classify the response (:func:`llmgw.kv.drift.classify`), count it, and tell the index."""
        detail, name = decision.detail, decision.replica.name
        size, prompt_tokens, run = detail["block_size"], detail["prompt_tokens"], detail["confirmed_blocks"]
        confirmed = predicted_cached_tokens(run, size, prompt_tokens)
        result = kv_drift.classify(actual, confirmed, max(predicted, confirmed), size)
        if result == kv_drift.OVER:
            # Confirmed blocks: the smaller of the run at the decision and the run now (an eviction whose removal
            # landed meanwhile explains the shortfall); the walk stops at the decision's run.
            run = self.index.match(detail["block_keys"][:run], [name], predicted=False)[name]
            confirmed = predicted_cached_tokens(run, size, prompt_tokens)
            result = kv_drift.classify(actual, confirmed, max(predicted, confirmed), size)
        if self.metrics is not None:
            self.metrics.drift_checks.labels(self.model, name, result).inc()
            if result != kv_drift.MATCH:
                self.metrics.drift.labels(self.model, name, result).inc()
                self.metrics.drift_tokens.labels(self.model, name, result).inc(
                    confirmed - actual if result == kv_drift.OVER else actual - predicted)
        self.index.observe(name, result, epoch=detail["index_epoch"], policy=self.drift_policy)

    async def explain(self, request: RouteRequest, candidates: Sequence[Replica]) -> dict:
        """The pick :meth:`pick` would make now, with every score; changes no routing state (it may tokenize)."""
        rng = random.Random()
        rng.setstate(self._rng.getstate())
        now = self.clock()
        result = await self._evaluate(request, candidates, now, rng)
        if isinstance(result, Fallback):
            answer = self.tree.explain(request, self._only_asked(result.asked, candidates))
            answer["tree_outcome"] = answer.get("outcome")
            answer.update(outcome=result.outcome, reason=result.reason, tier=TIER_NAME)
            for entry in answer.get("replicas", []):
                entry["index"] = self.index.describe(entry["name"])
            return answer
        ev, c = result, result.choice
        own_sizes = [self.index.block_size(r.name) for r in candidates]
        replicas = []
        for i, replica in enumerate(candidates):
            replicas.append({
                "name": replica.name, "candidate": True, "index": self.index.describe(replica.name),
                "source": ev.sources[i], "block_size": ev.block_sizes[i],
                "block_size_from": self._block_size_from(replica, own_sizes),
                "confirmed_blocks": ev.confirmed[i],
                "matched_blocks": ev.matched[i], "share": ev.shares[i], "load": c.loads[i],
                **self.tree.explain_cost(c, i, replica.name),
            })
        return {
            "pick": candidates[c.chosen].name, "outcome": c.outcome, "reason": c.reason,
            "preferred": candidates[c.preferred].name, "prompt_tokens": ev.prompt_tokens,
            "blocks": {str(size): len(keys) for size, keys in ev.keys.items()},
            "rule": {**self.tree.explain_rule(), "min_match_blocks": self.options.min_match_blocks},
            "replicas": replicas,
        }

    # -- the rule ----------------------------------------------------------------------------------------------------

    def block_sizes(self, candidates: Sequence[Replica], healthy: Sequence[bool]) -> list[int | None]:
        """Each healthy candidate's block size: its own events', else :meth:`assumed_block_size` (so that a fresh
        engine, whose first FULL copy is empty and sizeless, gets predicted entries from its first request)."""
        own = [self.index.block_size(r.name) if ok else None for r, ok in zip(candidates, healthy)]
        if self._assumed:
            self._check_assumed(candidates, own)
        if all(size or not ok for size, ok in zip(own, healthy)):
            return own
        sizes = []
        for replica, size, ok in zip(candidates, own, healthy):
            if not size and ok:
                self._assumed[replica.name] = assumed = self.assumed_block_size(replica, own)
                size = assumed[0]
            sizes.append(size)
        return sizes

    def _check_assumed(self, candidates: Sequence[Replica], own: Sequence[int | None]) -> None:
        """Once a replica's events say its block size, say so if it was assumed otherwise (its predictions were
        keyed for the wrong size until then)."""
        for replica, size in zip(candidates, own):
            assumed = self._assumed.get(replica.name) if size else None
            if assumed is not None:
                del self._assumed[replica.name]
                if assumed[0] != size:
                    log.warning("replica %s of model %r reports KV blocks of %d tokens; %d was assumed (%s) until "
                                "its first event, so its first requests could not co-locate: set routing_options "
                                "block_size: %d", replica.name, self.model, size, assumed[0], assumed[1], size)

    def _block_size_from(self, replica: Replica, sizes: Sequence[int | None]) -> str | None:
        if self.index.block_size(replica.name):
            return "events"
        return self.assumed_block_size(replica, sizes)[1] if self.index.healthy(replica.name) else None

    def assumed_block_size(self, replica: Replica, known: Sequence[int | None] = ()) -> tuple[int, str]:
        """``(block size, where from)`` of a replica whose events have not said yet: the ``block_size`` option or
        the profile's ``--block-size``, the engine's reported ``vllm:cache_config_info``, the most common size of
        the model's other replicas, else vLLM's default."""
        if self.configured_block_size:
            return self.configured_block_size, "config"
        engine = replica.engine_load
        if engine is not None and engine.block_size:
            return engine.block_size, "engine"
        peers = [size for size in known if size]
        if peers:
            return max(set(peers), key=peers.count), "peers"
        return VLLM_DEFAULT_BLOCK_SIZE, "default"

    def _tokenize_replica(self, request: RouteRequest, candidates: Sequence[Replica], now: float) -> Replica:
        """The candidate the request most likely goes to: the one holding the longest match of it in the tree
        (which learns every decision), else the least loaded (the tier spreads a prompt no one holds by load);
        equals in turn. Never a replica the request could not be routed to."""
        held = self.tree.matches(self.tree.prompt_text(request), candidates, now)
        longest = max(held)
        if longest:
            pool = [r for r, m in zip(candidates, held) if m == longest]
        else:
            least = min(r.inflight for r in candidates)
            pool = [r for r in candidates if r.inflight == least]
        replica = pool[self._tokenize_turn % len(pool)]
        self._tokenize_turn += 1
        return replica

    async def _prompt_ids(self, plan: kv_tokenize.Plan, request: RouteRequest, candidates: Sequence[Replica],
                          now: float) -> tuple[Sequence[int], int, Replica | None] | Fallback:
        """The ids routing hashes (at most ``max_prompt_tokens``, those of a cut prompt that equal the whole
        prompt's) and the prompt's length in tokens (estimated when not all of it was tokenized)."""
        limit = self.options.max_prompt_tokens
        if plan.token_ids is not None:
            return plan.token_ids[:limit], len(plan.token_ids), None
        target = self._tokenize_replica(request, candidates, now)
        ASKED.set(None)
        try:
            ids = await self.tokenizer.tokenize(target, plan.body)
        except TokenizeError as exc:
            return Fallback("tokenize_timeout" if exc.kind == "timeout" else "tokenize_error", str(exc),
                            self._asked(target))
        asked = self._asked(target)
        got = len(ids)
        if not plan.cut_chars:
            return ids[:limit], got, asked  # at least: an answer is read up to the limit (and the margin)
        usable = min(limit, got - kv_tokenize.CUT_MARGIN_TOKENS)
        # At least the ids per character of what was tokenized (fewer ids were read than the cut body has when
        # the answer hit the limit), over the whole prompt.
        return ids[:max(usable, 0)], max(got, _scaled(got, plan.prompt_chars, plan.cut_chars)), asked

    def _asked(self, target: Replica) -> Replica | None:
        """Under ``strict_tokenize``, the replica this task's tokenize call sent the prompt to: ``target`` when the
        built-in sources say they called its ``/tokenize`` (not when they answered from the router's tokenizer or
        cache), and always for a source that does not say (a third party's). None otherwise."""
        if not self.options.strict_tokenize:
            return None
        if not getattr(self.tokenizer, "reports_asked", False):
            return target
        return target if ASKED.get() is not None else None

    @staticmethod
    def _only_asked(asked: Replica | None, candidates: Sequence[Replica]) -> Sequence[Replica]:
        """The candidates a fallback decides among: only the replica that saw the prompt, under
        ``strict_tokenize``."""
        return [asked] if asked is not None and asked in candidates else candidates

    async def _block_keys(self, tokens: Sequence[int], block_size: int, extras) -> list[int]:
        """The block keys of ``tokens``; a long prompt's in slices of ``HASH_SLICE_BLOCKS`` blocks with a
        checkpoint between them (for key functions that can continue a chain: ``keys_after``)."""
        after = getattr(self.keys, "keys_after", None)
        step = HASH_SLICE_BLOCKS * block_size
        if after is None or len(tokens) <= step:
            return self.keys.keys(tokens, block_size, extras)
        keys: list[int] = []
        parent = None
        for start in range(0, len(tokens) - len(tokens) % block_size, step):
            first = start // block_size
            more, parent = after(tokens[start:start + step], block_size,
                                 None if extras is None else extras[first:first + HASH_SLICE_BLOCKS], parent=parent)
            keys += more
            await trio.lowlevel.checkpoint()
        return keys

    async def _evaluate(self, request: RouteRequest, candidates: Sequence[Replica], now: float,
                        rng: random.Random) -> KvEvaluation | Fallback:
        plan = kv_tokenize.plan(request.path, request.body, base_models=self.base_models, loras=self.loras,
                                max_chars=self.options.tokenize_chars)
        if not plan.indexable:
            return Fallback("unindexable", plan.reason)
        index = self.index
        states = [index.state(r.name) for r in candidates]
        if IndexState.HEALTHY not in states:
            return Fallback("index_unhealthy", "no candidate's KV index is healthy: "
                            + ", ".join(f"{r.name}={s.value}" for r, s in zip(candidates, states)))
        ids = await self._prompt_ids(plan, request, candidates, now)
        if isinstance(ids, Fallback):
            return ids
        tokens, prompt_tokens, asked = ids

        healthy = [s is IndexState.HEALTHY for s in states]
        sizes = self.block_sizes(candidates, healthy)
        keys: dict[int, list[int]] = {}
        runs: dict[str, tuple[int, int]] = {}
        for block_size in {s for s in sizes if s}:
            extras = plan.extra_keys(len(tokens), block_size, style=self.extra_key_style)
            keys[block_size] = await self._block_keys(tokens, block_size, extras)
            names = [r.name for r, s in zip(candidates, sizes) if s == block_size]
            runs.update(index.match_detail(keys[block_size], names))

        floor = self.options.min_match_blocks
        text = None
        tree_held = [0] * len(candidates)
        if not all(healthy):  # some candidates are scored by the tree for this decision
            text = self.tree.prompt_text(request)
            tree_held = self.tree.matches(text, candidates, now)
        confirmed, matched, shares, sources = [], [], [], []
        for replica, ok, size, held in zip(candidates, healthy, sizes, tree_held):
            if ok:
                total = len(keys.get(size, ())) if size else 0
                run_confirmed, run = runs.get(replica.name, (0, 0))
                run = run if run >= floor else 0
                confirmed.append(run_confirmed)
                matched.append(run)
                shares.append(run / total if total else 0.0)
                sources.append("index")
            else:
                confirmed.append(0)
                matched.append(0)
                shares.append(held / len(text) if text else 0.0)
                sources.append("tree")
        cached = [predicted_cached_tokens(run, size, prompt_tokens) if source == "index" and size
                  else int(share * prompt_tokens) for run, size, source, share in zip(matched, sizes, sources, shares)]
        choice = _decide(self.tree, request, candidates, shares, now, rng, prompt_tokens, cached)
        if asked is not None and candidates[choice.chosen] is not asked and asked in candidates:
            pinned = candidates.index(asked)
            choice = dataclasses.replace(choice, chosen=pinned, outcome=PINNED, reason=(
                f"strict_tokenize: its /tokenize went to {asked.name}, so it goes there (the index preferred "
                f"{candidates[choice.chosen].name})"))
        return KvEvaluation(prompt_tokens, keys, sizes, [s.value for s in states], confirmed, matched, shares,
                            sources, choice, text, asked)


def _decide(tree: PrefixTreeTier, request: RouteRequest, candidates: Sequence[Replica], shares: list[float],
            now: float, rng: random.Random, prompt_tokens: int, cached_tokens: list[int]) -> Choice:
    """The prefix tier's scorers and load rule (:meth:`PrefixTreeTier.decide`) applied to ``shares``.

    The prefix share reaches the tree's scorers as ``matched_chars / prompt_chars`` =
    ``round(share * SHARE_SCALE) / SHARE_SCALE``, so the ``prefix`` scorer rates a
    candidate by its share, and every other scorer (``load``, third-party ones)
    sees the same loads and in-flight tokens as under ``prefix_tree``. The cost model gets the exact
    ``prompt_tokens`` and each candidate's ``cached_tokens``.
    """
    matched = [round(share * SHARE_SCALE) for share in shares]
    c = tree.decide(request, candidates, prompt_units=SHARE_SCALE, matched=matched, now=now, rng=rng,
                    prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
    if not c.reason:
        longest = c.outcome == "hit" and matched[c.chosen] == max(matched)
        c.reason = ("holds the longest leading run of blocks" if longest
                    else "best combined score" if c.outcome == "hit"
                    else "no candidate holds a leading block of the prompt: spread by load")
    return c


def _scaled(ids: int, prompt_chars: int, chars: int) -> int:
    """``ids`` for ``chars`` characters, scaled to ``prompt_chars``."""
    return ids * prompt_chars // chars if chars else ids


def _local_dir(path) -> str | None:
    """``path`` when it is a directory on this machine (a profile's ``model_path`` may name a hub id instead)."""
    return path if isinstance(path, str) and path and os.path.isdir(path) else None


def block_size_arg(args) -> int | None:
    """The ``--block-size`` an engine's command line sets (``--block-size N`` or ``--block-size=N``), or None."""
    if not isinstance(args, (list, tuple)):
        return None
    for i, arg in enumerate(args):
        value = None
        if arg == "--block-size" and i + 1 < len(args):
            value = args[i + 1]
        elif isinstance(arg, str) and arg.startswith("--block-size="):
            value = arg.partition("=")[2]
        if isinstance(value, str) and value.isdigit() and 0 < int(value) <= 1 << 16:
            return int(value)
    return None


predicted_cached_tokens = kv_drift.cached_tokens  # the leading run, capped so the last prompt token is computed


@hookimpl
def register_routing_tiers():
    return {TIER_NAME: KvIndexTier}
