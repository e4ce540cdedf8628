"""Two gateways of one cluster over two slow engines, for the tests of what gateways tell each other: ``llmgw sim``
engines that run two requests at a time, a control ``llmgw serve`` (a child process) and a ``--role gateway``
:class:`~llmgw.gateway.app.Gateway` in the test's own nursery (so the test reads its room and load sharing), on the
test's redis-server, signed with the cluster secret."""

from __future__ import annotations

from typing import Callable

import trio

from ..config.loading import parse_config
from ..gateway.app import Gateway
from .processes import CLUSTER_SECRET, CLUSTER_SECRET_ENV, Child
from .shared_state import StartServe, cluster_config, wait_replicas
from .sims import MODEL, start_sims


async def control_and_gateway(nursery: trio.Nursery, start_serve: StartServe, redis_url: str, cluster: str,
                              set_env: Callable[[str, str], None], output_tokens: int = 200) -> tuple[Child, Gateway]:
    """The control process and the in-process gateway, once the gateway routes both engines. Each answer is
    ``output_tokens`` long at 20 ms a step (200: a stream stays in flight about 4 s). ``set_env(name, value)``
    sets this process's environment for the test only (pytest's ``monkeypatch.setenv``): the cluster secret."""
    engines = await start_sims(nursery, 2, num_blocks=512, block_size=16, time_scale=1, seed=0,
                               extra=("--max-num-seqs", "2", "--output-tokens", f"{output_tokens}:{output_tokens}"))
    config = cluster_config(engines, redis_url, cluster, routing="round_robin")
    control = await start_serve(config)
    await wait_replicas(control.control_url, 2)
    set_env(CLUSTER_SECRET_ENV, CLUSTER_SECRET)
    gateway = Gateway(parse_config(config), role="gateway")
    await nursery.start(gateway.run, ("127.0.0.1", 0), ("127.0.0.1", 0))
    with trio.fail_after(20):
        while len(gateway.router.replicas.members(MODEL)) < 2:
            await trio.sleep(0.05)
    return control, gateway
