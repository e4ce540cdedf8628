"""``llmgw serve``: run the gateway from a config file, or a self-contained demo without one.

The demo starts simulator engines as child processes and routes a model
``tiny`` across them, so a newcomer gets a working OpenAI endpoint on any
laptop. SIGINT/SIGTERM drain gracefully (a second signal stops at once).
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys

import trio

from ..config import ConfigError, HostPort, load_config, parse_config
from ..processes import llmgw_command, run_child

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


def demo_config_text(urls: list[str]) -> str:
    replicas = "\n".join(f"      - url: {url}\n        name: sim-{i}" for i, url in enumerate(urls))
    return (f"# the demo: no config was given, so llmgw started {len(urls)} simulator engines\n"
            f"models:\n  - name: {DEMO_MODEL}\n    routing: round_robin\n    replicas:\n{replicas}\n")


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
    try:
        trio.run(serve, config, listen, control_listen, args.demo_replicas)
    except ConfigError as exc:
        print(f"llmgw serve: {exc}", file=sys.stderr)
        return 2
    return 0


async def serve(config, listen, control_listen, demo_replicas: int = 2) -> None:
    from ..app import Gateway

    async with trio.open_nursery() as nursery:
        if config is None:
            urls = []
            for i in range(demo_replicas):
                child = await nursery.start(functools.partial(run_child, llmgw_command(
                    "sim", "--port", "0", "--served-model-name", DEMO_MODEL, "--seed", str(i)), name=f"sim-{i}"))
                urls.append(child.url)
            text = demo_config_text(urls)
            config = parse_config(text, filename="<demo>")
            log.info("demo mode:\n%s", text)
        gateway = Gateway(config)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            addresses = await nursery.start(gateway.run, listen and (listen.host, listen.port),
                                            control_listen and (control_listen.host, control_listen.port))
            print(f"llmgw listening on {addresses.data_url} (control: {addresses.control_url})", flush=True)
            async for signum in signals:
                if gateway.draining:
                    log.warning("second %s: stopping now", signal.Signals(signum).name)
                    break
                log.info("%s: draining (send it again to stop at once)", signal.Signals(signum).name)
                nursery.start_soon(_shutdown, gateway, nursery)
        nursery.cancel_scope.cancel()


async def _shutdown(gateway, nursery: trio.Nursery) -> None:
    await gateway.shutdown()
    nursery.cancel_scope.cancel()
