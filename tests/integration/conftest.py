"""Fixtures of the cluster tests: ``engines`` (an :class:`~llmgw.testing.cluster.EngineReaper`), ``cluster``
(a :class:`~llmgw.testing.cluster.Cluster` of real ``llmgw serve`` and ``llmgw agent`` processes),
``shared_cluster`` (gateway processes sharing state through Redis: :mod:`llmgw.testing.shared_state`) and
``ha_cluster`` (the production topology of a highly available cluster: :mod:`llmgw.testing.ha`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.testing.cluster import Cluster, EngineReaper
from llmgw.testing.shared_state import start_cluster

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


@pytest.fixture
def shared_cluster(nursery, start_llmgw, redis_url, cluster_name):
    """``await shared_cluster(redis_url=None, **options)`` -> ``(simulators, control, followers)``: a control
    ``llmgw serve`` and ``--role gateway`` followers of the test's own cluster, on the session's redis-server unless
    ``redis_url`` says otherwise (``options``: those of :func:`llmgw.testing.shared_state.start_cluster`)."""

    session_url = redis_url

    async def start(redis_url: str | None = None, **options):
        return await start_cluster(nursery, start_llmgw, redis_url or session_url, cluster_name, **options)

    return start


@pytest.fixture
async def ha_cluster(nursery, engines, private_redis, cluster_name, tmp_path):
    """The production topology (:func:`llmgw.testing.ha.start_ha_cluster`): candidates A (leading) and B, a
    ``--role gateway`` F, a remote agent joined with A and B deploying two simulator replicas, on the test's own
    redis-server (``ha_cluster.redis``, which it may freeze, kill and restart)."""
    import httpx

    from llmgw.testing.ha import start_ha_cluster

    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=200)) as http:
        yield await start_ha_cluster(nursery, tmp_path / "ha", engines, private_redis, cluster_name, http,
                                     fixtures=FIXTURES, cwd=REPO)
