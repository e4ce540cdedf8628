"""``llmgw config check FILE...``: validate config files, print a summary or every error.

A good file prints ``FILE: ok`` and a short summary (exit 0); a bad one prints
each problem on its own line as ``FILE:LINE: KEY: message`` (exit 1): structural
errors and plugin errors (unknown engine or routing tier, bad ``routing_options``)
together, in one pass.
"""

from __future__ import annotations

import argparse
import sys

from llmgw.config import Config, ConfigError
from llmgw.config.fields import issue_at
from llmgw.gateway.admin_guard import exposure_problem
from llmgw.plugins_manager import load_checked_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw config", description="Work with llmgw config files.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser("check", help="validate config files and summarise them",
                               description="Validate config files; print every error as FILE:LINE: KEY: message.")
    check.add_argument("files", nargs="+", metavar="FILE")
    return parser


def _plural(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _names(names: list[str]) -> str:
    return f" ({', '.join(names)})" if names else ""


def summary(config: Config) -> list[str]:
    """A few lines saying what a valid config declares (never a secret)."""
    external = sum(len(model.replicas) for model in config.models)
    deployed = sum(deployment.replicas for deployment in config.deployments)
    autoscaled = sum(1 for deployment in config.deployments if deployment.autoscaled)
    agents = "embedded" if config.agents.embedded else "remote only"
    if config.agents.token is not None:
        agents += ", remote agents join with a token"
    return [
        f"listen {config.listen}, control {config.control_listen}",
        f"models: {len(config.models)}{_names([model.name for model in config.models])}",
        f"replicas: {external} external, {deployed} deployed"
        + (f" at start ({autoscaled} deployment{'' if autoscaled == 1 else 's'} autoscaled)" if autoscaled else ""),
        f"profiles: {len(config.profiles)}{_names([profile.name for profile in config.profiles])}",
        f"deployments: {len(config.deployments)}"
        + _names([f"{d.profile} x{d.min_replicas}..{d.max_replicas}" if d.autoscaled else f"{d.profile} x{d.replicas}"
                  for d in config.deployments]),
        f"served model names: {', '.join(config.model_names()) or 'none'}",
        f"api keys: {len(config.api_keys)}; admin tokens: {len(config.admin_tokens)}; agents: {agents}",
    ]


def check(files: list[str]) -> int:
    failed = False
    for filename in files:
        try:
            config = load_checked_config(filename)
            refused = exposure_problem(config.control_listen.host, config)  # llmgw serve would refuse to start
            if refused:
                raise ConfigError([issue_at(config, "control_listen", refused)])
        except ConfigError as exc:
            failed = True
            for issue in exc.errors:
                print(issue, file=sys.stderr)
            continue
        print(f"{filename}: ok")
        for line in summary(config):
            print(f"  {line}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help or a usage error
        return int(exc.code or 0)
    return check(args.files)
