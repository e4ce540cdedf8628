"""Shared fixtures: real child processes on 127.0.0.1 with ephemeral ports, owned by the test's nursery."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmgw.processes import Child, run_child, start_serve

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
        argv = [sys.executable, "-m", "llmgw.bench.fake_upstream", "--name", name, "--port", str(port),
                "--chunks", str(chunks), "--model", model, "--status", str(status), *extra]
        return await nursery.start(lambda task_status: run_child(argv, name=f"fake-{name}", task_status=task_status))

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
