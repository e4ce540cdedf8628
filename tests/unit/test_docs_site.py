"""The docs site builds with ``mkdocs build --strict``: no broken link or anchor, no page left out of the nav, no
nav entry without its page (mkdocs.yml's ``validation`` turns each into a warning, and ``--strict`` fails on one).

The build of the real site runs here, so ``./dev test`` (and CI) fails on it; the second test shows, on a site of
two pages under the same settings, that each of those mistakes does fail the build.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict"]  # not --quiet: it hides the warnings --strict counts


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([*MKDOCS, "-f", str(config), "-d", str(site)], capture_output=True, text=True, env=env,
                          timeout=240)


def test_the_site_builds_with_every_link_and_page_in_place(tmp_path):
    result = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "search" / "search_index.json").exists()


def test_a_broken_link_a_missing_anchor_an_unlisted_page_or_a_missing_page_fails_the_build(tmp_path):
    """Two builds of a site of two pages under mkdocs.yml's settings: as it is, then with the four mistakes at once.
    Each mistake is a warning naming it, and --strict fails on any warning, so each would fail the build alone."""
    settings = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.Loader)  # mkdocs.yml has a !!python tag
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    config = tmp_path / "mkdocs.yml"
    for index, mistakes in (("# Home\n\n[other](other.md#a-section)\n", False),
                            ("# Home\n\n[gone](gone.md) [x](other.md#nowhere)\n", True)):
        (docs / "index.md").write_text(index)
        nav = ["index.md", "other.md"]
        if mistakes:
            (docs / "unlisted.md").write_text("# Unlisted\n")
            nav.append("runbook.md")
        config.write_text(yaml.dump({**settings, "docs_dir": str(docs), "nav": nav}))
        result = build(config, tmp_path / "site")
        output = result.stdout + result.stderr
        if not mistakes:
            assert result.returncode == 0, output
            continue
        assert result.returncode != 0, output
        for named in ("gone.md", "nowhere", "unlisted.md", "runbook.md"):
            assert named in output, (named, output)


# Sections of benchmarks.md that are no area of numbers.
NOT_AN_AREA = {"How the benchmarks run", "The records", "Autoscaling"}


def glance_problems(text: str) -> list[str]:
    """Each area of benchmarks.md: a headline in bold, then its command, when and where, and a link to its record
    on a page under docs/benchmarks/."""
    problems = []
    for area in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = area.partition("\n")
        if title in NOT_AN_AREA:
            continue
        for needed, pattern in (("headline in bold", r"^\*\*"), ("command", r"^- Command: `"),
                                ("date", r"^- When and where: .*20\d\d-\d\d-\d\d"),
                                ("record", r"^- Record: \[[^\]]+\]\(benchmarks/[\w-]+\.md#")):
            if not re.search(pattern, body, re.M):
                problems.append(f"{title}: no {needed}")
    return problems


def test_benchmarks_at_a_glance_gives_each_area_its_command_date_and_record():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert glance_problems(text) == []
    assert len(re.findall(r"^## ", text, re.M)) - len(NOT_AN_AREA) >= 7


def test_an_area_without_its_date_or_record_is_named():
    area = ("## Data plane\n\n**68 µs**\n\n- Command: `llmgw bench proxy`\n- When and where: 2026-12-04, the VM\n"
            "- Record: [x](benchmarks/data-plane.md#x)\n")
    assert glance_problems(area) == []
    assert glance_problems(area.replace("2026-12-04", "today").replace("benchmarks/", "")) == [
        "Data plane: no date", "Data plane: no record"]
