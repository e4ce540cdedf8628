"""The usage sink's Prometheus counters (``llmgw_tenant_*``), labelled by team and model at most, never by key.

Each answer and refusal is added to a small sum per (team, model) (:meth:`UsageMetrics.note`, a dictionary update:
a counter's ``inc`` takes a lock, and there would be five per answer); :meth:`UsageMetrics.publish`, every
``usage_flush_interval``, adds the sums to the counters, whether or not the store takes the usage.

Teams and models are bounded label sets: the first :data:`MAX_LABEL_VALUES` teams (and models) this process saw
keep their own series, later ones are counted under ``other`` (teams come from the admin API, so their number is
not the config's to bound). A key of no team is ``none`` (a name no team may take).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from ..cached_labels import CachedLabels
from .model import NANO_PER_USD
from .usage import CACHED, FIELDS, INPUT, NANO_USD, OUTPUT, REFUSAL_FIELD, REQUESTS, Counts, UsageRow, add_to

MAX_LABEL_VALUES = 100  # teams (and models) with series of their own; the rest are "other"
NO_TEAM = "none"
OTHER = "other"
_CODES = (("2xx", FIELDS.index("answers_2xx")), ("4xx", FIELDS.index("answers_4xx")),
          ("5xx", FIELDS.index("answers_5xx")), ("other", FIELDS.index("answers_other")))
_REASONS = tuple(REFUSAL_FIELD.items())


class BoundedLabel:
    """The first ``limit`` values seen keep their own name; later ones are :data:`OTHER`."""

    def __init__(self, limit: int = MAX_LABEL_VALUES):
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self.limit:
            return OTHER
        self._seen.add(value)
        return value


class UsageMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_label_values: int = MAX_LABEL_VALUES):
        r = registry
        self.requests = CachedLabels(Counter(
            "llmgw_tenant_requests", "Answers engines gave to keyed requests, by team (none: a key of no team), "
            "model and status class (2xx, 4xx, 5xx, other).", ["team", "model", "code"], registry=r))
        self.tokens = CachedLabels(Counter(
            "llmgw_tenant_tokens", "Tokens of keyed requests by team, model and kind: input (every prompt token, "
            "cached ones included), cached_input, output.", ["team", "model", "kind"], registry=r))
        self.spend = CachedLabels(Counter(
            "llmgw_tenant_spend_usd", "Money keyed requests cost at the configured prices, in USD, by team and "
            "model.", ["team", "model"], registry=r))
        self.refused = CachedLabels(Counter(
            "llmgw_tenant_refused", "Requests refused before routing, by team and reason: rate_limit_exceeded "
            "and insufficient_quota (429), model_not_allowed (403).", ["team", "reason"], registry=r))
        self.lost = Counter(
            "llmgw_tenant_usage_lost_rows", "Usage rows dropped because the store was away past the memory "
            "bound and this process has no journal (0 with a state dir).", registry=r)
        self.shipped = Counter(
            "llmgw_tenant_usage_flushed_rows", "Usage rows this process shipped to the usage store.", registry=r)
        self.team = BoundedLabel(max_label_values)
        self.model = BoundedLabel(max_label_values)

        self._sums: dict[tuple[str, str], Counts] = {}

    def note(self, row: UsageRow, counts: Counts) -> None:
        """The sink's hook: one answer's or one refusal's counters, summed until the next :meth:`publish`."""
        add_to(self._sums, (row.team, row.model), counts)

    def publish(self) -> None:
        """The sums since the last call into the counters."""
        sums, self._sums = self._sums, {}
        for (team, model), counts in sums.items():
            self.count(team, model, counts)

    def count(self, team_name: str, model_name: str, counts: Counts) -> None:
        team = self.team(team_name or NO_TEAM)
        if counts[REQUESTS]:
            model = self.model(model_name)
            for code, index in _CODES:
                if counts[index]:
                    self.requests.labels(team, model, code).inc(counts[index])
            tokens = self.tokens
            tokens.labels(team, model, "input").inc(counts[INPUT])
            if counts[CACHED]:
                tokens.labels(team, model, "cached_input").inc(counts[CACHED])
            tokens.labels(team, model, "output").inc(counts[OUTPUT])
            if counts[NANO_USD]:
                self.spend.labels(team, model).inc(counts[NANO_USD] / NANO_PER_USD)
        for reason, index in _REASONS:
            if counts[index]:
                self.refused.labels(team, reason).inc(counts[index])
