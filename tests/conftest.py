"""Fixtures of every test: real child processes on 127.0.0.1 with ephemeral ports, owned by the test's nursery
(started with :mod:`llmgw.testing`), and a gateway run in the test's own nursery."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.testing.processes import Child, start_serve
from llmgw.testing.sims import start_fake_upstream as start_fake_upstream_in

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_state_home(tmp_path, monkeypatch):
    """Default state folders (the control plane's node identities, agents' ledgers) in the test's own tmp_path,
    never the user's home, and never shared between tests (node ids repeat across tests)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))


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
