"""``llmgw down``: stop, for good, the engines a stopped agent left running for adoption.

``--config FILE`` stops those of the config's embedded agent (what ``llmgw
serve --config FILE`` started); ``--state-dir DIR`` those of a remote agent
(``llmgw agent --state-dir DIR``), on its machine. The agent must be stopped
first: while it runs it holds the state dir and would start them again.
Prints one line per engine; exit 0 when every engine is gone, 1 when one
could not be stopped, 2 for a usage error or a state dir in use.
"""

from __future__ import annotations

import argparse
import socket
import sys

import trio

from ..config import ConfigError, load_config
from ..usererrors import UserError, run_reporting


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw down", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", "-c", metavar="FILE", help="the config llmgw serve ran (its embedded agent)")
    where.add_argument("--state-dir", metavar="DIR", help="the state dir of an llmgw agent on this machine")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds each engine gets to exit after SIGTERM before SIGKILL (default 30)")
    return parser


class NoEmbeddedAgent(UserError):
    pass


def state_dir_of(config_path: str):
    """The state dir of the embedded agent ``llmgw serve --config config_path`` runs."""
    from ..agent.agent import default_state_dir

    config = load_config(config_path)
    agents = config.agents
    if not agents.embedded:
        raise NoEmbeddedAgent(f"{config_path} runs no embedded agent: its deployments run on remote agents; stop "
                              "each agent, then run 'llmgw down --state-dir DIR' on its machine")
    return agents.state_dir or default_state_dir(agents.node_id or socket.gethostname())


def main(argv: list[str]) -> int:
    from ..agent.leftover import stop_engines

    args = build_parser().parse_args(argv)
    results = []

    def stop() -> None:
        state_dir = state_dir_of(args.config) if args.config else args.state_dir
        results.extend(trio.run(stop_engines, state_dir, args.grace, lambda done: print(done.describe(), flush=True)))
        stopped = sum(1 for done in results if done.stopped_now)
        print(f"llmgw down: {stopped} engine{'' if stopped == 1 else 's'} stopped in {state_dir}", flush=True)

    try:
        code = run_reporting("llmgw down", stop)
    except ConfigError as exc:
        print(f"llmgw down: {exc}", file=sys.stderr)
        return 2
    if code:
        return code
    return 0 if all(done.gone for done in results) else 1
