"""The docs site builds with ``mkdocs build --strict``: no broken link or anchor, no page left out of the nav, no
nav entry without its page (mkdocs.yml's ``validation`` turns each into a warning, and ``--strict`` fails on one).

The build of the real site runs here, so ``./dev test`` (and CI) fails on it; the second test shows, on a site of
two pages under the same settings, that each of those mistakes does fail the build.
"""

from __future__ import annotations

import os
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
    settings = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.Loader)  # mkdocs.yml has a !!python tag
    docs = tmp_path / "docs"
    docs.mkdir()
    good = {"index.md": "# Home\n\n[other](other.md#a-section)\n", "other.md": "# Other\n\n## A section\n"}
    mistakes = {
        "a broken link": ({"index.md": "# Home\n\n[gone](gone.md)\n"}, ["index.md", "other.md"], "gone.md"),
        "a missing anchor": ({"index.md": "# Home\n\n[x](other.md#nowhere)\n"}, ["index.md", "other.md"], "nowhere"),
        "an unlisted page": ({"extra.md": "# Extra\n"}, ["index.md", "other.md"], "extra.md"),
        "a missing page": ({}, ["index.md", "other.md", "runbook.md"], "runbook.md"),
    }
    for name, (pages, nav, named) in {"nothing": ({}, ["index.md", "other.md"], ""), **mistakes}.items():
        for page in docs.iterdir():
            page.unlink()
        for page, text in {**good, **pages}.items():
            (docs / page).write_text(text)
        config = tmp_path / "mkdocs.yml"
        config.write_text(yaml.dump({**settings, "docs_dir": str(docs), "nav": nav}))
        result = build(config, tmp_path / "site")
        if name == "nothing":
            assert result.returncode == 0, result.stdout + result.stderr
        else:
            assert result.returncode != 0, name
            assert named in result.stdout + result.stderr, (name, result.stderr)
