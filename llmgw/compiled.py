"""The optional mypyc build of the data plane's hot modules: which modules it compiles, and which are compiled here.

``LLMGW_MYPYC=1`` makes ``setup.py`` compile :data:`MYPYC_MODULES` into C extensions (``docs/development.md``,
"The compiled data plane"); the same ``.py`` files run as they are wherever the build did not (a plain install,
a checkout). Compiled and pure modules behave the same (tests/integration/test_compiled_dataplane.py); the
compiled ones cost about a fifth less CPU per request (``docs/benchmarks.md``, "Data plane overhead").

This module imports nothing of llmgw at its top: ``setup.py`` reads :data:`MYPYC_MODULES` from it before llmgw
or its dependencies are installed.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import os
import sys

# Paths from the repository root. Not compiled, and why: llmgw/plugins/round_robin.py (pluggy sets attributes on
# its hook functions, which compiled functions do not take), llmgw/router/tier.py and llmgw/cached_labels.py
# (``__getattr__`` on classes deriving from non-compiled ones), llmgw/router/replica.py (compiled classes take no
# weak references, and the tokenizer client keys its pools by Replica in a WeakKeyDictionary).
MYPYC_MODULES = (
    "llmgw/http/server.py",
    "llmgw/http/client.py",
    "llmgw/http/deadlines.py",
    "llmgw/http/messages.py",
    "llmgw/http/jsonbody.py",
    "llmgw/http/connslots.py",
    "llmgw/gateway/dataplane.py",
    "llmgw/gateway/request_ids.py",
    "llmgw/gateway/decisions.py",
    "llmgw/gateway/usage.py",
    "llmgw/gateway/latency.py",
    "llmgw/gateway/hops.py",
    "llmgw/gateway/tenant_gate.py",
    "llmgw/gateway/stream_usage.py",
    "llmgw/gateway/flow_gate.py",  # overload control's gate and queue: every request passes them (on by default)
    "llmgw/flow/queue.py",
    # the two learnt estimates the flow room scales each request by (the room itself stays pure: its metrics hold
    # it by weak reference, which compiled classes do not take)
    "llmgw/router/prompt_ratio.py",
    "llmgw/router/output_allowance.py",
    "llmgw/tenancy/estimate.py",
    "llmgw/router/router.py",
    "llmgw/router/canonical.py",
)


def module_name(path: str) -> str:
    """``llmgw/http/server.py`` -> ``llmgw.http.server``."""
    return path.removesuffix(".py").replace("/", ".")


def compiled_modules() -> list[str]:
    """The modules of :data:`MYPYC_MODULES` this process runs compiled (imported from a C extension)."""
    compiled = []
    for path in MYPYC_MODULES:
        name = module_name(path)
        origin = getattr(importlib.import_module(name), "__file__", None) or ""
        if origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            compiled.append(name)
    return compiled


def wheel_files() -> set[str]:
    """The files of the llmgw distribution imported here as its wheel's RECORD lists them: an extension there was
    built from the ``.py`` beside it, whatever their times (pip writes a wheel's files in no particular order)."""
    try:
        distribution = importlib.metadata.distribution("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {os.path.realpath(str(distribution.locate_file(file))) for file in distribution.files or ()}


def stale_modules(compiled: list[str]) -> list[str]:
    """Compiled modules whose ``.py`` beside them is newer than the extension (an in-place build after which the
    source was edited: the edit does not run until the build is redone or the extensions removed); an installed
    wheel's extensions are never stale."""
    stale = []
    installed = wheel_files()
    for name in compiled:
        extension = getattr(importlib.import_module(name), "__file__", None) or ""
        if os.path.realpath(extension) in installed:
            continue
        source = os.path.join(os.path.dirname(extension), name.rsplit(".", 1)[1] + ".py")
        try:
            if os.path.getmtime(source) > os.path.getmtime(extension):
                stale.append(name)
        except OSError:
            continue  # a wheel may ship the extension alone
    return stale


def describe() -> tuple[str, bool]:
    """The start-up line saying which build of the data plane runs, and whether it is a warning.

    All compiled: how many. None compiled: pure Python, and how to get the compiled build (an install built
    without ``LLMGW_MYPYC=1``, the fallback on platforms without a compiled wheel). Some: which are pure (their
    extension is missing: a broken install, a warning). Compiled but older than their source: a warning too."""
    compiled = compiled_modules()
    if not compiled:
        return (f"data plane: pure Python (0 of {len(MYPYC_MODULES)} hot modules compiled: this install was "
                f"built without LLMGW_MYPYC=1; the compiled build costs less CPU per request, docs/deploy.md "
                f"says how to get it)"), False
    line = f"data plane: {len(compiled)} of {len(MYPYC_MODULES)} hot modules compiled with mypyc"
    pure = [module_name(path) for path in MYPYC_MODULES if module_name(path) not in compiled]
    if pure:
        return f"{line}; pure Python, no extension for them in this install: {', '.join(pure)}", True
    stale = stale_modules(compiled)
    if stale:
        return (f"{line}; older than their source, which does not run until they are rebuilt "
                f"(LLMGW_MYPYC=1 python setup.py build_ext --inplace) or removed: {', '.join(stale)}"), True
    return line, False


def main(argv: list[str]) -> int:
    """``python -m llmgw.compiled [--require]``: print the start-up line of this install; ``--require``: exit 1
    unless every hot module runs compiled and current (the image's build checks the wheel it installed so)."""
    line, warning = describe()
    print(line)
    if "--require" in argv and (warning or len(compiled_modules()) != len(MYPYC_MODULES)):
        print("llmgw.compiled: --require: this install does not run the whole data plane compiled", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
