"""The rule for a name that reaches an engine's command line: a model, a LoRA adapter, a replica or shard id.

Engines get these names as arguments (``--served-model-name NAME``,
``--lora-modules NAME=PATH``): a name that starts with ``-`` reads as a flag,
one with ``=`` splits an adapter's ``NAME=PATH`` in the wrong place, and
whitespace or control characters break the engine's own parsing or the log
lines that quote it. So a name is 1 to :data:`MAX_NAME` ASCII characters:
letters, digits and ``_ . : / @ + -``, starting with a letter, a digit or
``_`` (what Hugging Face ids such as ``org/Model-7B_v1.5`` and tags such as
``llama3:8b`` need). The config schema applies it to the names in the file;
:mod:`llmgw.control.report_check` to the names a node reports.
"""

from __future__ import annotations

import re

MAX_NAME = 256
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/@+-]*")
RULE = (f"1 to {MAX_NAME} characters of letters, digits and '_ . : / @ + -', starting with a letter, a digit "
        "or '_' (no spaces, '=' or control characters: engines take it on their command line)")


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be an engine-facing name, or None when it can."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not _NAME.fullmatch(name):
        return f"must be {RULE}"
    return None
