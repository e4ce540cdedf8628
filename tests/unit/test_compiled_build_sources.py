"""The compiled build's list of sources (tests/compiled_build.py): the same from a git checkout and from an
unpacked archive of it, which has no ``.git`` (build products and caches left out in both)."""

from __future__ import annotations

import shutil
from pathlib import Path

import compiled_build


def test_an_archive_without_git_lists_the_checkouts_sources(tmp_path: Path) -> None:
    checkout = compiled_build.source_files()
    assert "pyproject.toml" in checkout and "llmgw/__init__.py" in checkout
    unpacked = tmp_path / "llmgw-src"
    for name in checkout:
        (unpacked / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(compiled_build.REPO / name, unpacked / name)
    (unpacked / "llmgw" / "__pycache__").mkdir()
    (unpacked / "llmgw" / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"\0")
    (unpacked / "llmgw" / "cli.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")
    assert compiled_build.source_files(unpacked) == checkout
    assert compiled_build.content_key(unpacked) == compiled_build.content_key()


def test_the_benchmarks_are_no_source_of_the_wheel_so_editing_one_builds_nothing_again() -> None:
    """llmgw/bench/ stays out of the wheel (pyproject.toml's exclude), so it stays out of the key too; the extras'
    test installs the checkout with it (``benchmarks=True``)."""
    wheel = compiled_build.source_files()
    assert not [name for name in wheel if name.startswith("llmgw/bench/")]
    assert "llmgw/bench/proxy.py" in compiled_build.source_files(benchmarks=True)
    excluded = __import__("tomllib").loads((compiled_build.REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "llmgw.bench" in excluded["packages"]["find"]["exclude"]
