"""``llmgw serve``: run the gateway from a config file, or a self-contained demo without one.

The demo is a cluster of one: an embedded agent (in-process, CPU discovery)
runs a ``sim`` profile with ``--demo-replicas`` replicas of model ``tiny``, so
a newcomer gets a working OpenAI endpoint on any laptop. Its state lives in a
temporary folder and its engines are stopped at exit (a real agent's engines
outlive it). SIGINT/SIGTERM drain gracefully (a second signal stops at once);
SIGHUP reloads the config file.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import tempfile

import trio

from ..config import ConfigError, HostPort, load_config, parse_config

log = logging.getLogger("llmgw.serve")
DEMO_MODEL = "tiny"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", "-c", help="YAML config file (without it: the demo)")
    parser.add_argument("--listen", help="HOST:PORT of the OpenAI endpoint (overrides the config)")
    parser.add_argument("--control-listen", help="HOST:PORT of /health, /metrics, /admin (overrides the config)")
    parser.add_argument("--demo-replicas", type=int, default=2, help="simulator replicas the demo starts (default 2)")
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error (default: config or info)")
    return parser


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def demo_config_text(replicas: int, state_dir: str) -> str:
    return (f"# the demo: no config was given, so llmgw runs an embedded agent with {replicas} simulated engines\n"
            f"agents:\n  embedded: true\n  node_id: demo\n  state_dir: {state_dir}\n"
            f"profiles:\n  - name: tiny-sim\n    engine: sim\n    model_path: {DEMO_MODEL}\n"
            f"    served_model_name: {DEMO_MODEL}\n    routing: round_robin\n"
            f"deployments:\n  - profile: tiny-sim\n    replicas: {replicas}\n")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        listen = HostPort.parse(args.listen) if args.listen else None
        control_listen = HostPort.parse(args.control_listen) if args.control_listen else None
        config = load_config(args.config) if args.config else None
    except (ConfigError, ValueError) as exc:
        print(f"llmgw serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level or (config.log_level if config else "info"))
    refused = []
    try:
        trio.run(serve, config, listen, control_listen, args.demo_replicas)
    except* ConfigError as group:  # raised by the gateway's start-up, perhaps inside a nursery's group
        refused = list(_leaves(group))
    for exc in refused:
        print(f"llmgw serve: {exc}", file=sys.stderr)
    return 2 if refused else 0


def _leaves(group: BaseExceptionGroup):
    for exc in group.exceptions:
        yield from _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]


async def serve(config, listen, control_listen, demo_replicas: int = 2) -> None:
    if config is not None:
        await _serve(config, listen, control_listen)
        return
    with tempfile.TemporaryDirectory(prefix="llmgw-demo-") as state_dir:
        text = demo_config_text(demo_replicas, state_dir)
        log.info("demo mode:\n%s", text)
        await _serve(parse_config(text, filename="<demo>"), listen, control_listen, demo_replicas=demo_replicas)


async def _serve(config, listen, control_listen, demo_replicas: int | None = None) -> None:
    from ..app import Gateway

    demo = demo_replicas is not None
    gateway = Gateway(config, embedded_discovery="cpu" if demo else "auto", stop_engines_on_exit=demo)
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            addresses = await nursery.start(gateway.run, listen and (listen.host, listen.port),
                                            control_listen and (control_listen.host, control_listen.port))
            if demo:
                await _wait_for_replicas(gateway, demo_replicas)
            # Start-up objects live for the whole run: keep the collector from walking them again and again
            # (full collections took 40-70 ms here and showed up in request p99).
            gc.collect()
            gc.freeze()
            print(f"llmgw listening on {addresses.data_url} (control: {addresses.control_url})", flush=True)
            async for signum in signals:
                if signum == signal.SIGHUP:
                    log.info("SIGHUP: reloading %s", config.source)
                    nursery.start_soon(gateway.reload)
                    continue
                if gateway.draining:
                    log.warning("second %s: stopping now", signal.Signals(signum).name)
                    break
                log.info("%s: draining (send it again to stop at once)", signal.Signals(signum).name)
                nursery.start_soon(_shutdown, gateway, nursery)
        if gateway.stop_engines_on_exit:  # stopping at once: the demo still leaves no engine behind
            await gateway.stop_embedded_shards()
        nursery.cancel_scope.cancel()


async def _wait_for_replicas(gateway, count: int, timeout: float = 30.0) -> None:
    """Until ``count`` replicas of the demo model are routable (a newcomer's first request then succeeds)."""
    with trio.move_on_after(timeout):
        while sum(1 for r in gateway.router.all_replicas() if r.model == DEMO_MODEL and r.routable) < count:
            await trio.sleep(0.05)


async def _shutdown(gateway, nursery: trio.Nursery) -> None:
    await gateway.shutdown()
    nursery.cancel_scope.cancel()
