"""A :class:`~llmgw.gateway.app.Gateway` run inside the test's own trio nursery, on ephemeral 127.0.0.1 ports.

No child process: the test reaches the gateway's objects (router, metrics,
control plane) directly, and :class:`InProcessGateway` sends it requests over
real sockets. Cancelling the nursery stops it. A plugin's test registers its
plugin with ``registry`` (see :func:`llmgw.plugins_manager.build_registry`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from ..gateway.app import Addresses, Gateway
from ..plugins_manager import Registry, load_checked_config
from .metrics import metric_value, scrape


@dataclass(eq=False)
class InProcessGateway:
    """A running in-process gateway and an HTTP client for it."""

    gateway: Gateway
    addresses: Addresses
    http: httpx.AsyncClient

    @property
    def url(self) -> str:
        """The OpenAI endpoint's base URL (``http://127.0.0.1:PORT``)."""
        return self.addresses.data_url

    @property
    def control_url(self) -> str:
        return self.addresses.control_url

    async def post(self, path: str, body: dict, **options) -> httpx.Response:
        """POST JSON ``body`` to the OpenAI endpoint's ``path`` (``/v1/chat/completions``...)."""
        return await self.http.post(self.url + path, json=body, **options)

    async def chat(self, content: str = "hello", *, model: str = "tiny", **fields) -> httpx.Response:
        """One chat completion of one user message; ``fields`` go into the body (``max_tokens``, ``stream``...)."""
        return await self.post("/v1/chat/completions",
                               {"model": model, "messages": [{"role": "user", "content": content}], **fields})

    async def admin(self, path: str, method: str = "GET", **options) -> httpx.Response:
        """A request to the control API (``/admin/replicas``, ``/admin/reload``...)."""
        return await self.http.request(method, self.control_url + path, **options)

    async def metric(self, name: str, labels: str = "") -> float:
        """A sample of the gateway's ``/metrics`` (:func:`llmgw.testing.metrics.metric_value`)."""
        return metric_value(await scrape(self.control_url, self.http), name, labels)


async def start_gateway_in_process(nursery: trio.Nursery, config_text: str, directory: str | os.PathLike, *,
                                   registry: Registry | None = None, verify: bool | str = True,
                                   **gateway_options) -> InProcessGateway:
    """Write ``config_text`` to ``directory``/llmgw.yaml (so ``reload`` re-reads it), build a Gateway from it
    and run it in ``nursery`` on 127.0.0.1 with ephemeral ports (the config's own listen addresses are
    ignored). ``verify``: the client's TLS verification (a CA file for a ``data_tls`` listener);
    ``gateway_options`` go to :class:`Gateway` (``embedded_discovery``...). Its client closes with the nursery."""
    path = Path(directory) / "llmgw.yaml"
    path.write_text(config_text)
    gateway = Gateway(load_checked_config(path, registry), registry, **gateway_options)
    return await run_in_process(nursery, gateway, verify=verify)


async def run_in_process(nursery: trio.Nursery, gateway: Gateway, ports: tuple[int, int] = (0, 0), *,
                         verify: bool | str = True) -> InProcessGateway:
    """Run ``gateway`` in ``nursery`` on 127.0.0.1's ``ports`` (data, control; 0: ephemeral, the default; fixed
    ones let agents reconnect to a gateway started again). Its client closes with the nursery."""
    addresses = await nursery.start(gateway.run, ("127.0.0.1", ports[0]), ("127.0.0.1", ports[1]))
    http = httpx.AsyncClient(timeout=10, verify=verify)
    nursery.start_soon(_close_when_cancelled, http)
    return InProcessGateway(gateway, addresses, http)


async def _close_when_cancelled(http: httpx.AsyncClient) -> None:
    try:
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await http.aclose()
