"""The ``prefix_tree`` routing tier: send a request where its prefix probably is, unless that replica is overloaded.

Per model, an approximate radix tree (:mod:`llmgw.router.radix`) of the
canonical text of what was routed where, learnt from the tier's own
decisions (no engine help). Per request (the rule, also in
``docs/routing.md``):

1. Each candidate's *match* is the characters of the request's canonical text
   it holds in the tree; a match shorter than ``min_match_chars`` counts as 0.
2. ``rule: cost`` (the default): each candidate's estimated time to first
   token (:mod:`llmgw.router.cost`: its uncached prompt tokens (characters
   at the tokens per character the engines' usage showed:
   :mod:`llmgw.router.token_ratio`) and the prefill
   queued on it over its learnt throughput, plus its step time and a learnt
   cost per request in flight) plus the delay its prefill adds to the requests
   in flight there (``cost_others_weight``) and, weighed by
   ``cost_decode_weight`` (1 by default), the decode and KV-capacity charges
   of its decode there (:mod:`llmgw.router.decode_cost`), and the smallest wins; an estimate within 5 %,
   2 ms or half the observed noise (the noisier of its replica's and the
   smallest's) of the smallest ties. ``rule: scores``: each scorer named in
   ``scorers`` rates each candidate in [0, 1], the combined score is their
   weighted sum (default ``prefix: 1.0, load: 0.5``), and the highest wins.
3. Ties go to the longer match (rule ``cost``), the lower load, then fewer
   in-flight prompt tokens, then the one least recently given a request it
   held nothing of, then at random (never "the first").
4. *Load guard* (off by default under ``rule: cost``; ``max_imbalance: 4``
   under ``rule: scores``): if sending it to the chosen replica would put it
   more than ``max_imbalance`` in-flight requests above the least loaded
   candidate (or, with ``load_sigma_k`` set, its load exceeds mean + k·σ of
   the candidates'), the request goes to the least loaded candidate instead
   (same tie-breaks): outcome ``load_override``.
5. Otherwise: outcome ``hit`` when the chosen replica holds a match, ``miss``
   when not, and under ``rule: cost`` ``cost_override`` when it holds less
   than the longest match (that replica's queue made it slower).

The chosen replica is inserted into the tree at once, so concurrent requests
that share a new prefix find it. *Load* is the router's in-flight requests
to the replica, or the engine's running + waiting requests when
``engine_metrics_interval`` is set and its last scrape is fresh and higher.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import random
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Mapping, Sequence

from ..plugin import (
    Decision,
    PluginError,
    Registry,
    Replica,
    RouteRequest,
    RoutingTier,
    ScoreContext,
    TierModel,
    TierServices,
    hookimpl,
)
from ..plugins_manager import default_registry
from ..router import cost as cost_model, deal as new_prefixes, decode_cost, kv_capacity
from ..router.canonical import canonical_text
from ..router.decode_metrics import track_decode
from ..router.radix import RadixTree
from ..router.token_ratio import TokensPerChar
from ..router.tree_metrics import track_tree
from ..router.uncertainty import OVERRIDE_SIGMAS, Uncertainty, certainly_costlier, override_pays
from .options import MAX_NUMBER, count, duration, flag, option_reader
from .scorers import register_scorers

# register_scorers is re-exported so that pluggy finds the built-in scorers' hook on this plugin module.
__all__ = ["Choice", "PrefixTreeOptions", "PrefixTreeTier", "register_routing_tiers", "register_scorers"]

log = logging.getLogger(__name__)

TIER_NAME = "prefix_tree"


@dataclass
class PrefixTreeOptions:
    """The tier's ``routing_options``, with their defaults (units in the names or the docs)."""

    rule: str = "cost"  # "cost": the smallest estimated time to first token; "scores": the weighted scorers
    scorers: dict[str, float] = field(default_factory=lambda: {"prefix": 1.0, "load": 0.5})
    min_match_chars: int = 256
    max_imbalance: float | None = None  # default: off under rule "cost", 4 under rule "scores"
    load_sigma_k: float | None = None
    load_token_scale: int = 8192
    tree_chars_per_replica: int = 2_000_000
    tree_nodes_per_replica: int = 100_000
    tree_ttl: float = 600.0
    max_prefix_chars: int = 200_000
    engine_metrics_interval: float | None = None
    engine_metrics_timeout: float | None = None  # default: the interval, at most 1 s
    engine_metrics_max_age: float | None = None  # default: 3 intervals
    seed: int | None = None
    cost_prefill_tokens_per_s: float = cost_model.DEFAULT_PRIOR_THROUGHPUT
    cost_step_time: float = cost_model.DEFAULT_PRIOR_STEP
    cost_decay: float = cost_model.DEFAULT_DECAY
    cost_others_weight: float = cost_model.DEFAULT_OTHERS_WEIGHT
    cost_override_sigmas: float = OVERRIDE_SIGMAS  # an override's gain must exceed this many standard errors; 0: off
    new_prefixes: str = "deal"  # "deal": to the affordable replica holding the least; "cheapest": by cost alone
    deal_load_margin: float | None = 0.0  # the deal skips replicas running more than this above the least; None: off
    cost_decode_weight: float = decode_cost.DEFAULT_DECODE_WEIGHT
    cost_decode_source: str = decode_cost.DEFAULT_SOURCE  # the ITL line: the engines' (else the prior), or observed
    cost_output_tokens: float = decode_cost.DEFAULT_OUTPUT_TOKENS
    cost_itl_per_sequence: float = decode_cost.DEFAULT_ITL_PER_SEQUENCE  # s: the prior ITL line's slopes, until
    cost_itl_per_context_token: float = decode_cost.DEFAULT_ITL_PER_CONTEXT_TOKEN  # streams or engines tell theirs
    cost_engine_prefill: bool = False  # the engines' reported prefill rates (scraped /metrics) as the slopes' priors
    cost_configured_prefill: bool = True  # the replicas' configured prefill_tokens_per_s, before their engines report
    learn_tokens_per_char: bool = True  # count tokens with the ratio the engines' usage shows; false: characters / 4

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None, scorer_keys: AbstractSet[str] = frozenset()
              ) -> tuple["PrefixTreeOptions", list[str], list[str]]:
        """``(options, problems, unknown keys)``; a key with a problem keeps its default.

        ``scorer_keys`` are the keys the configured scorers declare (``option_keys``): not unknown.
        """
        options, problems = cls(), list[str]()
        raw = dict(raw or {})
        known = set(cls.__dataclass_fields__) | set(scorer_keys)
        unknown = sorted(k for k in raw if k not in known)

        take = option_reader(options, raw, problems, _NULLABLE)
        take("rule", _rule)
        take("scorers", _weights)
        take("min_match_chars", count(0))
        take("max_imbalance", _positive_number)
        take("load_sigma_k", _positive_number)
        take("load_token_scale", count(1))
        take("tree_chars_per_replica", count(1))
        take("tree_nodes_per_replica", count(1))
        take("tree_ttl", _positive_duration)
        take("max_prefix_chars", count(1))
        take("engine_metrics_interval", _positive_duration)
        take("engine_metrics_timeout", _positive_duration)
        take("engine_metrics_max_age", _positive_duration)
        take("seed", count(0, 2**64 - 1))
        take("cost_prefill_tokens_per_s", _positive_number)
        take("cost_step_time", _non_negative_duration)
        take("cost_decay", _fraction)
        take("cost_others_weight", _non_negative_number)
        take("cost_override_sigmas", _non_negative_number)
        take("new_prefixes", _new_prefixes)
        take("deal_load_margin", _non_negative_number)
        take("cost_decode_weight", _non_negative_number)
        take("cost_decode_source", _decode_source)
        take("cost_output_tokens", _positive_number)
        take("cost_itl_per_sequence", _non_negative_number)
        take("cost_itl_per_context_token", _non_negative_number)
        take("cost_engine_prefill", flag)
        take("cost_configured_prefill", flag)
        take("learn_tokens_per_char", flag)
        if "rule" not in raw and "scorers" in raw:  # naming scorers asks for them
            options.rule = "scores"
        if "max_imbalance" not in raw and options.rule == "scores":
            options.max_imbalance = DEFAULT_SCORES_MAX_IMBALANCE
        if options.engine_metrics_interval is not None:
            if options.engine_metrics_timeout is None:
                options.engine_metrics_timeout = min(options.engine_metrics_interval, 1.0)
            if options.engine_metrics_max_age is None:
                options.engine_metrics_max_age = 3 * options.engine_metrics_interval
        return options, problems, unknown


RULES = ("cost", "scores")
NEW_PREFIXES = ("deal", "cheapest")  # how rule "cost" places a prompt no candidate holds (docs/routing.md)
DEFAULT_SCORES_MAX_IMBALANCE = 4
SHARED_ROUTE = "route"  # what a cluster's tiers share: a routed prefix and its replica...
SHARED_TTFT = "ttft"  # ... and an observed time to first token: [engine id, replica, tokens, requests, seconds]
SHARED_TEXT_CHARS = 16_384  # a routed prefix is shared up to this many characters (~4k tokens: Redis traffic)
COST_TIE_FRACTION = 0.05  # estimated TTFTs within 5% (or 2 ms) of the smallest tie
COST_TIE_SECONDS = 0.002
COST_TIE_NOISE = 0.5  # ... or half the noise of the observed TTFTs around the fits (the noisier of the two replicas')
RESCALE_AT = 0.02  # the cost model's observations are recounted when the tokens per character move by more
_NULLABLE = {"max_imbalance", "load_sigma_k", "engine_metrics_interval", "seed", "deal_load_margin"}


def _positive_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"expected a number > 0 (or null to turn it off), got {value!r}")
    if value > MAX_NUMBER:
        raise ValueError(f"must be at most {MAX_NUMBER:g}, got {value!r}")
    return value


def _non_negative_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_NUMBER \
            or not math.isfinite(value):
        raise ValueError(f"expected a number from 0 to {MAX_NUMBER:g}, got {value!r}")
    return float(value)


_positive_duration = duration()
_non_negative_duration = duration(allow_zero=True)


def _rule(value: Any) -> str:
    if value not in RULES:
        raise ValueError(f"expected one of {', '.join(RULES)}, got {value!r}")
    return value


def _new_prefixes(value: Any) -> str:
    if value not in NEW_PREFIXES:
        raise ValueError(f"expected one of {', '.join(NEW_PREFIXES)}, got {value!r}")
    return value


def _decode_source(value: Any) -> str:
    if value not in decode_cost.SOURCES:
        raise ValueError(f"expected one of {', '.join(decode_cost.SOURCES)}, got {value!r}")
    return value


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"expected a number in (0, 1], got {value!r}")
    return float(value)


def _weights(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping) or not value:
        raise ValueError("expected a mapping of scorer name to weight, e.g. {prefix: 1.0, load: 0.5}")
    weights = {}
    for name, weight in value.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0 \
                or not math.isfinite(weight):
            raise ValueError(f"the weight of scorer {name!r} must be a number >= 0, got {weight!r}")
        weights[str(name)] = float(weight)
    return weights


@dataclass
class Choice:
    """The tier's rule applied to one request's matches (:meth:`PrefixTreeTier.decide`), aligned with the candidates.

    ``reason`` says why the load guard overrode the preferred replica (outcome
    ``load_override``), and is '' for ``hit`` and ``miss``: a caller words those.
    """

    matched: list[int]
    loads: list[float]
    tokens: list[int]
    scores: dict[str, Sequence[float]]
    combined: list[float]
    preferred: int
    chosen: int
    outcome: str
    reason: str
    estimates: list[cost_model.Estimate] | None = None  # under rule "cost", per candidate
    uncertainties: list[float] | None = None  # under rule "cost": each estimate's standard error (s)
    gated: bool = False  # an override the uncertainty gate refused: the request stays on the holder
    deal: new_prefixes.Deal | None = None  # under rule "cost", a prompt no candidate holds: how it was dealt out
    charges: list[decode_cost.DecodeCharge] | None = None  # under rule "cost", per candidate
    moved_by: str = ""  # "decode" or "capacity" when those charges moved the pick off the smallest estimate

    def total_cost(self, i: int) -> float:
        """Candidate ``i``'s estimated cost with its decode and capacity charges: what the rule compares."""
        assert self.estimates is not None  # under rule "cost"
        return self.estimates[i].cost + (self.charges[i].total if self.charges is not None else 0.0)


@dataclass
class Evaluation(Choice):
    """One request scored against the candidates (what :meth:`PrefixTreeTier.explain` shows); ``reason`` is
    always worded."""

    text: str = ""


class PrefixTreeTier(RoutingTier):
    name = TIER_NAME

    def __init__(self, model: TierModel | None = None, services: TierServices | None = None):
        services = services or TierServices()
        registry = services.registry
        raw = model.routing_options if model is not None else {}
        self.model = services.model or (model.name if model is not None else "")
        options, problems, _ = PrefixTreeOptions.parse(raw)
        if problems:
            raise ValueError(f"routing_options of model {self.model!r}: " + "; ".join(problems))
        factories = {name: registry.get("scorers", name) for name in options.scorers}
        unknown = PrefixTreeOptions.parse(raw, _declared_keys(factories.values()))[2]
        if unknown:
            log.warning("model %r: prefix_tree ignores unknown routing_options %s", self.model, ", ".join(unknown))
        self.options = options
        self.clock = services.clock
        self.tree = RadixTree(options.tree_chars_per_replica, options.tree_nodes_per_replica, options.tree_ttl)
        self.scorers = [(name, weight, factories[name](raw)) for name, weight in options.scorers.items()]
        self.engine_metrics_interval = options.engine_metrics_interval  # read by the gateway to start a scraper
        self.engine_metrics_timeout = options.engine_metrics_timeout
        self.rng = random.Random(options.seed)  # shared with a kv_index tier built on this one
        self._cold_serial = 0
        self._last_cold: dict[str, int] = {}  # replica -> serial of the last request it got without holding a match
        self.cost = cost_model.CostModel(  # shared with a kv_index tier built on this one
            options.cost_prefill_tokens_per_s, options.cost_step_time, options.cost_decay, options.cost_others_weight,
            options.cost_engine_prefill, options.cost_configured_prefill)
        self.uncertainty = Uncertainty(self.cost)
        self.tokens_per_char = TokensPerChar()  # learnt from responses' usage unless learn_tokens_per_char is false
        self.wants_usage = options.learn_tokens_per_char  # the data plane hands finished() each response's usage
        self.counts_in_chars = True  # its estimates count tokens from characters (not under kv_index: exact ids)
        self.stored_blocks: kv_capacity.StoredBlocks | None = None  # a KV index's block counts (kv_index sets it)
        self._fit_ratio = self.tokens_per_char.ratio  # the tokens per character the cost model's data are counted in
        self.deals = new_prefixes.DealCounts()
        # in a cluster, what this gateway's own routes added to the tree, the prefill they queued, how many: just now
        self.recent_chars, self.recent_tokens = new_prefixes.RecentGrowth(), new_prefixes.RecentGrowth()
        self.recent_routes = new_prefixes.RecentGrowth()
        self.decode = decode_cost.DecodeModel(options.cost_output_tokens, options.cost_decode_weight,
                                              options.cost_decay, options.cost_decode_source,
                                              options.cost_itl_per_sequence, options.cost_itl_per_context_token)
        if services.metrics is not None:
            track_tree(services.metrics.registry, self.model, self.tree, self.uncertainty, self.deals, self.cost,
                       self.tokens_per_char)
            track_decode(services.metrics.registry, self.model, self.decode)
        self.learning = services.learning  # the other gateways' tiers of this model, in a cluster
        if self.learning is not None:
            self.learning.subscribe(SHARED_ROUTE, self._learn_shared_route)
            self.learning.subscribe(SHARED_TTFT, self._learn_shared_ttft)

    @classmethod
    def check_options(cls, raw: Mapping[str, Any] | None, registry: Registry | None = None) -> list[str]:
        """Problems with ``routing_options`` for this tier (used by ``llmgw config check`` and ``serve``)."""
        registry = registry or default_registry()
        options, problems, _ = PrefixTreeOptions.parse(raw)
        factories = []
        for name in options.scorers:
            try:
                factories.append(registry.get("scorers", name))
            except PluginError as exc:
                problems.append(f"scorers: {exc}")
        known = set(PrefixTreeOptions.__dataclass_fields__) | _declared_keys(factories)
        for key in PrefixTreeOptions.parse(raw, known)[2]:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"unknown key {key!r} for routing: prefix_tree ({hint}see docs/routing.md)")
        return problems

    # -- the tier interface ------------------------------------------------------------------------------------------

    async def pick(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        now = self.clock()
        evaluation = self._evaluate(request, candidates, now, self.rng)
        chosen = candidates[evaluation.chosen]
        self.learn(evaluation.text, chosen.name, evaluation.outcome, now)
        self.note_pick(evaluation, now)
        detail: dict[str, Any] = {"matched_chars": evaluation.matched[evaluation.chosen],
                                  "prompt_chars": len(evaluation.text)}
        self.note_cost(detail, evaluation, evaluation.chosen, candidates)
        if self.counts_in_chars and "cost" in detail:  # the ratio its tokens were counted at (first_token)
            detail["cost"]["tokens_per_char"] = self.tokens_per_char.ratio
        return Decision(chosen, outcome=evaluation.outcome, tier=TIER_NAME, detail=detail,
                        prefill_tokens=prefill_tokens(detail))

    def note_pick(self, choice: Choice, now: float) -> None:
        """At a pick (never in explain): count a new prefix dealt out (``llmgw_routing_new_prefixes_total``), an
        override the gate refused (``llmgw_cost_overrides_gated_total``) and a pick the decode or capacity charge
        moved (``llmgw_routing_decode_moves_total``), and in a cluster the prefill it queued, which the other
        gateways have not heard of yet."""
        if choice.gated:
            self.uncertainty.gated += 1
        if choice.moved_by:
            self.decode.moved[choice.moved_by] += 1
        if self.learning is not None and choice.estimates is not None:
            self.recent_tokens.add(now, choice.estimates[choice.chosen].new_tokens)
            self.recent_routes.add(now, 1)
        if choice.deal is not None:
            self.deals.count(new_prefixes.DEALT if choice.chosen not in choice.deal.cheapest
                             else new_prefixes.CHEAPEST)

    @staticmethod
    def note_cost(detail: dict, choice: Choice, chosen: int, candidates: Sequence[Replica]) -> None:
        """Put the chosen candidate's estimate in a decision's ``detail["cost"]`` (under rule ``cost``): the
        bookkeeping of :meth:`routed`, :meth:`first_token` and :meth:`finished` reads it; with the preferred
        replica's estimate when it was left, every candidate's in ``detail["estimates"]`` (for
        ``/admin/decisions`` and the routing benchmark's calibration), and the decode and capacity charges."""
        if choice.estimates is not None:
            e = choice.estimates[chosen]
            detail["cost"] = cost = {"new_tokens": e.new_tokens, "queued_tokens": e.queued_tokens,
                                     "requests": e.requests, "estimated_ttft_s": round(e.ttft, 4)}
            if choice.uncertainties is not None:
                cost["uncertainty_s"] = round(choice.uncertainties[chosen], 4)
            if choice.preferred != chosen:
                p = choice.estimates[choice.preferred]
                cost["preferred_estimated_ttft_s"] = round(p.ttft, 4)
                cost["expected_gain_s"] = round(choice.total_cost(choice.preferred) - choice.total_cost(chosen), 4)
                if choice.uncertainties is not None:
                    cost["gain_uncertainty_s"] = round(math.hypot(choice.uncertainties[choice.preferred],
                                                                  choice.uncertainties[chosen]), 4)
            detail["estimates"] = {r.name: round(x.ttft, 4) for r, x in zip(candidates, choice.estimates)}
            if choice.charges is not None:
                c = choice.charges[chosen]
                cost.update(decode_charge_s=round(c.decode, 4), capacity_charge_s=round(c.capacity, 4))

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        """The request's prefill is queued on the replica (the router counts ``prefill_tokens`` there; the tree
        learnt the decision in pick() already, so concurrent requests with a new prefix find it)."""
        cost = decision.detail.get("cost")
        if cost is not None:
            self.cost.routed(decision.replica.name, cost)
            self.decode.routed(decision.replica.name, id(decision), decision.inflight_tokens, self.clock())

    def first_token(self, request: RouteRequest, decision: Decision, ttft: float) -> None:
        """Its prefill is done: off the replica's queue, and one observation of the replica's speed (shared with
        the other gateways of a cluster, for the same engine)."""
        cost = decision.detail.get("cost")
        if cost is not None:
            self.decode.first_token(id(decision), decision.stream, self.clock())
            counted_at = cost.pop("tokens_per_char", None)
            if counted_at and counted_at != self._fit_ratio:  # counted before the ratio moved: in today's count
                for key in ("new_tokens", "queued_tokens"):
                    cost[key] = round(cost.get(key, 0) * self._fit_ratio / counted_at)
            observed = self.cost.started(decision.replica.name, cost, ttft)
            if observed is not None and self.learning is not None:
                self.learning.publish(SHARED_TTFT, [decision.replica.engine_id, decision.replica.name, *observed])

    def finished(self, request: RouteRequest, decision: Decision, usage: dict | None) -> None:
        if self.options.learn_tokens_per_char and isinstance(usage, dict):
            self.tokens_per_char.observe(len(canonical_text(request)), usage.get("prompt_tokens"))
            ratio = self.tokens_per_char.ratio
            if self.counts_in_chars and abs(ratio / self._fit_ratio - 1) > RESCALE_AT:
                self.cost.rescale_tokens(ratio / self._fit_ratio)
                self._fit_ratio = ratio
        cost = decision.detail.get("cost")
        if cost is not None:  # ended without a first token (an error, a disconnect): off the queue all the same
            self.cost.started(decision.replica.name, cost, None)
            self.decode.finished(id(decision), self.clock())

    def explain(self, request: RouteRequest, candidates: Sequence[Replica]) -> dict:
        """The pick :meth:`pick` would make now (same random draw), with every score; changes nothing."""
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        now = self.clock()
        ev = self._evaluate(request, candidates, now, rng)
        o = self.options
        replicas = []
        for i, replica in enumerate(candidates):
            engine = replica.engine_load
            replicas.append({
                "name": replica.name, "candidate": True, "matched_chars": ev.matched[i], "load": ev.loads[i],
                "engine_load": None if engine is None else {
                    "running": engine.running, "waiting": engine.waiting, "age_s": round(now - engine.at, 3),
                    "kv_free_from": kv_capacity.free_tokens(engine, self.stored_blocks, replica.name,
                                                            replica.inflight_tokens)[1]},
                **self.explain_cost(ev, i, replica.name),
            })
        return {
            "pick": candidates[ev.chosen].name, "outcome": ev.outcome, "reason": ev.reason,
            "preferred": candidates[ev.preferred].name, "prompt_chars": len(ev.text),
            "prompt_tokens_estimate": self.tokens_per_char.count(len(canonical_text(request))) + 1,
            "tokens_per_char": round(self.tokens_per_char.ratio, 4),
            "rule": {**self.explain_rule(), "min_match_chars": o.min_match_chars},
            "tree": {"nodes": self.tree.node_count, "chars": self.tree.char_count},
            "replicas": replicas,
        }

    def explain_cost(self, choice: Choice, i: int, name: str) -> dict:
        """Candidate ``i``'s part of an explanation: its estimate and learnt speed (rule ``cost``) or its scores."""
        if choice.estimates is not None:
            spread = {} if choice.uncertainties is None else {"uncertainty_s": round(choice.uncertainties[i], 4)}
            charge = {} if choice.charges is None else {**choice.charges[i].as_json(),
                                                        "total_cost_s": round(choice.total_cost(i), 4)}
            held = {"held_chars": self.tree.replica_chars.get(name, 0)}
            if choice.deal is not None:
                held["affordable"] = i in choice.deal.affordable
                held["within_load_margin"] = i in choice.deal.running
            return {"cost": {**choice.estimates[i].as_json(), **spread, **charge,
                             "learnt": {**self.cost.describe(name), **self.decode.describe(name)}}, "deal": held}
        return {"scores": {key: values[i] for key, values in choice.scores.items()}, "combined": choice.combined[i]}

    def explain_rule(self) -> dict[str, Any]:
        o = self.options
        rule: dict[str, Any] = {"rule": o.rule, "max_imbalance": o.max_imbalance, "load_sigma_k": o.load_sigma_k}
        if o.rule == "cost":
            rule["cost_override_sigmas"] = o.cost_override_sigmas
        if o.rule == "scores":
            rule["weights"] = dict(o.scorers)
        return rule

    # -- the rule ----------------------------------------------------------------------------------------------------

    def prompt_text(self, request: RouteRequest) -> str:
        """The request's canonical text, cut to ``max_prefix_chars``: what the tree matches and learns."""
        text = canonical_text(request)
        limit = self.options.max_prefix_chars
        return text[:limit] if len(text) > limit else text

    def matches(self, text: str, candidates: Sequence[Replica], now: float) -> list[int]:
        """Each candidate's characters of ``text`` held in the tree; 0 below ``min_match_chars``."""
        held = self.tree.match(text, now)
        floor = self.options.min_match_chars
        return [m if (m := held.get(r.name, 0)) >= floor else 0 for r in candidates]

    def learn(self, text: str, replica: str, outcome: str, now: float) -> None:
        """Record a pick: ``replica`` now holds ``text``; a pick that was not a hit makes it the most recently cold.
        In a cluster the other gateways' trees learn it too (its first ``SHARED_TEXT_CHARS`` characters)."""
        if outcome != "hit":
            self.note_cold(replica)
        held = self.tree.replica_chars.get(replica, 0)
        self.tree.insert(text, replica, now)
        if self.learning is not None:
            self.recent_chars.add(now, self.tree.replica_chars.get(replica, 0) - held)
            self.learning.publish(SHARED_ROUTE, [text[:SHARED_TEXT_CHARS], replica])

    def _learn_shared_route(self, payload: list) -> None:
        """Another gateway sent ``text`` to ``replica``: this tree learns it too (as routed, not as a cold pick)."""
        text, replica = payload
        if isinstance(text, str) and isinstance(replica, str):
            self.tree.insert(text, replica, self.clock())

    def _learn_shared_ttft(self, payload: list) -> None:
        """Another gateway observed an engine's time to first token: it counts here when the replica of that name
        is on the same engine."""
        engine_id, replica, tokens, requests, ttft = payload
        self.cost.observe_engine(str(engine_id), str(replica), float(tokens), float(requests), float(ttft))

    def note_cold(self, replica: str) -> None:
        """``replica`` was just given a request it held nothing of: it loses ties to those given one less recently."""
        self._cold_serial += 1
        self._last_cold[replica] = self._cold_serial

    def decide(self, request: RouteRequest, candidates: Sequence[Replica], *, prompt_units: int,
               matched: list[int], now: float, rng: random.Random, prompt_tokens: int | None = None,
               cached_tokens: Sequence[int] | None = None) -> Choice:
        """Rules 2 to 5 (the cost model or the scores, preferred replica, ties, load guard) for ``matched`` of
        ``prompt_units``.

        ``matched[i]`` is what candidate ``i`` holds (0 for nothing useful), in the same unit as
        ``prompt_units``; the scorers see them as ``matched_chars`` and ``prompt_chars``. The cost model works
        in tokens: ``prompt_tokens`` and ``cached_tokens`` (default: characters / 4). Changes no state.
        """
        loads = [self._load(r, now) for r in candidates]
        tokens = [r.inflight_tokens for r in candidates]

        def tie_key(i: int) -> tuple:
            return loads[i], tokens[i], self._last_cold.get(candidates[i].name, 0)

        if self.options.rule == "cost":
            if prompt_tokens is None:
                prompt_tokens = self.tokens_per_char.count(prompt_units) + 1
            if cached_tokens is None:
                cached_tokens = [self.tokens_per_char.count(m) for m in matched]
            return self._decide_by_cost(candidates, matched, loads, tokens, prompt_tokens, cached_tokens, now,
                                        rng, tie_key, request)
        context = ScoreContext(prompt_units, matched, loads, tokens, now)
        scores: dict[str, Sequence[float]] = {}
        combined = [0.0] * len(candidates)
        for name, weight, scorer in self.scorers:
            values = scorer.score(request, candidates, context)
            if len(values) != len(candidates):
                raise ValueError(f"scorer {name!r} returned {len(values)} scores for {len(candidates)} candidates")
            scores[name] = values
            if weight:
                combined = [total + weight * value for total, value in zip(combined, values)]

        best = max(combined)
        preferred = self._first(rng, [i for i, s in enumerate(combined) if s == best], tie_key)
        return self._guard(preferred, preferred, matched, loads, tokens, scores, combined, rng, tie_key)

    def _decide_by_cost(self, candidates: Sequence[Replica], matched: list[int], loads: list[float],
                        tokens: list[int], prompt_tokens: int, cached_tokens: Sequence[int], now: float,
                        rng: random.Random, tie_key, request: RouteRequest | None = None) -> Choice:
        """The smallest cost: estimated time to first token plus the delay to others (:mod:`llmgw.router.cost`).

        An estimate within ``COST_TIE_FRACTION`` of it, ``COST_TIE_SECONDS`` or half the noise of the observed
        TTFTs (the noisier of its replica's and the smallest's: a difference smaller than that cannot be told
        from chance) ties, and ties go to the longest match, then the usual tie-breaks. Choosing a replica that
        holds less than the longest match is outcome ``cost_override``.
        """
        waiting = [self._engine_waiting(r, now) for r in candidates]
        self.cost.follow(candidates)
        estimates = self.cost.estimate([r.name for r in candidates], prompt_tokens, cached_tokens, loads, waiting,
                                       [(r.queued_tokens, r.queued_requests, _seconds_since(r.queued_since, now))
                                        for r in candidates])
        costs = [e.cost for e in estimates]
        charges = self._decode_charges(candidates, estimates, loads, prompt_tokens, request, now)
        base = costs
        costs = [t + c.total for t, c in zip(base, charges)]
        best = min(costs)
        best_noise = max(e.noise for e, t in zip(estimates, costs) if t == best)
        margin = max(best * COST_TIE_FRACTION, COST_TIE_SECONDS)
        near = [i for i, (e, t) in enumerate(zip(estimates, costs))
                if t <= best + max(margin, COST_TIE_NOISE * max(best_noise, e.noise))]
        longest = max(matched)
        dealt = None
        if not longest:
            if self.options.new_prefixes == "deal":
                dealt = self._deal(request, candidates, estimates, near, loads, now)
            pool = near if dealt is None else dealt.dealt
            chosen = self._rendezvous(request, candidates, pool) \
                if len(pool) > 1 and self.learning is not None and request is not None \
                else self._first(rng, pool, tie_key)
        else:
            chosen = self._first(rng, near, lambda i: (-matched[i], *tie_key(i)))
        uncertainties = self.uncertainty.all([r.name for r in candidates], estimates)
        gated = ""
        if matched[chosen] < longest:
            holder = min((i for i, m in enumerate(matched) if m == longest), key=lambda i: (costs[i], tie_key(i)))
            gated = self._gate(candidates, estimates, costs, uncertainties, charges, chosen, holder)
            if gated:
                chosen = holder
        preferred = self._first(rng, [i for i, m in enumerate(matched) if m == longest], tie_key) \
            if longest else chosen
        combined = [-t for t in costs]
        choice = self._guard(preferred, chosen, matched, loads, tokens, {}, combined, rng, tie_key)
        choice.estimates, choice.uncertainties = estimates, uncertainties
        if gated and choice.outcome == "hit":
            choice.gated, choice.reason = True, gated
        if dealt is not None and choice.outcome == "miss":
            choice.deal = dealt
            choice.reason = self._dealt(candidates, choice.chosen, dealt)
        choice.charges = charges
        choice.moved_by = _moved_by(base, charges, choice.chosen, margin)
        if choice.outcome == "hit" and matched[chosen] < longest or choice.outcome == "miss" and longest:
            p, c = estimates[preferred], estimates[chosen]
            choice.outcome = "cost_override"
            choice.reason = (f"{candidates[preferred].name} holds more of the prompt ({p.cached_tokens} tokens) but "
                             f"its queue ({p.queued_tokens} prefill tokens, {p.requests:g} requests) makes it slower: "
                             f"est. TTFT {p.ttft * 1000:.0f} ms vs {c.ttft * 1000:.0f} ms, with the delay to the "
                             f"requests on each {p.cost * 1000:.0f} ms vs {c.cost * 1000:.0f} ms")
            if charges[preferred].total > charges[chosen].total:
                choice.reason += (f"; decoding there adds {charges[preferred].decode * 1000:.0f} ms and preemptions "
                                  f"{charges[preferred].capacity * 1000:.0f} ms, vs {charges[chosen].decode * 1000:.0f}"
                                  f" ms and {charges[chosen].capacity * 1000:.0f} ms")
        return choice

    def _gate(self, candidates: Sequence[Replica], estimates: list[cost_model.Estimate], costs: list[float],
              uncertainties: list[float], charges: list[decode_cost.DecodeCharge], chosen: int, holder: int) -> str:
        """Why ``chosen``, which holds less than the longest match, must not take the request: its expected gain
        over ``holder`` (the cheapest holder of the longest match; ``costs`` with the decode and capacity charges)
        is within the uncertainty of the two estimates (the override gate, :mod:`llmgw.router.uncertainty`) and of
        their decode charges (the outputs' lengths); '' when the gain pays for the move. Estimates the holder's
        exceeds in every term on the same line leave only the charges' uncertainty (:func:`certainly_costlier`)."""
        gain = costs[holder] - costs[chosen]
        kept, taken = uncertainties[holder], uncertainties[chosen]
        if certainly_costlier(estimates[holder], estimates[chosen]):
            kept = taken = 0.0
        kept, taken = math.hypot(kept, charges[holder].uncertainty), math.hypot(taken, charges[chosen].uncertainty)
        if override_pays(gain, kept, taken, self.options.cost_override_sigmas):
            return ""
        spread = math.hypot(kept, taken)
        return (f"holds the longest useful match: {candidates[chosen].name} looked {gain * 1000:.0f} ms cheaper, "
                f"within the uncertainty of the two estimates ({spread * 1000:.0f} ms; {estimates[chosen].new_tokens} "
                f"new tokens there against {estimates[holder].new_tokens} here)")

    def _decode_charges(self, candidates: Sequence[Replica], estimates: list[cost_model.Estimate],
                        loads: list[float], prompt_tokens: int, request: RouteRequest | None,
                        now: float) -> list[decode_cost.DecodeCharge]:
        """Each candidate's decode and capacity charge (:mod:`llmgw.router.decode_cost`; 0 with
        ``cost_decode_weight: 0``, but explained all the same)."""
        self.decode.follow(candidates)
        kv_free = []
        for replica in candidates:
            engine = self._fresh_engine_load(replica, now)
            kv_free.append(None if engine is None else kv_capacity.free_tokens(
                engine, self.stored_blocks, replica.name, replica.inflight_tokens)[0])
        max_tokens = decode_cost.max_output_tokens(request.body) if request is not None else None
        return self.decode.charges([r.name for r in candidates], prompt_tokens, max_tokens, loads,
                                   [r.inflight_tokens for r in candidates], [e.throughput for e in estimates],
                                   kv_free, now)

    def _guard(self, preferred: int, chosen: int, matched: list[int], loads: list[float], tokens: list[int],
               scores: dict, combined: list[float], rng: random.Random, tie_key) -> Choice:
        """The load guard (``max_imbalance``, ``load_sigma_k``) applied to ``chosen``: outcome ``load_override``,
        else ``hit`` or ``miss``."""
        least = min(loads)
        reason = self._overloaded(chosen, loads, least)
        if reason:
            chosen = self._first(rng, [i for i, load in enumerate(loads) if load == least], tie_key)
            outcome = "load_override"
        else:
            outcome = "hit" if matched[chosen] else "miss"
        return Choice(matched, loads, tokens, scores, combined, preferred, chosen, outcome, reason)

    def _evaluate(self, request: RouteRequest, candidates: Sequence[Replica], now: float,
                  rng: random.Random) -> Evaluation:
        text = self.prompt_text(request)
        matched = self.matches(text, candidates, now)
        c = self.decide(request, candidates, prompt_units=len(text), matched=matched, now=now, rng=rng)
        reason = c.reason
        if not reason:
            longest = max(matched)
            reason = ("holds the longest useful match" if c.outcome == "hit" and matched[c.chosen] == longest
                      else "best combined score" if longest
                      else f"no candidate holds {self.options.min_match_chars}+ characters of the prefix: "
                           + ("the smallest estimated TTFT" if c.estimates is not None else "spread by load"))
        return Evaluation(**{**vars(c), "reason": reason}, text=text)

    def _overloaded(self, preferred: int, loads: list[float], least: float) -> str:
        """Why the preferred replica is too loaded to take the request, or ''."""
        o = self.options
        load = loads[preferred]
        if o.max_imbalance is not None and load + 1 - least > o.max_imbalance:
            return (f"preferred replica would be {load + 1 - least:g} in-flight requests above the least loaded "
                    f"(max_imbalance {o.max_imbalance:g})")
        if o.load_sigma_k is not None and load > least:
            mean = sum(loads) / len(loads)
            sigma = math.sqrt(sum((x - mean) ** 2 for x in loads) / len(loads))
            if load > mean + o.load_sigma_k * sigma:
                return (f"preferred replica's load {load:g} exceeds mean + {o.load_sigma_k:g}σ "
                        f"(mean {mean:.3g}, σ {sigma:.3g})")
        return ""

    def _deal(self, request: RouteRequest | None, candidates: Sequence[Replica], estimates: list[cost_model.Estimate],
              near: list[int], loads: list[float], now: float) -> new_prefixes.Deal:
        """The candidates a prompt no replica holds may be dealt to (:mod:`llmgw.router.deal`): the affordable ones
        running within ``deal_load_margin`` of the least and holding the least of the tree; in a cluster, within
        what this gateway did that its peers have not heard of."""
        names, weights = [r.name for r in candidates], [r.weight for r in candidates]
        margin = self.options.deal_load_margin
        if self.learning is None:
            return new_prefixes.deal(estimates, near, self.tree.replica_chars, names, weights,
                                     loads=loads, load_margin=margin)
        return new_prefixes.deal(estimates, near, self.tree.replica_chars, names, weights,
                                 self.recent_chars.total(now), self.recent_tokens.total(now), loads,
                                 None if margin is None else margin + self.recent_routes.total(now))

    @staticmethod
    def _dealt(candidates: Sequence[Replica], chosen: int, deal: new_prefixes.Deal) -> str:
        """Why a new prefix went where it went, for ``/admin/explain``."""
        held = deal.held[chosen]
        least = min(deal.held[i] for i in deal.running)
        busier = len(deal.affordable) - len(deal.running)
        return (f"no candidate holds the prompt: dealt to {candidates[chosen].name}, holding {held:.0f} characters "
                f"of the tree (the least is {least:.0f}) among the {len(deal.affordable)} candidates within "
                f"{deal.slack * 1000:.0f} ms of the smallest cost"
                + (f" ({busier} of them left out, running more requests than the margin allows)" if busier else "")
                + ("" if chosen in deal.cheapest else ", not one of the cheapest"))

    def _rendezvous(self, request: RouteRequest, candidates: Sequence[Replica], indices: list[int]) -> int:
        """Among the candidates a prompt no replica holds may be dealt to, the one its first characters hash to
        highest with (rendezvous hashing): every gateway of a cluster that sees the same new prefix at the same
        moment picks the same replica, before any of them could learn of the others' pick."""
        head = canonical_text(request)[:max(self.options.min_match_chars, 64)].encode()

        def weight(i: int) -> bytes:
            return hashlib.blake2b(head, digest_size=8, key=candidates[i].name.encode()[:64]).digest()

        return max(indices, key=weight)

    @staticmethod
    def _first(rng: random.Random, indices: list[int], key) -> int:
        """The index with the smallest ``key``; a random one among equals."""
        if len(indices) == 1:
            return indices[0]
        keys = [key(i) for i in indices]
        smallest = min(keys)
        tied = [i for i, k in zip(indices, keys) if k == smallest]
        return tied[0] if len(tied) == 1 else rng.choice(tied)

    def _fresh_engine_load(self, replica: Replica, now: float):
        engine = replica.engine_load
        if engine is not None and self.options.engine_metrics_max_age is not None \
                and now - engine.at <= self.options.engine_metrics_max_age:
            return engine
        return None

    def _load(self, replica: Replica, now: float) -> float:
        # The cluster's count (ours plus the other gateways' latest), like the engine's gauges, which see them all.
        engine = self._fresh_engine_load(replica, now)
        return replica.inflight if engine is None else max(replica.inflight, engine.requests)

    def _engine_waiting(self, replica: Replica, now: float) -> float | None:
        engine = self._fresh_engine_load(replica, now)
        return None if engine is None else engine.waiting


def _moved_by(base: list[float], charges: list[decode_cost.DecodeCharge], chosen: int, margin: float) -> str:
    """Which charge moved the pick: "" when ``chosen`` is within ``margin`` of the smallest cost without them,
    else the larger of the two charges on the candidate that cost least without them."""
    cheapest = min(range(len(base)), key=base.__getitem__)
    if base[chosen] <= base[cheapest] + margin:
        return ""
    c = charges[cheapest]
    return "capacity" if c.capacity > c.decode else "decode"


def _seconds_since(moment: float | None, now: float) -> float:
    return 0.0 if moment is None else max(0.0, now - moment)


def prefill_tokens(detail: dict) -> int:
    """The prompt tokens a decision expects its replica to compute: its cost estimate's new tokens (the router
    counts them as the replica's queued prefill until the first token); 0 when the rule made no estimate."""
    cost = detail.get("cost")
    return int(cost["new_tokens"]) if cost is not None else 0


def _declared_keys(scorer_factories) -> set[str]:
    """The ``routing_options`` keys scorers declare they read (a scorer factory's ``option_keys``)."""
    return {str(key) for factory in scorer_factories for key in getattr(factory, "option_keys", ())}


@hookimpl
def register_routing_tiers():
    return {TIER_NAME: PrefixTreeTier}
