"""The docs hold together: tables keep their shape, links land, and the flags they give a command are its own.

Three checks over ``docs/**/*.md`` and ``README.md``, and one on the CLI reference:

- **tables**: every row of a Markdown table has as many cells as its header, and no table row stands outside a
  table (a blank line inside a table, or a missing separator, turns the rows after it into plain text);
- **links**: every relative link (``[x](file.md#anchor)``) names a file that exists and, in a Markdown file, a
  heading (GitHub's anchor for it) or an ``<a id>`` there;
- **flags**: every ``--flag`` written after an ``llmgw COMMAND`` (or ``./dev COMMAND``) inside backticks, inline
  or in a fenced block, appears in that command's ``--help`` (collected in process, from the commands' own
  parsers), or is one of its internal flags hidden from ``--help`` (``llmgw serve --worker``, which the docs show
  in process listings);
- **the CLI reference**: every flag a command's ``--help`` shows is written in docs/cli.md after ``llmgw COMMAND``
  (the simulator's in simulator.md), so with the check above cli.md names every flag and no flag that is not.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw import cli
from llmgw.commands.bench import BENCHES

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]


@dataclass(frozen=True)
class Line:
    number: int  # 1-based
    text: str
    fenced: bool  # inside a ``` block (or its fence line)


def read_lines(text: str) -> list[Line]:
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        fence = line.lstrip().startswith(("```", "~~~"))
        lines.append(Line(number, line, fenced or fence))
        if fence:
            fenced = not fenced
    return lines


# -- tables ------------------------------------------------------------------------------------------------------

SEPARATOR = re.compile(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?")


def cells(row: str) -> int:
    """Cells of a table row: split on unescaped pipes (GitHub splits inside code spans too, so they escape them)."""
    inner = row.strip().removeprefix("|")
    if inner.endswith("|") and not inner.endswith("\\|"):
        inner = inner[:-1]
    return len(re.split(r"(?<!\\)\|", inner))


def table_problems(text: str) -> list[str]:
    lines = [line for line in read_lines(text)]
    problems = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.fenced or not line.text.lstrip().startswith("|"):
            index += 1
            continue
        following = lines[index + 1] if index + 1 < len(lines) else None
        if following is None or following.fenced or not SEPARATOR.fullmatch(following.text.strip()):
            problems.append(f"line {line.number}: a table row outside a table (a blank line or a missing header "
                            f"separator above it?): {line.text[:60]!r}")
            index += 1
            continue
        width = cells(line.text)
        for row in [following] + lines[index + 2:]:
            if row.fenced or not row.text.lstrip().startswith("|"):
                break
            if cells(row.text) != width:
                problems.append(f"line {row.number}: {cells(row.text)} cells where the header at line "
                                f"{line.number} has {width}: {row.text[:60]!r}")
            index = row.number - 1
        index += 1
    return problems


# -- links -------------------------------------------------------------------------------------------------------

CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"#{1,6}\s+(.*?)\s*#*\s*$")
ANCHOR_TAG = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (code and links unwrapped), lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in read_lines(text):
        if line.fenced:
            continue
        found.update(ANCHOR_TAG.findall(line.text))
        heading = HEADING.fullmatch(line.text)
        if heading:
            base = slug(heading[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for line in read_lines(text):
        if line.fenced:
            continue
        for target in LINK.findall(CODE_SPAN.sub("", line.text)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve()
            if file_part and not linked.exists():
                problems.append(f"line {line.number}: {target}: no file {file_part}")
            elif anchor and (not file_part or linked.suffix == ".md"):
                if anchor not in anchors(linked.read_text() if file_part else text):
                    problems.append(f"line {line.number}: {target}: no heading #{anchor} in "
                                    f"{linked.name if file_part else 'this file'}")
    return problems


# -- flags -------------------------------------------------------------------------------------------------------

COMMAND = re.compile(r"(?<![\w/.-])(?:llmgw|\./dev)\s+([a-z][\w-]*)(?:\s+([A-Za-z][\w-]*))?")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND_END = re.compile(r"&&|\|\||;|(?<![\\])\|(?=\s)|\$\(")


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main(argv)
        except SystemExit:
            pass
    return out.getvalue()


def help_flags() -> dict[str, set[str]]:
    """Command (``serve``, ``config check``, ``bench routing``) -> the flags its ``--help`` shows in its usage
    line (not those its help text names in passing, such as a benchmark's "--role gateway processes")."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", "1000")  # no help line wrapped inside a flag
        argvs = {name: [name, "--help"] for name in cli.COMMANDS if name not in ("config", "bench")}
        argvs["config check"] = ["config", "check", "--help"]
        argvs.update({f"bench {name}": ["bench", name, "--help"] for name in BENCHES})
        usages = {name: help_text(argv).split("\n\n", 1)[0] for name, argv in argvs.items()}
    return {name: set(FLAG.findall(usage)) | {"--help"} for name, usage in usages.items()}  # usage writes -h


def hidden_flags() -> dict[str, set[str]]:
    """Command -> its internal flags, hidden from ``--help`` (``serve --worker``)."""
    hidden: dict[str, set[str]] = {}
    for name, (module_name, _) in cli.COMMANDS.items():
        build_parser = getattr(importlib.import_module(module_name), "build_parser", None)
        if build_parser is not None:
            hidden[name] = {option for action in build_parser()._actions if action.help == argparse.SUPPRESS
                            for option in action.option_strings}
    return hidden


@pytest.fixture(scope="module")
def command_flags() -> dict[str, set[str]]:
    """Command -> every flag it takes: those its ``--help`` shows, and its hidden ones."""
    flags = help_flags()
    for name, hidden in hidden_flags().items():
        flags[name] |= hidden
    assert all(flags[name] for name in ("serve", "agent", "sim", "bench routing")), flags
    return flags


def command_spans(text: str) -> list[tuple[int, str]]:
    """(line number, code) for every inline code span and every fenced line."""
    spans = []
    for line in read_lines(text):
        if line.fenced:
            spans.append((line.number, line.text))
        else:
            spans.extend((line.number, match[0].strip("`")) for match in CODE_SPAN.finditer(line.text))
    return spans


def flag_mentions(text: str, command_flags: dict[str, set[str]]) -> list[tuple[int, str, str, str]]:
    """(line number, command, flag, code) for every ``--flag`` written after ``llmgw COMMAND`` in a code span."""
    mentions = []
    for number, code in command_spans(text):
        for match in COMMAND.finditer(code):
            first, second = match[1], match[2] or ""
            if first not in cli.COMMANDS:
                continue  # ./dev test, ./dev lint: ./dev's own
            name = f"{first} {second}" if first in ("config", "bench") else first
            rest = code[match.end():]
            end = COMMAND_END.search(rest)
            mentions.extend((number, name, flag, code) for flag in FLAG.findall(rest[:end.start()] if end else rest))
    return mentions


def flag_problems(text: str, command_flags: dict[str, set[str]]) -> list[str]:
    problems = []
    every = set().union(*command_flags.values())
    for number, name, flag, code in flag_mentions(text, command_flags):
        known = command_flags.get(name)
        if known is None:  # `llmgw bench NAME ...`: any benchmark's
            known = set().union(*(flags for key, flags in command_flags.items() if key.startswith(name.split()[0])))
        if flag not in known and not (name == "sim" and flag in every):
            problems.append(f"line {number}: `llmgw {name}` has no {flag}: {code[:80]!r}")
    return problems


# -- the checks on the repository's docs --------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_tables_keep_their_shape(path):
    assert table_problems(path.read_text()) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_links_land(path):
    assert link_problems(path, path.read_text()) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_flag_given_to_a_command_exists(path, command_flags):
    assert flag_problems(path.read_text(), command_flags) == []


# The page that lists a command's flags: cli.md, but for the simulator, whose vLLM-style flags simulator.md lists
# (cli.md's row for `llmgw sim` points there).
FLAGS_PAGE = {"sim": "simulator.md"}


def undocumented_flags(pages: dict[str, str], shown: dict[str, set[str]],
                       command_flags: dict[str, set[str]]) -> dict[str, list[str]]:
    """Command -> the flags its ``--help`` shows that its page never writes: cli.md after ``llmgw COMMAND`` in a
    code span, or anywhere on the page ``FLAGS_PAGE`` names for it."""
    written: dict[str, set[str]] = {}
    for _, name, flag, _ in flag_mentions(pages["cli.md"], command_flags):
        written.setdefault(name, set()).add(flag)
    missing = {}
    for name, flags in shown.items():
        page = FLAGS_PAGE.get(name)
        documented = set(FLAG.findall(pages[page])) if page else written.get(name, set())
        if flags - {"--help"} - documented:
            missing[name] = sorted(flags - {"--help"} - documented)
    return missing


def test_every_flag_of_every_command_is_in_the_cli_reference(command_flags):
    pages = {name: (REPO / "docs" / name).read_text() for name in {"cli.md", *FLAGS_PAGE.values()}}
    assert undocumented_flags(pages, help_flags(), command_flags) == {}


# -- the checks catch what they are for ---------------------------------------------------------------------------


def test_a_blank_line_or_a_cell_too_many_breaks_a_table():
    good = "| a | b |\n|---|---|\n| `x\\|y` | 2 |\n"
    assert table_problems(good) == []
    assert table_problems(good + "\n| 3 | 4 |\n") == [
        "line 5: a table row outside a table (a blank line or a missing header separator above it?): '| 3 | 4 |'"]
    assert table_problems(good + "| 3 | 4 | 5 |\n") == ["line 4: 3 cells where the header at line 1 has 2: "
                                                        "'| 3 | 4 | 5 |'"]
    assert table_problems("```\n| not | a table |\n```\n") == []


def test_a_link_to_a_missing_file_or_heading_is_named(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Workers on one host: `llmgw serve --workers N`\n"
                                       "## Again\n## Again\n<a id=\"flags\"></a>\n")
    page = tmp_path / "page.md"
    text = ("[ok](other.md#workers-on-one-host-llmgw-serve---workers-n) [ok](other.md#again-1) [ok](other.md#flags)"
            " [ok](#top) [ext](https://example.com/x.md#y) `[code](gone.md)`\n# Top\n"
            "[gone](gone.md) [bad](other.md#nowhere)\n")
    assert link_problems(page, text + "[up](#nowhere)\n") == [
                                         "line 3: gone.md: no file gone.md",
                                         "line 3: other.md#nowhere: no heading #nowhere in other.md",
                                         "line 4: #nowhere: no heading #nowhere in this file"]


def test_a_flag_a_command_does_not_have_is_named(command_flags):
    text = ("`llmgw serve --config FILE --no-such` and `./dev agent --join URL --engine-ports 1-2`\n"
            "```bash\nllmgw bench routing --quick --arms x | tee out && llmgw status --json\n"
            "llmgw bench NAME --json FILE --bogus\n```\n`pip install --no-deps` `./dev test --x`\n")
    assert flag_problems(text, command_flags) == [
        "line 1: `llmgw serve` has no --no-such: 'llmgw serve --config FILE --no-such'",
        "line 4: `llmgw bench NAME` has no --bogus: 'llmgw bench NAME --json FILE --bogus'",
    ]


def test_a_flag_of_a_command_left_out_of_its_page_is_named(command_flags):
    shown = {"serve": {"--help", "--config", "--listen"}, "sim": {"--port", "--model"}}
    pages = {"cli.md": "`llmgw serve [--config FILE]` and `llmgw plan --listen`\n", "simulator.md": "`--port N`\n"}
    assert undocumented_flags(pages, shown, command_flags) == {"serve": ["--listen"], "sim": ["--model"]}
