"""The ``llmgw`` command: a table of subcommands, each in its own module.

Every subcommand module exposes ``main(argv: list[str]) -> int`` and builds its
own argument parser, so ``llmgw sim`` does not pay for importing the router.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("llmgw.commands.serve",
              "run the gateway (control plane, router, OpenAI endpoint); a demo without --config"),
    "config": ("llmgw.commands.config", "check a config file: llmgw config check FILE"),
    "agent": ("llmgw.commands.agent", "join a control plane and run its shards here: llmgw agent --join URL --token T"),
    "status": ("llmgw.commands.status", "nodes, replicas and shards of a running llmgw serve, as tables"),
    "reload": ("llmgw.commands.reload",
               "make a running llmgw serve re-read its config file: llmgw reload [--allow-empty]"),
    "keys": ("llmgw.commands.keys", "API keys of a running gateway: llmgw keys create|list|update|revoke"),
    "teams": ("llmgw.commands.teams", "teams of a running gateway: llmgw teams create|list|update|delete"),
    "sim": ("llmgw.sim.cli", "run the vLLM-like simulator engine"),
    "down": ("llmgw.commands.down", "stop the engines a stopped serve or agent left running: llmgw down --config FILE"),
    "plan": ("llmgw.commands.plan",
             "print where a config's replicas would be placed, and why: llmgw plan --config FILE"),
    "usage": ("llmgw.commands.usage",
              "usage per key, team, model, class and hour, as a table or CSV: llmgw usage --since 24h"),
    "bench": ("llmgw.commands.bench", "run a benchmark and print its table: llmgw bench fault [--json FILE]"),
}


def table_usage(command: str, kind: str, table: dict[str, tuple[str, str]]) -> str:
    """The help of a command dispatching to a ``table`` of NAME -> (module, help): ``llmgw``, ``llmgw bench``."""
    width = max(map(len, table))
    lines = [f"usage: {command} {kind.upper()} [options]", "", f"{kind}s:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in table.items()]
    lines += ["", f"Run '{command} {kind.upper()} --help' for a {kind}'s options."]
    return "\n".join(lines)


def usage() -> str:
    return table_usage("llmgw", "command", COMMANDS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"llmgw {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"llmgw: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
