"""The real-vLLM tier's shared pieces: vLLM's CPU build in its own virtualenv, and one cluster for the session.

``vllm_cluster`` is ``llmgw serve`` with its embedded agent running two vLLM
replicas (see :mod:`llmgw.bench.vllm_real`); the tier's tests share it, the
destructive ones last (test order is file order).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.bench.vllm_real import Gateway, install, start_cluster
from llmgw.testing.processes import free_port


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return install() / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_cluster(tmp_path_factory) -> Gateway:
    folder = tmp_path_factory.mktemp("vllm-cluster")
    gateway = start_cluster(folder, data_port=free_port(), control_port=free_port())
    try:
        gateway.wait_ready()
        yield gateway
    finally:
        gateway.close()
