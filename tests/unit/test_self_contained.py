"""The repository is self-contained: no tracked file points readers or code at notes outside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTSIDE_POINTERS = ("shared/reference", "../shared", "/work/shared")


def tracked_files() -> list[Path]:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in listing.decode().split("\0") if name]


def test_no_tracked_file_points_outside_the_repository():
    offenders = []
    for path in tracked_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if any(pointer in line for pointer in OUTSIDE_POINTERS):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "files that point outside the repository:\n" + "\n".join(offenders)


def test_the_notes_the_docs_link_to_exist():
    notes = REPO / "docs" / "vllm-notes.md"
    linking = [path for path in tracked_files() if path.suffix in (".md", ".py", ".sh") and path.is_file()
               and "vllm-notes.md" in path.read_text(errors="replace")]
    assert notes.is_file() and len(linking) >= 5
