"""Print what building the compiled wheel needs beside mypy, one requirement a line, from pyproject.toml: the build
system's requirements, llmgw's own dependencies and the type stubs ``./dev lint`` uses (the test extra's
``types-*``). mypyc type-checks the hot modules, and everything they import, against those packages: without
them the build fails with ``import-not-found``. The Containerfile's build stage and ``[tool.cibuildwheel]`` install
its output (``python deploy/build-requirements.py | pip install -r /dev/stdin``); it needs Python 3.11+ only.
"""

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def build_requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """The requirements, in pyproject.toml's order, each once."""
    project = tomllib.loads(pyproject.read_text())
    stubs = [pin for pin in project["project"]["optional-dependencies"]["test"] if pin.startswith("types-")]
    found = [*project["build-system"]["requires"], *project["project"]["dependencies"], *stubs]
    return list(dict.fromkeys(found))


if __name__ == "__main__":
    print(*build_requirements(Path(sys.argv[1]) if len(sys.argv) > 1 else PYPROJECT), sep="\n")
