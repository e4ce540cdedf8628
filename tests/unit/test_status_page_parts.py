"""The parts of the status page (``GET /ui``): the page and its Content-Security-Policy, the ring of recent routing
decisions (``/admin/decisions``) and the per-replica summaries (``/admin/stats``)."""

from __future__ import annotations

import base64
import bisect
import hashlib
import json
import math
import re

from hypothesis import given, strategies as st

from llmgw.gateway.decisions import DETAIL_KEYS, MAX_TEXT, DecisionLog
from llmgw.gateway.replica_stats import replica_stats
from llmgw.gateway.ui import status_page
from llmgw.metrics import LATENCY_BUCKETS, Metrics
from llmgw.router.tier import Decision, RouteRequest


class _Replica:
    name = "r-0"
    model = "m"


def _decision(detail: dict, outcome: str = "hit") -> Decision:
    return Decision(_Replica(), outcome=outcome, tier="kv_index", detail=detail)  # type: ignore[arg-type]


# -- the page ----------------------------------------------------------------------------------------------------------


def _digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_the_policy_allows_exactly_the_pages_own_inline_script_and_style():
    page = status_page()
    html = page.body.decode()
    (script,) = re.findall(r"<script>(.*?)</script>", html, re.S)
    (style,) = re.findall(r"<style>(.*?)</style>", html, re.S)
    directives = dict(d.strip().split(" ", 1) for d in page.headers["Content-Security-Policy"].split(";"))
    assert directives["script-src"] == _digest(script) and directives["style-src"] == _digest(style)
    assert directives["default-src"] == "'none'" and directives["connect-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'" and directives["img-src"] == "data:"
    assert status_page() is page  # read once


def test_the_page_loads_nothing_from_elsewhere_and_builds_no_html_from_data():
    html = status_page().body.decode()
    assert re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", html) == ["data:,"]  # the empty favicon
    assert not re.search(r"\son\w+\s*=|\sstyle\s*=", html)  # handler and style attributes: not in the policy
    script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)  # type: ignore[union-attr]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
    assert "textContent" in script and "sessionStorage" in script and "localStorage" not in script
    assert "cookie" not in script


# -- recent decisions --------------------------------------------------------------------------------------------------


def test_the_ring_keeps_the_last_decisions_newest_first_without_their_block_keys():
    ring = DecisionLog(size=3)
    for i in range(5):
        detail = {"matched_blocks": i, "block_keys": list(range(1000)), "prediction": object(),
                  "cost": {"estimated_ttft_s": 0.02, "keys": [1, 2]}, "reason": "x" * 1000}
        ring.record(RouteRequest("m", "/v1/completions", {}, request_id=f"req-{i}"), _decision(detail),
                    200, started=10.0 + i, ended=10.5 + i, first_token_at=10.1 + i if i % 2 else None)
    entries = ring.to_json()
    assert ring.capacity == 3 and [e["request_id"] for e in entries] == ["req-4", "req-3", "req-2"]
    newest = entries[0]
    assert (newest["model"], newest["replica"], newest["tier"], newest["outcome"], newest["status"]) \
        == ("m", "r-0", "kv_index", "hit", 200)
    assert newest["latency_ms"] == 500.0 and newest["ttft_ms"] is None and entries[1]["ttft_ms"] == 100.0
    assert newest["detail"] == {"matched_blocks": 4, "cost": {"estimated_ttft_s": 0.02}, "reason": "x" * MAX_TEXT}
    assert entries[0]["at"] > entries[1]["at"]


_JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=400),
                        lambda children: st.lists(children, max_size=5)
                        | st.dictionaries(st.text(max_size=5), children, max_size=5), max_leaves=20)


@given(st.dictionaries(st.text(max_size=300), _JSONISH, max_size=60))
def test_any_tiers_detail_is_kept_bounded_and_rendered_as_strict_json(detail):
    ring = DecisionLog()
    ring.record(RouteRequest("m", "/v1/completions", {}), _decision(detail), 200, 1.0, 2.0, 1.5)
    (entry,) = ring.to_json()
    json.dumps(entry, allow_nan=False)  # no NaN or infinity: the page's JSON.parse would refuse the answer
    kept = entry["detail"]
    assert len(kept) <= DETAIL_KEYS
    for key, value in kept.items():
        assert len(key) <= MAX_TEXT and not isinstance(value, list)
        for leaf in (value.values() if isinstance(value, dict) else [value]):
            assert not isinstance(leaf, (list, dict)) and (not isinstance(leaf, str) or len(leaf) <= MAX_TEXT)


# -- per-replica summaries ---------------------------------------------------------------------------------------------


def test_the_stats_give_each_replicas_requests_hit_rate_and_ttft():
    metrics = Metrics()
    bound = metrics.for_replica(_Replica())
    for seconds in (0.01, 0.02, 0.03, 0.2):
        bound.ttft.observe(seconds)
        bound.e2e.observe(seconds * 2)
    bound.prompt_tokens.inc(1000)
    bound.cached_tokens.inc(250)
    (entry,) = replica_stats(metrics)
    assert (entry["model"], entry["replica"], entry["requests"]) == ("m", "r-0", 4)
    assert (entry["prompt_tokens"], entry["cached_tokens"], entry["hit_rate"]) == (1000, 250, 0.25)
    assert entry["ttft"]["count"] == 4 and entry["ttft"]["mean_ms"] == 65.0
    assert 10 <= entry["ttft"]["p50_ms"] <= 25 and 100 <= entry["ttft"]["p90_ms"] <= 250
    assert replica_stats(Metrics()) == []


@given(st.lists(st.floats(min_value=0, max_value=400, allow_nan=False), min_size=1, max_size=200))
def test_a_quantile_falls_in_the_bucket_of_the_true_one(observations):
    metrics = Metrics()
    bound = metrics.for_replica(_Replica())
    for seconds in observations:
        bound.ttft.observe(seconds)
    (entry,) = replica_stats(metrics)
    ordered = sorted(observations)
    bounds = (0.0, *LATENCY_BUCKETS)
    for q in (0.5, 0.9):
        true = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
        estimate = entry["ttft"][f"p{round(q * 100)}_ms"] / 1000
        i = bisect.bisect_left(LATENCY_BUCKETS, true)  # the bucket (bounds[i], bounds[i + 1]] holding it
        if i == len(LATENCY_BUCKETS):  # beyond the last finite bound: reported as that bound
            assert estimate == LATENCY_BUCKETS[-1]
        else:
            assert bounds[i] - 1e-4 <= estimate <= bounds[i + 1] + 1e-4, (q, true, estimate)
    assert entry["ttft"]["p50_ms"] <= entry["ttft"]["p90_ms"]
