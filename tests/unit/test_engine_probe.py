"""The one engine probe (``llmgw.engines.probe``): gauges read from Prometheus text with the names an engine
plugin gives, health checks against real servers on 127.0.0.1, and the router's use of both."""

from __future__ import annotations

import trio
from hypothesis import given, strategies as st

from llmgw.config import parse_config
from llmgw.engines import probe
from llmgw.engines.probe import (
    NO_GAUGES,
    VLLM_GAUGES,
    EngineGauges,
    engine_gauges,
    parse_block_size,
    parse_gauge_sum,
    parse_load,
)
from llmgw.hookspecs import hookimpl
from llmgw.http.client import UpstreamPool
from llmgw.http.messages import Response
from llmgw.http.server import HttpServer
from llmgw.plugins.engine_sim import SimEngine
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.health import HealthSettings, probe_once
from llmgw.router.load_scraper import scrape_once
from llmgw.router.replica import Replica
from llmgw.testing.deployed import deploy_ready
from llmgw.testing.processes import free_port

RUNNING, WAITING = VLLM_GAUGES.running, VLLM_GAUGES.waiting

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 100.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1e1
"""

# An engine that names its gauges its own way: two waiting queues, and its block size in another label.
ODD = EngineGauges(running=("odd_active",), waiting=("odd_queued", "odd_swapped"), cache_config="odd_cache",
                   block_size_label="page")
ODD_TEXT = ('odd_active{rank="0"} 4\nodd_active{rank="1"} 1\nodd_queued 2\nodd_swapped 3\n'
            'odd_cache{page="32"} 1\n' + VLLM_TEXT)


def test_samples_of_every_engine_are_summed_and_longer_names_are_not_confused():
    assert parse_gauge_sum(VLLM_TEXT, RUNNING) == 5.0
    assert parse_gauge_sum(VLLM_TEXT, WAITING) == 17.0
    assert parse_gauge_sum(VLLM_TEXT, VLLM_GAUGES.inflight) == 22.0


def test_in_flight_gauges_are_summed_over_labels_and_timestamps_are_ignored():
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0',
        'vllm:num_requests_running{engine="1",model_name="a {weird} name"} 1.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0 1700000000000',
        "vllm:num_requests_waiting_by_reason 7.0",
        "vllm:kv_cache_usage_perc 0.5",
    ])
    assert parse_gauge_sum(text, VLLM_GAUGES.inflight) == 6.0


def test_a_missing_metric_or_a_bad_value_is_none_not_zero():
    assert parse_gauge_sum("# nothing here\n", RUNNING) is None
    assert parse_gauge_sum("", VLLM_GAUGES.inflight) is None
    assert parse_gauge_sum("vllm:num_requests_running NaNx\n", RUNNING) is None
    assert parse_gauge_sum("vllm:num_requests_running 4\n", RUNNING) == 4.0


def test_the_block_size_is_read_from_vllms_cache_config_info():
    info = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="2000"} 1.0\n')
    assert parse_block_size(VLLM_TEXT + info) == 32
    assert parse_block_size(VLLM_TEXT) is None
    assert parse_block_size('vllm:cache_config_info{engine="0",block_size="16"} 1.0\n') == 16
    assert parse_block_size('vllm:cache_config_info{xblock_size="16"} 1.0\n') is None  # another label
    for bad in ('"0"', '"-1"', '"abc"', '"99999999999"', '"16'):
        assert parse_block_size(f'vllm:cache_config_info{{block_size={bad}}} 1.0\n') is None


@given(st.text(max_size=300))
def test_any_exposition_text_gives_a_block_size_or_none(text):
    size = parse_block_size(text)
    assert size is None or 0 < size <= 1 << 16
    size = parse_block_size("vllm:cache_config_info{" + text)
    assert size is None or 0 < size <= 1 << 16


def test_the_load_is_read_with_the_names_the_engine_gives():
    odd = parse_load(ODD_TEXT, ODD, at=7.0)
    assert (odd.running, odd.waiting, odd.at, odd.block_size) == (5.0, 5.0, 7.0, 32)
    vllm = parse_load(ODD_TEXT, VLLM_GAUGES, at=7.0)
    assert (vllm.running, vllm.waiting, vllm.block_size) == (5.0, 17.0, None)
    assert parse_load("odd_queued 2\n", ODD, at=0.0).running == 0.0  # one of the two is enough
    assert parse_load(VLLM_TEXT, ODD, at=0.0) is None  # none of its gauges: no load, not an idle engine
    assert parse_load(ODD_TEXT, NO_GAUGES, at=0.0) is None and NO_GAUGES.inflight == ()


# -- the engine plugin names the gauges -------------------------------------------------------------------------------


class OddEngine(SimEngine):
    name = "odd"

    def load_gauges(self) -> EngineGauges:
        return ODD


class OddPlugin:
    @hookimpl
    def register_engines(self):
        return {"odd": OddEngine}


def odd_registry():
    return build_registry(make_plugin_manager((OddPlugin(),)))


def test_an_engines_gauges_come_from_its_plugin_and_vllms_are_the_default():
    registry = odd_registry()
    assert engine_gauges(registry, "odd") == ODD
    assert engine_gauges(registry, "vllm") == engine_gauges(registry, "sim") == VLLM_GAUGES
    assert engine_gauges(registry, "not-installed") == VLLM_GAUGES
    assert Replica(name="static", model="m", url="http://127.0.0.1:1").gauges == VLLM_GAUGES


def test_a_deployed_replica_is_read_with_its_engine_plugins_gauges():
    registry = odd_registry()
    config = parse_config("""
agents: {token: t}
profiles:
  - {name: odd, engine: odd, model_path: tiny, served_model_name: tiny-odd}
  - {name: sim, engine: sim, model_path: tiny, served_model_name: tiny-sim}
deployments:
  - {profile: odd, replicas: 1}
  - {profile: sim, replicas: 1}
""")
    replicas = deploy_ready(config, registry)
    assert {r.model: r.gauges for r in replicas} == {"tiny-odd": ODD, "tiny-sim": VLLM_GAUGES}


# -- asking real servers ----------------------------------------------------------------------------------------------


async def start_engine(nursery, answers: dict[str, tuple[int, bytes]], *, silent: bool = False):
    """An HTTP server on 127.0.0.1 answering ``answers[path]`` (never, when ``silent``); (port, paths asked)."""
    asked: list[str] = []

    async def handler(request):
        asked.append(request.path)
        if silent:
            await trio.sleep_forever()
        status, body = answers.get(request.path, (404, b""))
        return Response(status, [(b"content-type", b"text/plain")], body)

    _, port = await nursery.start(HttpServer(handler).serve, "127.0.0.1", 0)
    return port, asked


async def test_health_is_a_200_and_says_how_a_failure_failed(nursery):
    up, _ = await start_engine(nursery, {"/health": (200, b"")})
    broken, _ = await start_engine(nursery, {"/health": (503, b"")})
    busy, _ = await start_engine(nursery, {}, silent=True)
    closed = free_port()
    with trio.fail_after(20):
        async def check(port: int, timeout: float = 5.0) -> probe.Health:
            pool = UpstreamPool("127.0.0.1", port, connect_timeout=timeout)
            try:
                return await probe.check_health(pool, "/health", timeout)
            finally:
                await pool.aclose()

        assert await check(up) == probe.Health(True)
        assert await check(broken) == probe.Health(False, "HTTP 503", definite=True, answered=True)
        slow = await check(busy, timeout=0.3)
        assert (slow.ok, slow.reason, slow.definite, slow.answered) == (False, "no answer within 0.3s", False,
                                                                       False)
        refused = await check(closed)
        assert (refused.ok, refused.definite, refused.answered) == (False, True, False) and refused.reason


async def test_a_4xx_is_unhealthy_but_not_definite(nursery):
    port, _ = await start_engine(nursery, {})
    pool = UpstreamPool("127.0.0.1", port, connect_timeout=5.0)
    with trio.fail_after(20):
        assert await probe.check_health(pool, "/health", 5.0) == probe.Health(False, "HTTP 404", definite=False)
        assert await probe.read_metrics(pool, "/metrics", 5.0) is None  # not a 200: nothing to read
    await pool.aclose()


async def test_the_router_probes_and_scrapes_a_replica_with_its_gauges(nursery):
    port, asked = await start_engine(nursery, {"/health": (200, b""), "/metrics": (200, ODD_TEXT.encode())})
    odd = Replica(name="odd", model="m", url=f"http://127.0.0.1:{port}", gauges=ODD)
    static = Replica(name="static", model="m", url=f"http://127.0.0.1:{port}")
    for replica in (odd, static):
        replica.pool = replica.open_pool(5.0)
    with trio.fail_after(20):
        assert await probe_once(odd, HealthSettings(timeout=5.0)) == (True, "ok")
        load = await scrape_once(odd, 5.0, clock=lambda: 3.0)
        assert (load.running, load.waiting, load.at, load.block_size) == (5.0, 5.0, 3.0, 32)
        load = await scrape_once(static, 5.0)
        assert (load.running, load.waiting) == (5.0, 17.0)  # vLLM's names by default
    assert asked == ["/health", "/metrics", "/metrics"]
    for replica in (odd, static):
        await replica.pool.aclose()
