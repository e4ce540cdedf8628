"""Fixtures of the cluster tests: ``engines`` (an :class:`~llmgw.testing.cluster.EngineReaper`) and ``cluster``
(a :class:`~llmgw.testing.cluster.Cluster` of real ``llmgw serve`` and ``llmgw agent`` processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.testing.cluster import Cluster, EngineReaper

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nodes"


@pytest.fixture
def engines(tmp_path):
    """Engines to kill when the test ends, passed or failed: a sync fixture, so its teardown runs after every
    async fixture's (the cluster's processes stopped first); it kills every engine a ledger under the test's
    folder names and every pid the admin API showed."""
    reaper = EngineReaper(tmp_path)
    try:
        yield reaper
    finally:
        reaper.reap()


@pytest.fixture
async def cluster(engines, nursery, tmp_path):
    c = Cluster(nursery, tmp_path, engines, fixtures=FIXTURES, cwd=REPO)
    try:
        yield c
    finally:
        await c.http.aclose()
