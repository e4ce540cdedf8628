"""The Grafana dashboard (docs/grafana/llmgw.json) asks only for series a running gateway exports.

The demo (an embedded agent, two simulators with KV events, the kv_index
tier) serves one request, then every metric name in every panel expression
must be a family in ``/metrics``, and a ``model`` filter may only be put on
a series that carries a ``model`` label.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import trio

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "llmgw.json"
METRIC = re.compile(r"\b((?:llmgw|process|python)_[a-z0-9_]+)(\{[^}]*\})?")
SUFFIXES = ("_bucket", "_sum", "_count")


def expressions(dashboard: dict) -> list[str]:
    found = []
    for panel in dashboard["panels"]:
        found += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "query":
            found.append(variable["query"])
    return found


def exported(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Family names (from # HELP lines and samples) and, per sample name, the label names seen."""
    families, labels = set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            families.add(line.split(" ", 3)[2])
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split(" ", 1)[0]
            families.add(name)
            labels.setdefault(name, set()).update(re.findall(r'(\w+)="', rest))
    return families, labels


def family_of(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


async def test_every_dashboard_expression_names_an_exported_metric(nursery, start_llmgw):
    dashboard = json.loads(DASHBOARD.read_text())
    gw = await start_llmgw(None)
    async with httpx.AsyncClient(timeout=30) as client:
        with trio.fail_after(60):
            while (await client.post(gw.url + "/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 40}]})
                   ).status_code != 200:
                await trio.sleep(0.2)
        families, labels = exported((await client.get(gw.control_url + "/metrics")).text)
    checked = 0
    for expr in expressions(dashboard):
        for name, selector in METRIC.findall(expr):
            assert name in families or family_of(name) in families, f"{name} (in {expr!r}) is not exported"
            if selector and "model=" in selector and name in labels:
                assert "model" in labels[name], f"{name} has no model label (in {expr!r})"
            checked += 1
    assert checked >= 40  # the dashboard was read, not skipped
