"""``llmgw serve``: run the gateway from a config file, or a self-contained demo without one.

The demo is a cluster of one: an embedded agent (in-process, CPU discovery)
runs a ``sim`` profile with ``--demo-replicas`` replicas of model ``tiny``,
with KV events and the ``kv_index`` tier, so a newcomer gets a working,
KV-aware OpenAI endpoint on any laptop. Its state lives in a
temporary folder and its engines are stopped at exit (a real agent's engines
outlive it). SIGINT/SIGTERM drain gracefully (a second signal stops at once);
SIGHUP reloads the config file (never confirming a reload that removes everything: see
:mod:`llmgw.gateway.reload_guard`).

With ``--workers N`` (N > 1) this process becomes the supervisor of N such processes sharing the data port
(:mod:`llmgw.workers`); each of them is an ``llmgw serve`` started with the internal ``--worker`` flags.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import tempfile
from functools import partial

import trio

from ..compiled import describe as describe_compiled
from ..config import ConfigError, HostPort, parse_config
from ..control.identity import IdentityStoreError
from ..fdlimit import raise_open_files_limit
from ..logsetup import add_logging_arguments, setup_logging
from ..plugins_manager import load_checked_config
from ..sim.profiles import DEFAULT_PROFILE
from ..usererrors import run_reporting
from ..workers.plan import add_worker_arguments

log = logging.getLogger("llmgw.serve")
DEMO_MODEL = "tiny"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", "-c", help="YAML config file (without it: the demo)")
    parser.add_argument("--listen", help="HOST:PORT of the OpenAI endpoint (overrides the config)")
    parser.add_argument("--control-listen", help="HOST:PORT of /health, /metrics, /admin (overrides the config)")
    parser.add_argument("--role", choices=("control", "gateway"), default="control",
                        help="with state.backend redis: 'control' (the default) runs the control plane and writes the "
                             "cluster's shared state, 'gateway' only serves requests and follows it (docs/scaling.md)")
    parser.add_argument("--demo-replicas", type=int, default=2, help="simulator replicas the demo starts (default 2)")
    parser.add_argument("--stop-engines", action="store_true",
                        help="stop the embedded agent's engines at exit (by default they keep running, to be adopted "
                             "by the next start; 'llmgw down --config FILE' stops them later)")
    add_worker_arguments(parser)
    add_logging_arguments(parser, default_level=None, default_format=None, source="the config's, else info/text")
    return parser


def demo_config_text(replicas: int, state_dir: str) -> str:
    return (f"# the demo: no config was given, so llmgw runs an embedded agent with {replicas} simulated engines\n"
            f"agents:\n  embedded: true\n  node_id: demo\n  state_dir: {state_dir}\n"
            f"profiles:\n  - name: tiny-sim\n    engine: sim\n    model_path: {DEMO_MODEL}\n"
            f"    served_model_name: {DEMO_MODEL}\n    kv_events: true\n    routing: kv_index\n"
            f"    args: [--profile, {DEFAULT_PROFILE}]  # a GPU: decode cost, KV capacity (constant: fixed rates)\n"
            f"deployments:\n  - profile: tiny-sim\n    replicas: {replicas}\n")


def demo_hints(addresses) -> str:
    """Three commands that show the demo's KV-aware routing at work."""
    data, control = addresses.data_url, addresses.control_url
    # Each command stays on one line, to be copied as it is.
    return f"""
Try the KV-aware routing (kv_index: the engines' own cache events tell llmgw where each prefix is):
  python3 -c 'import json; print(json.dumps({{"model": "{DEMO_MODEL}", "max_tokens": 16, "messages": [{{"role": "user", "content": "Tell me about llamas. " * 300}}]}}))' > /tmp/llmgw-long.json
  # 1. send it twice: the second lands on the replica that holds its prefix (same x-llmgw-replica), mostly cached
  curl -s -D- -o /dev/null {data}/v1/chat/completions -H 'content-type: application/json' -d @/tmp/llmgw-long.json | grep -i x-llmgw-replica
  # 2. why: each replica's cached leading blocks and the pick, without sending the request
  curl -s {control}/admin/explain -H 'content-type: application/json' -d @/tmp/llmgw-long.json
  # 3. predicted vs actual cached tokens (the engines' own usage) and decisions by outcome
  curl -s {control}/metrics | grep -E '^llmgw_(route_(predicted|actual)_cached_tokens|routing_decisions)_total'
"""  # noqa: E501


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.workers > 1 and not args.config:
        print("llmgw serve: --workers needs --config (the demo runs as one process)", file=sys.stderr)
        return 2
    adjust_config = None
    try:
        listen = HostPort.parse(args.listen) if args.listen else None
        control_listen = HostPort.parse(args.control_listen) if args.control_listen else None
        config = load_checked_config(args.config) if args.config else None
        if config is not None and args.worker_state:  # a worker of --workers: the supervisor's private Redis
            from ..workers.worker import with_private_state

            adjust_config = partial(with_private_state, url=args.worker_state)
            config = adjust_config(config)
    except (ConfigError, ValueError) as exc:
        print(f"llmgw serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level or (config.log_level if config else "info"),
                  args.log_format or (config.log_format if config else "text"), worker=args.worker)
    refused: list[BaseException] = []
    code = 0

    def run() -> int:
        if args.workers == 1:
            trio.run(partial(serve, config, listen, control_listen, args.demo_replicas, args.stop_engines, args.role,
                             worker=args.worker, adjust_config=adjust_config))
            return 0
        from ..workers.command import run_workers

        assert config is not None, "--workers needs --config (checked above)"
        return run_workers(config, args.workers, listen, control_listen, args.role, args.state_dir,
                           args.stop_engines, args.log_level, args.log_format)

    codes: list[int] = []
    try:
        code = run_reporting("llmgw serve", lambda: codes.append(run()))
    except* (ConfigError, IdentityStoreError) as group:  # raised at start-up, perhaps inside a nursery's group
        refused = list(_leaves(group))
    for error in refused:
        print(f"llmgw serve: {error}", file=sys.stderr)
    return 2 if refused else code or (codes[0] if codes else 0)


def _leaves(group: BaseExceptionGroup):
    for exc in group.exceptions:
        yield from _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]


async def serve(config, listen, control_listen, demo_replicas: int = 2, stop_engines: bool = False,
                role: str = "control", worker: int | None = None, adjust_config=None) -> None:
    """``worker``: this process is that worker of an ``llmgw serve --workers`` supervisor (:mod:`llmgw.workers`);
    ``adjust_config``: applied to the config at each reload, as it was to ``config``."""
    if config is not None:
        gateway = await _serve(config, listen, control_listen, stop_engines=stop_engines, role=role, worker=worker,
                               adjust_config=adjust_config)
        _say_what_keeps_running(gateway)
        return
    with tempfile.TemporaryDirectory(prefix="llmgw-demo-") as state_dir:
        text = demo_config_text(demo_replicas, state_dir)
        log.info("demo: %d simulated engines of model %r on an embedded agent (state in %s)", demo_replicas,
                 DEMO_MODEL, state_dir)
        log.debug("the demo's config:\n%s", text)
        await _serve(parse_config(text, filename="<demo>"), listen, control_listen, demo_replicas=demo_replicas)


async def _serve(config, listen, control_listen, demo_replicas: int | None = None, stop_engines: bool = False,
                 role: str = "control", worker: int | None = None, adjust_config=None):
    from ..gateway.app import Gateway

    demo = demo_replicas is not None
    open_files = raise_open_files_limit()  # before the gateway sizes its connection caps from it
    gateway = Gateway(config, embedded_discovery="cpu" if demo else "auto", stop_engines_on_exit=demo or stop_engines,
                      role=role, adjust_config=adjust_config)
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            addresses = await nursery.start(partial(gateway.run, listen and (listen.host, listen.port),
                                                    control_listen and (control_listen.host, control_listen.port),
                                                    reuse_port=worker is not None))
            # the gateway's connection-caps line gives the figure; a raise is worth a line of its own
            (log.info if open_files.raised else log.debug)("%s", open_files.describe())
            if demo_replicas is not None:
                await _wait_for_replicas(gateway, demo_replicas)
            if worker is not None:
                from ..workers.worker import wait_until_following

                # Worker 0 runs the control plane: the last one needing the private Redis (if any) at the end.
                private_redis = gateway.config.state.url if worker == 0 and adjust_config is not None else None
                nursery.start_soon(_drain_when_orphaned, gateway, nursery, private_redis)
                await wait_until_following(gateway)
            # Start-up objects live for the whole run: keep the collector from walking them again and again
            # (full collections took 40-70 ms here and showed up in request p99).
            gc.collect()
            gc.freeze()
            compiled, warn = describe_compiled()
            (log.warning if warn else log.info)("%s", compiled)
            print(f"llmgw listening on {addresses.data_url} (control: {addresses.control_url})", flush=True)
            if demo:
                print(demo_hints(addresses), flush=True)
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
    return gateway


def _say_what_keeps_running(gateway) -> None:
    """At exit: the embedded agent's engines that keep running (for the next start to adopt), and how to stop them."""
    from ..agent.leftover import running_engines

    if gateway.embedded_agent is None:
        return
    left = len(running_engines(gateway.embedded_agent.state_dir))
    if left:
        print(f"llmgw serve stopped; {left} engine{'s keep' if left > 1 else ' keeps'} running for the next "
              f"'llmgw serve --config {gateway.config.source}' to adopt; stop "
              f"{'them' if left > 1 else 'it'} with: llmgw down --config {gateway.config.source}", flush=True)


async def _wait_for_replicas(gateway, count: int, timeout: float = 30.0) -> None:
    """Until ``count`` replicas of the demo model are routable (a newcomer's first request then succeeds)."""
    with trio.move_on_after(timeout):
        while sum(1 for r in gateway.replicas.members(DEMO_MODEL) if r.routable) < count:
            await trio.sleep(0.05)


async def _drain_when_orphaned(gateway, nursery: trio.Nursery, private_redis: str | None) -> None:
    """A worker: drain and exit once the supervisor is gone (its lifeline, stdin, ended); ``private_redis``: the
    supervisor's redis-server, to stop then (worker 0's job)."""
    from ..workers.worker import stop_private_redis, watch_lifeline

    await watch_lifeline()
    if gateway.draining:
        return
    log.warning("the --workers supervisor is gone: draining")
    await gateway.shutdown()
    if private_redis is not None:
        await stop_private_redis(private_redis)
    nursery.cancel_scope.cancel()


async def _shutdown(gateway, nursery: trio.Nursery) -> None:
    await gateway.shutdown()
    nursery.cancel_scope.cancel()
