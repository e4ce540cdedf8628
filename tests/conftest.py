"""Fixtures of every test: real child processes on 127.0.0.1 with ephemeral ports, owned by the test's nursery
(started with :mod:`llmgw.testing`), a gateway run in the test's own nursery, and real redis-servers."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from llmgw.redis_server import RedisServer
from llmgw.testing.processes import CLUSTER_SECRET, CLUSTER_SECRET_ENV, Child, start_serve
from llmgw.testing.redis import PrivateRedis, start_private_redis, start_session_redis
from llmgw.testing.sims import start_fake_upstream as start_fake_upstream_in

REPO = Path(__file__).resolve().parents[1]

# No per-example deadline: hypothesis' default (200 ms) is a timed assertion, and on a loaded machine a slow example
# failed tests whose property held (speed is measured by llmgw/bench/, never asserted in a test). Tests that set
# their own settings keep them.
settings.register_profile("llmgw", deadline=None)
settings.load_profile("llmgw")


@pytest.fixture(autouse=True)
def private_state_home(tmp_path, monkeypatch):
    """Default state folders (the control plane's node identities, agents' ledgers) in the test's own tmp_path,
    never the user's home, and never shared between tests (node ids repeat across tests)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))


@pytest.fixture(autouse=True)
def cluster_secret(monkeypatch):
    """The secret a Redis-backed cluster needs (``state_section`` names its variable), for gateways run in the
    test's own process too (children of llmgw.testing.processes get it anyway)."""
    monkeypatch.setenv(CLUSTER_SECRET_ENV, CLUSTER_SECRET)


@pytest.fixture
def start_fake_upstream(nursery):
    """``await start_fake_upstream(name, port=0, chunks=50)`` -> a running fake OpenAI upstream (a Child);
    ``extra``: more of its options (``--tls-cert``...)."""

    async def start(name: str, port: int = 0, chunks: int = 50, model: str = "tiny", status: int = 200,
                    extra: tuple[str, ...] = ()) -> Child:
        return await start_fake_upstream_in(nursery, name, port=port, chunks=chunks, model=model, status=status,
                                            extra=extra)

    return start


@pytest.fixture
def start_llmgw(nursery, tmp_path):
    """``await start_llmgw(config_text, *args, env=...)`` -> a running ``llmgw serve`` child.

    The child gets ``--listen``/``--control-listen`` on port 0; its ``url`` is the
    OpenAI endpoint and ``child.control_url`` the control listener.
    """

    async def start(config_text: str | None, *extra: str, env: dict | None = None) -> Child:
        path = None
        if config_text is not None:
            path = tmp_path / f"llmgw-{len(list(tmp_path.iterdir()))}.yaml"
            path.write_text(config_text)
        return await start_serve(nursery, path, *extra, env=env)

    return start


@pytest.fixture
def gateway_in_process(nursery, tmp_path):
    """``await gateway_in_process(config_text, **options)`` -> an :class:`~llmgw.testing.gateway.InProcessGateway`:
    a Gateway run in the test's nursery on ephemeral 127.0.0.1 ports (``options``: those of
    :func:`~llmgw.testing.gateway.start_gateway_in_process`)."""
    from llmgw.testing.gateway import start_gateway_in_process

    async def start(config_text: str, **options):
        directory = tmp_path / f"gateway-{len(list(tmp_path.glob('gateway-*')))}"
        directory.mkdir()
        return await start_gateway_in_process(nursery, config_text, directory, **options)

    return start


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """A redis-server on an ephemeral 127.0.0.1 port for the whole session (started without trio: pytest-trio
    runs each test in a trio run of its own). Tests share it: each keeps to its own ``cluster_name``."""
    session = start_session_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield session.server
    finally:
        session.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis-server, ``redis://127.0.0.1:PORT``."""
    return redis_server.url


@pytest.fixture
def cluster_name(request) -> str:
    """A cluster name of this test's own (llmgw prefixes its Redis keys with it), from the test's node id."""
    return "test-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]


@pytest.fixture
async def private_redis(nursery, tmp_path) -> PrivateRedis:
    """A redis-server of this test's own on an ephemeral port, which it may ``await private_redis.kill()`` and
    ``await private_redis.restart()`` on the same port; stopped when the test ends."""
    return await start_private_redis(nursery, tmp_path / "redis")
