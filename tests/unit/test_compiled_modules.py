"""What mypyc cannot compile, or compiles into a different behaviour, is kept out of ``MYPYC_MODULES`` (the
optional compiled build, llmgw/compiled.py), checked on the source without building it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from llmgw.compiled import MYPYC_MODULES, compiled_modules, describe, module_name

EXPECT_COMPILED = "LLMGW_EXPECT_COMPILED"

REPO = Path(__file__).resolve().parents[2]


def functions(path: str):
    tree = ast.parse((REPO / path).read_text())
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_async_generator_in_a_compiled_module():
    """mypyc refuses async generators ("async generators are unimplemented")."""
    found = [f"{path}:{fn.lineno} {fn.name}" for path in MYPYC_MODULES for fn in functions(path)
             if isinstance(fn, ast.AsyncFunctionDef)
             and any(isinstance(node, (ast.Yield, ast.YieldFrom)) for node in ast.walk(fn))]
    assert not found


def test_an_exception_name_has_one_type_per_function():
    """A compiled function gives a variable one type: ``except A as exc`` then ``except B as exc`` raises
    TypeError there when a B arrives (found by the compiled unit tier: a malformed upstream answer)."""
    found = []
    for path in MYPYC_MODULES:
        for fn in functions(path):
            types: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    types.setdefault(node.name, set()).add(ast.unparse(node.type))
            found += [f"{path}:{fn.lineno} {fn.name}: {name} {sorted(kinds)}" for name, kinds in types.items()
                      if len(kinds) > 1]
    assert not found


def test_every_listed_module_exists():
    assert all((REPO / path).is_file() for path in MYPYC_MODULES)
    assert module_name("llmgw/http/server.py") == "llmgw.http.server"


def test_the_run_imports_the_build_it_was_started_for():
    """``./dev test`` runs the tests twice: from the source (nothing compiled), then with the compiled wheel first
    on the path and ``LLMGW_EXPECT_COMPILED=1`` (docs/testing.md, "Both builds"). The second run must not silently
    fall back to pure Python, here or in the ``python -m llmgw`` children the tests start."""
    expected = [module_name(path) for path in MYPYC_MODULES] if os.environ.get(EXPECT_COMPILED) == "1" else []
    assert compiled_modules() == expected
    n = len(MYPYC_MODULES)
    assert describe() == ((f"data plane: {n} of {n} hot modules compiled with mypyc", False) if expected else
                          (f"data plane: pure Python (0 of {n} hot modules compiled: this install was built without "
                           f"LLMGW_MYPYC=1; the compiled build costs less CPU per request, docs/deploy.md says how "
                           f"to get it)", False))
    child = subprocess.run([sys.executable, "-c", "import json, llmgw.compiled as c; "
                            "print(json.dumps(c.compiled_modules()))"], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == expected


def test_send_all_sends_each_byte_once_when_the_socket_takes_part_at_a_time():
    """The upstream client's partial-send loop (mypyc 2.4 compiled it into one that sent the same tail again and
    again: an assignment inside ``try``, after an await in the loop, was lost)."""
    import socket

    import trio

    from llmgw.http.client import _Connection

    class TakesPart:
        def __init__(self) -> None:
            self.pair = socket.socketpair()  # a real descriptor for wait_writable
            self.taken = bytearray()
            self.calls = 0

        def fileno(self) -> int:
            return self.pair[0].fileno()

        def send(self, data) -> int:
            self.calls += 1
            if self.calls % 3 == 0:
                raise BlockingIOError
            piece = bytes(data[:26_304])
            self.taken += piece
            return len(piece)

    sock = TakesPart()
    body = bytes(range(256)) * 800

    async def send() -> None:
        with trio.fail_after(5):  # the miscompiled loop never ended
            await _Connection(sock).send_all(body, 5, first=True)

    try:
        trio.run(send)
    finally:
        for end in sock.pair:
            end.close()
    assert bytes(sock.taken) == body


def _none_tests(test: ast.expr, negated: bool) -> list[str]:
    """The attribute expressions (``self.final``) that ``test`` narrows to None when it holds (``x is None``,
    alone or in an ``and``; ``negated``: the test of an ``else``/after the loop, not looked at)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [name for value in test.values for name in _none_tests(value, negated)]
    if (not negated and isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute)
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.Is)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        return [ast.unparse(test.left)]
    return []


def test_an_attribute_narrowed_to_none_is_not_tested_again_inside():
    """Inside ``while self.final is None:`` (or such an ``if``) mypyc takes ``self.final`` for None even after a
    call that set it, and testing it again raises TypeError there (the server's client watcher did, when a
    client closed its connection after a slow request): read it through a method instead."""
    found = []
    for path in MYPYC_MODULES:
        for node in ast.walk(ast.parse((REPO / path).read_text())):
            if not isinstance(node, (ast.While, ast.If)):
                continue
            narrowed = set(_none_tests(node.test, negated=False))
            for inner in (sub for statement in node.body for sub in ast.walk(statement)):
                if isinstance(inner, ast.Compare) and ast.unparse(inner.left) in narrowed \
                        and any(isinstance(c, ast.Constant) and c.value is None for c in inner.comparators):
                    found.append(f"{path}:{inner.lineno} {ast.unparse(inner)}")
    assert not found


def test_a_partly_compiled_install_names_its_pure_modules_in_a_warning(monkeypatch):
    """An install where some extensions did not load (a wheel for another interpreter, files removed) runs those
    modules pure: ``llmgw serve`` warns at start, naming them."""
    import llmgw.compiled

    names = [module_name(path) for path in MYPYC_MODULES]
    monkeypatch.setattr(llmgw.compiled, "compiled_modules", lambda: names[1:])
    monkeypatch.setattr(llmgw.compiled, "stale_modules", lambda compiled: [])
    n = len(names)
    assert llmgw.compiled.describe() == (f"data plane: {n - 1} of {n} hot modules compiled with mypyc; pure Python, "
                                         f"no extension for them in this install: {names[0]}", True)


def test_the_per_request_records_are_built_natively_in_the_compiled_build():
    """``dataclasses`` writes a dataclass's ``__init__`` at run time, so in a compiled module it stays an interpreted
    function (a Python frame, and every field set through a descriptor) for each object made: the objects the data
    plane makes for every request are plain classes, whose ``__init__`` mypyc compiles."""
    import dataclasses

    from llmgw.gateway.dataplane import Exchange
    from llmgw.gateway.flow_gate import FlowTrace
    from llmgw.http.messages import Request, Response

    compiled = os.environ.get(EXPECT_COMPILED) == "1"
    for cls in (Request, Response, Exchange, FlowTrace):
        assert not dataclasses.is_dataclass(cls), cls
        assert hasattr(cls.__init__, "__code__") is not compiled, cls  # a Python function only when pure
