"""``llmgw.kv`` is a library: it imports nothing of llmgw outside itself but the base utilities."""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw.kv

BASE_UTILITIES = {"llmgw.units", "llmgw.cached_labels", "llmgw.fdpressure", "llmgw.lograte"}


def llmgw_imports(path: Path) -> set[str]:
    """Every llmgw module ``path`` imports (at any depth of the file), relative imports resolved."""
    package = ["llmgw", "kv"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
    return {name for name in found if name == "llmgw" or name.startswith("llmgw.")}


def test_kv_imports_only_itself_and_base_utilities():
    files = sorted(Path(llmgw.kv.__file__).parent.glob("*.py"))
    assert len(files) > 5
    upward = {f"{path.name}: {name}" for path in files for name in llmgw_imports(path)
              if not (name == "llmgw.kv" or name.startswith("llmgw.kv.") or name in BASE_UTILITIES)}
    assert upward == set()


def test_the_check_sees_an_upward_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..wire import KvChanges\nfrom .changes import KvChangeKind\n"
                     "def f():\n    from ..http.client import UpstreamPool\n")
    assert llmgw_imports(probe) == {"llmgw.wire", "llmgw.kv.changes", "llmgw.http.client"}
