"""docs/runbook.md stays true to the code: every ``llmgw`` command line it gives (in its shell blocks and inline)
parses with that command's own parser, every ``llmgw bench chaos`` fault it names is one the benchmark runs, every
test it names exists, and every metric it names is documented in docs/metrics.md."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Callable

import pytest

from llmgw.bench import chaos, chaos_schedule
from llmgw.commands import agent, config, down, keys, reload, serve, status, teams, usage

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = (REPO / "docs" / "runbook.md").read_text()

PARSERS: dict[tuple[str, ...], Callable[[], argparse.ArgumentParser]] = {
    ("serve",): serve.build_parser, ("agent",): agent.build_parser, ("down",): down.build_parser,
    ("reload",): reload.build_parser, ("status",): status.build_parser, ("keys",): keys.build_parser,
    ("teams",): teams.build_parser, ("usage",): usage.build_parser,
    ("config",): config._parser, ("bench", "chaos"): chaos.parser,
}


def command_lines() -> list[list[str]]:
    """Every ``llmgw ...`` command line of the runbook's bash blocks (continuations joined; split at ``&&``,
    ``;``, ``|``; comments dropped) and of its inline code, as argv."""
    texts = []
    for block in re.findall(r"```bash\n(.*?)```", RUNBOOK, re.S):
        texts += block.replace("\\\n", " ").splitlines()
    # Inline: a command line, not a command's bare name (`llmgw keys`: the command itself).
    texts += [text for text in re.findall(r"`((?:\S*/)?llmgw [^`]*)`", RUNBOOK) if len(text.split()) > 2]
    commands = []
    for text in texts:
        words = shlex.split(text, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "|", "||"):
                if current and Path(current[0]).name == "llmgw":
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


COMMANDS = command_lines()


def test_the_runbook_gives_commands_of_every_kind_it_needs():
    named = {tuple(argv[1:3]) if argv[1] == "bench" else (argv[1],) for argv in COMMANDS}
    assert {("keys",), ("reload",), ("status",), ("config",), ("bench", "chaos")} <= named, named


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(argv) for argv in COMMANDS])
def test_every_llmgw_command_line_parses_with_its_own_parser(argv: list[str]):
    key = tuple(argv[1:3]) if argv[1] == "bench" else (argv[1],)
    assert key in PARSERS, f"llmgw {' '.join(key)}: no such command"
    args = PARSERS[key]().parse_args(argv[1 + len(key):])  # argparse exits 2 on an unknown flag or choice
    if key == ("bench", "chaos") and args.faults != "all":
        chaos_schedule.parse_faults(args.faults)  # ValueError naming a fault the benchmark does not run


def test_every_test_the_runbook_names_exists():
    named = re.findall(r"(tests/integration/\w+\.py)(?:::(\w+))?", RUNBOOK)
    assert len(named) >= 10
    for path, test in named:
        source = (REPO / path).read_text()  # FileNotFoundError names a file that is gone
        assert not test or re.search(rf"def {test}\(", source), f"{path}::{test} does not exist"


def test_every_metric_the_runbook_names_is_documented():
    documented = (REPO / "docs" / "metrics.md").read_text()
    for name in set(re.findall(r"\bllmgw_[a-z_]+", RUNBOOK)):
        name = re.sub(r"_bucket$", "", name)
        assert f"`{name}`" in documented, f"{name} is not in docs/metrics.md"
