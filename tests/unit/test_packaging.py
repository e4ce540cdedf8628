"""The wheel ships ``llmgw.testing`` (plugin authors test with it) and the status page, and leaves the benchmarks
(``llmgw/bench``) out."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_the_testing_package_and_not_the_benchmarks(tmp_path):
    # Built from a copy of the tracked files, so that the build leaves nothing in the checkout.
    listing = subprocess.run(["git", "ls-files", "-z", "--", "pyproject.toml", "README.md", "LICENSE", "llmgw"],
                             cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    source = tmp_path / "src"
    for name in filter(None, listing):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("llmgw-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "llmgw/testing/__init__.py" in names and "llmgw/testing/fake_upstream.py" in names
    assert "llmgw/gateway/status.html" in names  # the status page, GET /ui (package data)
    assert "llmgw/commands/bench.py" in names  # the command stays: it says how to get the benchmarks
    assert not [name for name in names if name.startswith("llmgw/bench/")]
