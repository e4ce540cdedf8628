"""Every extra installs what its code imports, and the compiled wheel runs compiled where it is installed.

Each extra gets one virtualenv of its own with llmgw and that extra only (pip's cache makes the installs after
the first quick): ``bench`` from an editable install of a copy of the checkout (the benchmarks stay out of the
wheel), ``tokenizer`` from the compiled release wheel (``./dev wheel``'s, the build ``./dev test`` caches). In
it, every module the extra serves is imported, with every library those modules import (at their top or inside a
function: only an import whose ``ImportError`` is handled where it is made is optional), and for ``bench``
``llmgw bench NAME --help`` runs for every benchmark.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import compiled_build
from llmgw.commands.bench import BENCHES
from llmgw.compiled import MYPYC_MODULES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # a fresh virtualenv, and maybe the compiled build

REPO = Path(__file__).resolve().parents[2]
# Modules of an extra that run somewhere else, and where.
RUN_ELSEWHERE = {"llmgw.bench.make_tiny_model": "runs inside vLLM's own virtualenv (llmgw bench vllm-real's)"}
TOKENIZER_LIBRARIES = {"tokenizers", "jinja2"}  # what the tokenizer extra's distributions are imported as


def modules_under(package: str) -> list[str]:
    """``llmgw.bench`` -> every module of llmgw/bench/ (the package's ``__init__`` included), by name."""
    folder = REPO.joinpath(*package.split("."))
    return sorted(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                  for path in folder.rglob("*.py") if "__pycache__" not in path.parts)


def _handles_import_error(node: ast.Try) -> bool:
    names = {ast.unparse(handler.type) for handler in node.handlers if handler.type is not None}
    return bool({"ImportError", "ModuleNotFoundError"} & {n.strip("()") for name in names for n in name.split(", ")})


def libraries_imported(module: str) -> set[str]:
    """The top-level names of the libraries ``module`` imports anywhere in it (not the standard library, not
    llmgw, not an import whose ``ImportError`` the surrounding ``try`` handles)."""
    path = REPO.joinpath(*module.split("."))
    tree = ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())
    optional = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Try) and _handles_import_error(node)
                for statement in node.body for inner in ast.walk(statement)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name != "llmgw"}


PROBE = """
import importlib, json, sys
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""


def import_failures(python: Path, names: list[str], cwd: Path) -> dict[str, str]:
    """What of ``names`` does not import in ``python``'s environment (run from ``cwd``, off the checkout)."""
    probe = subprocess.run([str(python), "-c", PROBE, json.dumps(names)], capture_output=True, text=True,
                           timeout=300, cwd=cwd, env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONSAFEPATH": "1"})
    assert probe.returncode == 0, probe.stderr[-3000:]
    return json.loads(probe.stdout)


def test_the_bench_extra_installs_what_the_benchmarks_import(tmp_path):
    # a copy: the editable install writes its metadata beside the sources
    source = compiled_build.copy_sources(REPO, tmp_path / "llmgw-src", benchmarks=True)
    python = compiled_build.fresh_venv(tmp_path / "venv")
    compiled_build.pip_install(python, "-e", f"{source}[bench]")
    served = [name for name in modules_under("llmgw.bench") + modules_under("llmgw.testing")
              if name not in RUN_ELSEWHERE]
    libraries = sorted(set().union(*(libraries_imported(name) for name in served)))
    assert {"httpx", "trio"} <= set(libraries), libraries  # the scan finds what the benchmarks import
    assert import_failures(python, served + libraries, tmp_path) == {}
    for name in BENCHES:
        helped = subprocess.run([str(python.parent / "llmgw"), "bench", name, "--help"], capture_output=True,
                                text=True, timeout=120, cwd=tmp_path)
        assert (helped.returncode, helped.stderr) == (0, ""), (name, helped.stderr[-3000:])
        assert helped.stdout.startswith(f"usage: llmgw bench {name}") and "-h, --help" in helped.stdout, \
            (name, helped.stdout[:300])


def test_the_compiled_wheel_with_the_tokenizer_extra_runs_compiled_and_imports_what_it_serves(tmp_path):
    """The compiled release wheel ``./dev wheel`` makes (beside the pure one), installed with ``[tokenizer]`` alone: it
    says ``data plane: N of N hot modules compiled``, the modules using the tokenizer libraries import them, and
    every other module of the wheel but the test harness (``llmgw.testing``, served by ``bench`` and ``test``)
    imports on the base dependencies."""
    cache = compiled_build.cache_root(REPO) or tmp_path / "compiled"
    wheel, *others = compiled_build.build_wheels(REPO, cache, tmp_path / "dist")  # what ./dev wheel makes
    assert "-linux_x86_64" in wheel.name or "manylinux" in wheel.name, wheel.name
    assert others[-1].name.endswith("-py3-none-any.whl"), others  # the pure fallback beside it
    python = compiled_build.fresh_venv(tmp_path / "venv")
    compiled_build.pip_install(python, f"{wheel}[tokenizer]")
    n = len(MYPYC_MODULES)
    said = subprocess.run([str(python), "-m", "llmgw.compiled", "--require"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert (said.returncode, said.stdout) == (0, f"data plane: {n} of {n} hot modules compiled with mypyc\n"), said
    shipped = [name for name in modules_under("llmgw")
               if not name.startswith(("llmgw.bench", "llmgw.testing")) and name != "llmgw.__main__"]
    tokenizing = [name for name in shipped if libraries_imported(name) & TOKENIZER_LIBRARIES]
    assert "llmgw.kv.local_tokenizer" in tokenizing  # the scan finds the extra's users
    libraries = sorted(set().union(*(libraries_imported(name) for name in shipped)))
    assert import_failures(python, shipped + libraries, tmp_path) == {}
