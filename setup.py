"""The optional mypyc build: ``LLMGW_MYPYC=1`` compiles the data plane's hot modules (llmgw/compiled.py says which).

Everything else about the package is in pyproject.toml; without ``LLMGW_MYPYC=1`` this adds nothing and the
wheel is pure Python. The compiled build needs mypy (which ships mypyc) and a C compiler in the build
environment: ``LLMGW_MYPYC=1 pip install --no-build-isolation .`` with mypy installed, or in a checkout
``LLMGW_MYPYC=1 python setup.py build_ext --inplace`` (docs/development.md, "The compiled data plane").
"""

import os
import runpy

from setuptools import setup

ext_modules = []
if os.environ.get("LLMGW_MYPYC") == "1":
    try:
        from mypyc.build import mypycify
    except ImportError:
        raise SystemExit("LLMGW_MYPYC=1 needs mypy (which ships mypyc) where the package is built: "
                         "pip install 'mypy>=2.4,<2.5', then build with --no-build-isolation") from None
    here = os.path.dirname(os.path.abspath(__file__))
    modules = runpy.run_path(os.path.join(here, "llmgw", "compiled.py"))["MYPYC_MODULES"]
    ext_modules = mypycify(list(modules), opt_level="3")

setup(ext_modules=ext_modules)
