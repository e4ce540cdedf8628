"""Fixtures of the cluster tests: ``cluster`` (a :class:`helpers.Cluster`) and ``engines`` (pids reaped after)."""

from __future__ import annotations

import json

import pytest

from helpers import Cluster, kill_group


@pytest.fixture
def engines(tmp_path):
    """Pids of engines to reap after the test (after every async fixture, the cluster's processes included)."""
    pids: set[int] = set()
    yield pids
    for ledger in tmp_path.rglob("shards.json"):
        for entry in json.loads(ledger.read_text()).get("shards", {}).values():
            pids.add(entry.get("pgid") or entry.get("pid") or 0)
    for pid in pids - {0}:
        kill_group(pid)



@pytest.fixture
async def cluster(engines, nursery, tmp_path):
    c = Cluster(nursery, tmp_path, engines)
    yield c
    await c.http.aclose()
