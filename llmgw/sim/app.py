"""One running simulator: the engine, the event publisher and the HTTP server, in one nursery.

:class:`Simulator` builds the parts from a :class:`~llmgw.sim.config.SimConfig`;
``await nursery.start(sim.run)`` serves until cancelled and reports
:class:`SimAddresses` (the bound HTTP port and the event endpoints), so tests
and the demo can embed simulators in-process as well as run ``llmgw sim``.
Cancelling the run closes the sockets and terminates the ZMQ context.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import trio
import zmq

from llmgw.http.server import serve_http
from llmgw.listening import host_port, listening_on

from .api import SimApi
from .blockhash import BlockHashing, event_hash_converter, none_hash_seed
from .cache import KVCacheManager
from .config import SimConfig, parse_drop_seqs
from .core import StepLoop, queue_size
from .publisher import EventPublisher, PublisherEndpoints
from .scheduler import Scheduler
from .startup import Startup

log = logging.getLogger(__name__)

FIRST_TOKENS_KEPT = 1000  # --debug-routes: the latest first tokens GET /debug/first_tokens lists
VLLM_VERSION = "0.32.0"  # the release whose behaviour the default (map) layout reproduces


@dataclass(frozen=True)
class SimAddresses:
    """Where a running simulator can be reached."""

    host: str
    port: int
    kv_events: str | None  # connectable PUB endpoint (or the endpoint it connects to)
    kv_replay: str | None

    @property
    def base_url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"


def advertised_host(bind_host: str, environ) -> str:
    """The host put in place of a wildcard in event endpoints (vLLM uses ``VLLM_HOST_IP``)."""
    explicit = environ.get("VLLM_HOST_IP")
    if explicit:
        return explicit
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::", "*") else bind_host


class Simulator:
    """The parts of one simulated vLLM server, and the task that runs them."""

    def __init__(self, config: SimConfig, environ: dict[str, str] | None = None):
        self.config = config.resolve()
        env = dict(os.environ if environ is None else environ)
        self.environ = env
        algo = config.prefix_caching_hash_algo
        to_event = event_hash_converter(env)
        self.hashing = None
        if config.enable_prefix_caching:
            self.hashing = BlockHashing(config.block_size, algo, none_hash_seed(algo, env), to_event)
        events_cfg = config.kv_events
        publishing = events_cfg.publishing
        assert config.num_blocks is not None  # resolve() filled it
        cache = KVCacheManager(config.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
                               enable_events=publishing, to_event=to_event)
        assert config.max_num_batched_tokens is not None  # resolve() filled it
        scheduler = Scheduler(cache, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              chunked_prefill=config.enable_chunked_prefill, policy=config.scheduling_policy,
                              long_prefill_token_threshold=config.long_prefill_token_threshold,
                              adaptive_long_prefill=config.long_prefill_token_threshold_adaptive)
        self._events_in = self._events_out = None
        if publishing:
            self._events_in, self._events_out = trio.open_memory_channel(queue_size(events_cfg.max_queue_size))
        self.core = StepLoop(scheduler, timing=config.timing(), time_scale=config.time_scale,
                             data_parallel_rank=config.data_parallel_rank, events_out=self._events_in,
                             suppress_events=frozenset(config.suppress_events),
                             strip_token_ids=config.no_event_token_ids,
                             first_tokens_kept=FIRST_TOKENS_KEPT if config.debug_routes else 0)
        self.loras = {m.name: m for m in config.lora_modules}
        self.created = int(time.time())
        self.vllm_version = VLLM_VERSION if config.event_layout == "map" else "0.23.0"
        self.publisher: EventPublisher | None = None
        self.endpoints: PublisherEndpoints | None = None
        self.addresses: SimAddresses | None = None
        self.startup = Startup(config.startup_seconds, config.hot_startup_seconds, config.time_scale)

    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        return self.core.reset_prefix_cache(reset_running_requests=reset_running_requests)

    def kv_event_sources(self) -> dict:
        """vLLM 0.31+'s ``/kv_event_sources``: ``{rank: resolved events config}``, empty when off."""
        if self.endpoints is None:
            return {}
        resolved = self.config.kv_events.as_dict()
        resolved["endpoint"] = self.endpoints.pub_configured
        resolved["replay_endpoint"] = self.endpoints.replay_configured
        return {str(self.config.data_parallel_rank): resolved}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        ctx = zmq.Context() if self._events_out is not None else None
        try:
            async with trio.open_nursery() as nursery:
                if ctx is not None:
                    drop = parse_drop_seqs(config.drop_event_seqs) if config.drop_event_seqs else None
                    self.publisher = EventPublisher(
                        ctx, config.kv_events, pub_endpoint=config.pub_endpoint,
                        replay_endpoint=config.replay_endpoint, layout=config.event_layout,
                        fields=config.event_fields, drop=drop,
                        advertise_host=advertised_host(config.host, self.environ))
                    with listening_on(" and ".join(filter(None, (config.pub_endpoint, config.replay_endpoint)))):
                        self.endpoints = await nursery.start(self.publisher.serve, self._events_out)
                nursery.start_soon(self.core.run)
                await self.startup.cold_start()
                with listening_on(host_port(config.host, config.port)):
                    host, port = await nursery.start(functools.partial(serve_http, SimApi(self).handle,
                                                                       config.host, config.port))
                self.addresses = SimAddresses(
                    host, port, self.endpoints.pub if self.endpoints else None,
                    self.endpoints.replay if self.endpoints else None)
                task_status.started(self.addresses)
        finally:
            if ctx is not None:
                ctx.term()
