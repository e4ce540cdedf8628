"""``llmgw agent``: join a control plane and run the engine shards it places on this machine.

The agent dials out (``--join http://CONTROL:PORT``), registers with the join
token, reports the engines it already runs (from its ledger in
``--state-dir``), and keeps them running across its own restarts and the
control plane's: stopping the agent (SIGINT/SIGTERM) leaves its engines
running for the next agent to adopt. It prints one line per connection
change: ``llmgw-agent NODE connected to URL``, ``... disconnected ...``,
``... refused ...`` (exit code 3).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

import trio

from .serve import setup_logging

log = logging.getLogger("llmgw.agent")
EXIT_REFUSED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--join", required=True, metavar="URL",
                        help="the control plane's control listener, e.g. http://10.0.0.1:8001")
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
    parser.add_argument("--kv-max-message-size", default=None, metavar="SIZE",
                        help="largest KV-event message taken from an engine, e.g. 64MiB (default 32MiB); a peer "
                             "sending a larger one is disconnected")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error (default info)")
    return parser


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {item!r}: expected KEY=VALUE")
        labels[key.strip()] = value.strip()
    return labels


def parse_kv_message_size(text: str | None) -> int | None:
    from ..kv.subscriber import message_size_setting

    if text is None:
        return None
    try:
        return message_size_setting(text)
    except ValueError as exc:
        raise ValueError(f"--kv-max-message-size {text!r}: {exc}") from None


def main(argv: list[str]) -> int:
    from ..agent.agent import Agent, AgentRefused
    from ..agent.discovery import DiscoveryError

    args = build_parser().parse_args(argv)
    if not args.token:
        print("llmgw agent: --token (or $LLMGW_AGENT_TOKEN) is required", file=sys.stderr)
        return 2
    try:
        labels = parse_labels(args.label)
        kv_max_message_bytes = parse_kv_message_size(args.kv_max_message_size)
        agent = Agent(args.join, token=args.token, node_id=args.node_id or socket.gethostname(),
                      discovery=args.discovery, state_dir=args.state_dir, labels=labels, address=args.address,
                      announce=lambda line: print(line, flush=True), kv_max_message_bytes=kv_max_message_bytes)
    except ValueError as exc:
        print(f"llmgw agent: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    try:
        trio.run(run, agent)
    except BaseExceptionGroup as group:
        if group.subgroup(AgentRefused) is not None:
            return EXIT_REFUSED
        bad_discovery = group.subgroup(DiscoveryError)
        if bad_discovery is None:
            raise
        print(f"llmgw agent: {bad_discovery.exceptions[0]}", file=sys.stderr)
        return 2
    return 0


async def run(agent) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            await nursery.start(agent.run)
            print(f"llmgw-agent {agent.node_id} started: joining {agent.connector.url} as {agent.address}, "
                  f"state in {agent.state_dir}", flush=True)
            async for signum in signals:
                log.info("%s: stopping the agent; its engines keep running", signal.Signals(signum).name)
                break
        nursery.cancel_scope.cancel()
