"""``llmgw agent``: join a control plane and run the engine shards it places on this machine.

The agent dials out (``--join http://CONTROL:PORT``), registers with the join
token, reports the engines it already runs (from its ledger in
``--state-dir``), and keeps them running across its own restarts and the
control plane's: stopping the agent (SIGINT/SIGTERM) leaves its engines
running for the next agent to adopt. It prints one line per connection
change: ``llmgw-agent NODE connected to URL``, ``... disconnected ...``,
``... refused ...`` (exit code 3).

On its first join the control plane issues the node a secret, kept in
``STATE_DIR/node-secret``: later connections prove it, and the join token
alone no longer opens this node id. ``--join wss://...`` dials over TLS,
trusting the control plane's certificate as ``--ca-file`` (default: the
system store), with ``--client-cert``/``--client-key`` for mutual TLS.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Callable, TypeVar

import trio

from .. import listening
from ..config.addresses import parse_port_range
from ..fdlimit import raise_open_files_limit
from ..logsetup import add_logging_arguments, setup_logging
from ..tls import TlsClientOptions
from ..usererrors import run_reporting
from ..wire.channel import Connector, FailoverConnector, WebSocketConnector

log = logging.getLogger("llmgw.agent")
T = TypeVar("T")
EXIT_REFUSED = 3
MAX_JOIN_URLS = 16


def join_connector(join: str, tls: TlsClientOptions | None) -> Connector:
    """How the agent dials ``--join``: one URL, or several (comma-separated: a cluster's candidates, the agent
    follows the leader among them); ValueError for none or too many."""
    urls = [url.strip() for url in join.split(",") if url.strip()]
    if not urls or len(urls) > MAX_JOIN_URLS:
        raise ValueError(f"--join takes 1 to {MAX_JOIN_URLS} comma-separated URLs, not {len(urls)}")
    connectors = [WebSocketConnector(url, tls=tls) for url in urls]
    return connectors[0] if len(connectors) == 1 else FailoverConnector(connectors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--join", required=True, metavar="URL[,URL...]",
                        help="the control plane's control listener, e.g. http://10.0.0.1:8001; in a cluster with "
                             "leader election, the candidates' (comma-separated): the agent joins the leader")
    parser.add_argument("--token", default=os.environ.get("LLMGW_AGENT_TOKEN"),
                        help="the join token (agents.token of the control plane; default: $LLMGW_AGENT_TOKEN)")
    parser.add_argument("--node-id", default=None, help="this node's id (default: the hostname)")
    parser.add_argument("--state-dir", default=None,
                        help="where the shard ledger and engine logs live (default: "
                             "$XDG_STATE_HOME/llmgw/agent-NODE)")
    parser.add_argument("--discovery", default="auto", metavar="auto|cpu|nvml|fixture:PATH",
                        help="how to describe this node (default auto: NVML when a driver answers, else CPU only)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="a node label placement can select on (repeatable)")
    parser.add_argument("--address", default=None,
                        help="the address other machines and the router dial this node's engines at "
                             "(default: the local address that reaches the control plane)")
    parser.add_argument("--engine-ports", default=None, metavar="LOW-HIGH",
                        help="the range engines' HTTP ports are taken from, e.g. 21000-21999 (default 20000-32000; "
                             "keep it out of the kernel's ephemeral range, net.ipv4.ip_local_port_range)")
    parser.add_argument("--stop-engines", action="store_true",
                        help="stop this node's engines when the agent exits (by default they keep running, to be "
                             "adopted by the next agent on the state dir; 'llmgw down --state-dir DIR' stops them)")
    add_logging_arguments(parser)
    parser.add_argument("--ca-file", default=None,
                        help="wss:// only: the CA bundle that signed the control plane's certificate "
                             "(default: the system trust store)")
    parser.add_argument("--client-cert", default=None, help="wss:// only: a client certificate (PEM) for mutual TLS")
    parser.add_argument("--client-key", default=None, help="wss:// only: the client certificate's key (PEM)")
    parser.add_argument("--insecure-skip-verify", action="store_true",
                        help="wss:// only: do not verify the control plane's certificate (anyone on the path can "
                             "then read the join token, the node secret and every shard's secrets)")
    parser.add_argument("--kv-max-message-size", default=None, metavar="SIZE",
                        help="largest KV-event message taken from an engine, e.g. 64MiB (default 32MiB); a peer "
                             "sending a larger one is disconnected")
    return parser


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {item!r}: expected KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels


def optional_flag(flag: str, text: str | None, parse: Callable[[str], T]) -> T | None:
    """``parse(text)``, or None when the flag was not given; a ValueError names the flag and its value."""
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc}") from None


def parse_kv_message_size(text: str | None) -> int | None:
    from ..kv.subscriber import message_size_setting

    return optional_flag("--kv-max-message-size", text, message_size_setting)


def warn_if_ephemeral(engine_ports: tuple[int, int] | None) -> None:
    """One WARNING when the engines' ports overlap the ports the kernel gives outgoing connections."""
    from ..agent.ports import DEFAULT_ENGINE_PORTS, ephemeral_overlap

    low, high = engine_ports or DEFAULT_ENGINE_PORTS
    overlap = ephemeral_overlap(low, high)
    if overlap is not None:
        log.warning("--engine-ports %d-%d overlaps the kernel's ephemeral ports %d-%d: an outgoing connection can "
                    "hold a port an engine needs (its start then fails and is retried on another port); choose a "
                    "range outside it, or narrow net.ipv4.ip_local_port_range", low, high, *overlap)


def main(argv: list[str]) -> int:
    from ..agent.agent import Agent, AgentRefused
    from ..agent.discovery import DiscoveryError

    args = build_parser().parse_args(argv)
    if not args.token:
        print("llmgw agent: --token (or $LLMGW_AGENT_TOKEN) is required", file=sys.stderr)
        return 2
    try:
        labels = parse_labels(args.label)
        if args.address is not None:  # the node's engines listen there: it must be an address of this machine
            listening.check_bindable(args.address)
        kv_max_message_bytes = parse_kv_message_size(args.kv_max_message_size)
        engine_ports = optional_flag("--engine-ports", args.engine_ports, parse_port_range)
        connector = join_connector(args.join, tls_options(args))
        agent = Agent(connector, token=args.token, node_id=args.node_id or socket.gethostname(),
                      discovery=args.discovery, state_dir=args.state_dir, labels=labels, address=args.address,
                      announce=lambda line: print(line, flush=True), kv_max_message_bytes=kv_max_message_bytes,
                      engine_ports=engine_ports)
    except (ValueError, OSError, listening.CannotListen) as exc:  # ssl.SSLError is an OSError
        print(f"llmgw agent: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, args.log_format)
    warn_if_ephemeral(engine_ports)
    if args.insecure_skip_verify:
        log.warning("--insecure-skip-verify: the control plane's certificate is NOT verified; anyone on the path "
                    "can impersonate it and read the join token, this node's secret and its shards' secrets")
    try:
        return run_reporting("llmgw agent", lambda: trio.run(run, agent, args.stop_engines))  # busy state dir: exit 2
    except BaseExceptionGroup as group:
        if group.subgroup(AgentRefused) is not None:
            return EXIT_REFUSED
        bad_discovery = group.subgroup(DiscoveryError)
        if bad_discovery is None:
            raise
        print(f"llmgw agent: {bad_discovery.exceptions[0]}", file=sys.stderr)
        return 2


def tls_options(args: argparse.Namespace) -> TlsClientOptions | None:
    """The agent link's TLS trust options, or None when none was given."""
    if args.client_key and not args.client_cert:
        raise ValueError("--client-key needs --client-cert")
    if not (args.ca_file or args.client_cert or args.insecure_skip_verify):
        return None
    return TlsClientOptions(ca_file=args.ca_file, cert_file=args.client_cert, key_file=args.client_key,
                            verify=not args.insecure_skip_verify)


async def run(agent, stop_engines: bool = False) -> None:
    from ..agent.leftover import running_engines, stop_engines as stop_left_engines

    open_files = raise_open_files_limit()
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            await nursery.start(agent.run)
            print(f"llmgw-agent {agent.node_id} started: joining {agent.connector.url} as {agent.address}, "
                  f"state in {agent.state_dir}", flush=True)
            log.info("%s", open_files.describe())
            async for signum in signals:
                log.debug("%s: stopping the agent", signal.Signals(signum).name)
                break
        nursery.cancel_scope.cancel()
    # The agent is gone (and with it the state dir's lock): no one restarts the engines from here on.
    if stop_engines:
        await stop_left_engines(agent.state_dir, on_stopped=lambda done: log.info("%s", done.describe()))
    left = len(running_engines(agent.state_dir))
    if left:
        print(f"llmgw-agent {agent.node_id} stopped; {left} engine{'s keep' if left > 1 else ' keeps'} running for "
              f"the next 'llmgw agent --state-dir {agent.state_dir}' to adopt; stop {'them' if left > 1 else 'it'} "
              f"with: llmgw down --state-dir {agent.state_dir}", flush=True)
    else:
        print(f"llmgw-agent {agent.node_id} stopped", flush=True)
