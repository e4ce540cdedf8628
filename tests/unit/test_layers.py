"""Import directions between llmgw's layers, read from the source (an AST walk over llmgw/, no import runs).

The rules and why: docs/development.md, "Layers". In short:

- ``llmgw.gateway`` (and the commands, the benchmarks, the CLI) may import anything;
- ``cluster`` (the shared state) may import the middle layers and what they may, never ``gateway``;
- ``control``, ``router``, ``agent`` and ``sim`` may import ``kv``, ``http``, ``wire``, ``engines``, ``config``
  and the base modules, never ``gateway``, and not each other except as ALLOWED says;
- ``kv``, ``http``, ``wire`` and ``engines`` import none of the layers above them, and ``kv`` none of the other
  three (the index and the event codec stand alone);
- nothing outside ``llmgw.plugins`` imports ``llmgw.plugins`` (plugins are found through entry points).

Every import counts, wherever it is: inside a function, or under ``if TYPE_CHECKING:`` (a dependency for the
type checker is a dependency of the design).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import llmgw

PACKAGE = Path(llmgw.__file__).parent

# Top-level modules every layer may use: no state of a layer, no import of one.
BASE = {"metrics", "tls", "usererrors", "listening", "logsetup", "procgroup", "private_file", "plugins_manager",
        "hookspecs", "plugin", "cached_labels", "units", "redis_server", "backoff", "logfields", "lograte",
        "fdlimit", "fdpressure"}
# Between the gateway and the middle: the shared state, and who may use it.
UPPER = {"cluster", "tenancy", "flow", "autoscale"}
MIDDLE = {"control", "router", "agent", "sim"}
BOTTOM = {"kv", "http", "wire", "engines"}  # the libraries the middle layers share
# What a middle layer may import besides itself and the base modules.
MIDDLE_MAY_USE = BOTTOM | {"config"}

# (importing module or package, imported module or package) -> why this crossing is allowed.
ALLOWED = {
    # The replica sources of the control plane (static models, deployed replicas) write into the router's
    # replica table (control/interfaces.py): they hand it the router's own types.
    ("llmgw.control", "llmgw.router.model"): "a source declares each model it serves as a TierModel",
    ("llmgw.control", "llmgw.router.replica"): "a source adds the Replica objects the router routes to",
    ("llmgw.control", "llmgw.router.replicas"): "the source names (STATIC, DEPLOYED) the replica table keys on",
    ("llmgw.tenancy", "llmgw.cluster"): "tenancy's Redis stores and leases use the cluster's link and records",
}


@dataclass(frozen=True)
class Import:
    importer: str  # llmgw.control.plane
    imported: str  # llmgw.gateway.app
    where: str  # llmgw/control/plane.py:47


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> list[Import]:
    """Every ``llmgw`` module ``path`` imports; ``from P import name`` names ``P.name`` when that is a module."""
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    where = path.relative_to(PACKAGE.parent).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [f"{origin}.{alias.name}" if _is_module(f"{origin}.{alias.name}") else origin
                     for alias in node.names]
        else:
            continue
        found += [Import(importer, name, f"{where}:{node.lineno}") for name in dict.fromkeys(names)
                  if name == "llmgw" or name.startswith("llmgw.")]
    return found


def all_imports() -> list[Import]:
    return [imp for path in sorted(PACKAGE.rglob("*.py")) for imp in imports_of(path)]


def layer(module: str) -> str:
    """``llmgw.kv.index`` -> ``kv``; ``llmgw.metrics`` -> ``metrics``; ``llmgw`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def broken_rule(imp: Import) -> str | None:
    """Why ``imp`` crosses the layers the wrong way, or None when it may."""
    src, dst = layer(imp.importer), layer(imp.imported)
    if dst == "plugins" and src != "plugins":
        return "the core never imports llmgw.plugins (plugins are loaded through entry points)"
    if src == dst or dst == "" or dst in BASE:
        return None
    if src in UPPER and dst not in MIDDLE | MIDDLE_MAY_USE:
        return (f"llmgw.{src} may import the middle layers, kv, http, wire, config and the base modules"
                + (", never the gateway" if dst == "gateway" else ""))
    if src in MIDDLE and dst not in MIDDLE_MAY_USE:
        return (f"llmgw.{src} may import kv, http, wire, config and the base modules only"
                + (", never the gateway" if dst == "gateway" else ""))
    if src in BOTTOM and dst not in BOTTOM | {"config"}:
        return f"llmgw.{src} is below every other layer: it never imports llmgw.{dst}"
    if src == "kv" and dst in BOTTOM:
        return f"llmgw.kv stands alone: it imports none of the other libraries (llmgw.{dst})"
    return None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def allowance(imp: Import) -> tuple[str, str] | None:
    for importer, imported in ALLOWED:
        if _within(imp.importer, importer) and _within(imp.imported, imported):
            return importer, imported
    return None


def test_imports_go_down_the_layers():
    imports = all_imports()
    assert len(imports) > 100  # the walk found the package's imports (a wrong root would find none)
    wrong = [f"{imp.where}: {imp.importer} imports {imp.imported}: {reason}"
             for imp in imports if (reason := broken_rule(imp)) is not None and allowance(imp) is None]
    if wrong:
        pytest.fail("imports against the layering (docs/development.md, \"Layers\"); move the code, or add a "
                    "commented entry to ALLOWED in tests/unit/test_layers.py:\n  " + "\n  ".join(wrong), pytrace=False)


def test_every_allowed_crossing_still_exists_and_still_needs_allowing():
    imports = all_imports()
    used = {allowance(imp) for imp in imports if broken_rule(imp) is not None}
    stale = [f"{importer} -> {imported} ({why})" for (importer, imported), why in ALLOWED.items()
             if (importer, imported) not in used]
    if stale:
        pytest.fail("ALLOWED entries no import needs any more: remove them from tests/unit/test_layers.py\n  "
                    + "\n  ".join(stale), pytrace=False)


def test_the_rules_catch_each_kind_of_wrong_import():
    def rule(importer: str, imported: str) -> str | None:
        return broken_rule(Import(importer, imported, "x.py:1"))

    assert "never the gateway" in rule("llmgw.control.plane", "llmgw.gateway.app")
    assert "never the gateway" in rule("llmgw.cluster.state", "llmgw.gateway.app")
    assert rule("llmgw.router.replicas", "llmgw.cluster.state") is not None  # the middle never sees the cluster
    assert rule("llmgw.router.tier", "llmgw.agent.supervisor") is not None
    assert rule("llmgw.agent.agent", "llmgw.control.plane") is not None
    assert rule("llmgw.sim.core", "llmgw.router.radix") is not None
    assert rule("llmgw.http.server", "llmgw.router.router") is not None
    assert rule("llmgw.wire.messages", "llmgw.control.plane") is not None
    assert rule("llmgw.kv.index", "llmgw.wire.messages") is not None
    assert "entry points" in rule("llmgw.gateway.app", "llmgw.plugins.kv_index")
    assert "entry points" in rule("llmgw.metrics", "llmgw.plugins")
    for fine in [("llmgw.gateway.app", "llmgw.control.plane"), ("llmgw.router.tier", "llmgw.kv.index"),
                 ("llmgw.agent.kv", "llmgw.wire.messages"), ("llmgw.sim.app", "llmgw.http.server"),
                 ("llmgw.control.plane", "llmgw.metrics"), ("llmgw.plugins.kv_index", "llmgw.router.tier"),
                 ("llmgw.commands.serve", "llmgw.gateway.app"), ("llmgw.kv.index", "llmgw.config.fields"),
                 ("llmgw.cluster.state", "llmgw.router.replicas"), ("llmgw.gateway.app", "llmgw.cluster.state")]:
        assert rule(*fine) is None, fine


def test_relative_and_from_imports_resolve_to_modules():
    # `from .. import wire` names the package llmgw.wire; `from ..cached_labels import X` that module.
    found = {imp.imported for imp in imports_of(PACKAGE / "wire" / "channel.py")}
    assert {"llmgw.tls", "llmgw.wire.messages"} <= found
    found = {imp.imported for imp in imports_of(PACKAGE / "kv" / "metrics.py")}
    assert "llmgw.cached_labels" in found
